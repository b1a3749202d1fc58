"""Throughput under faults (issue 15, item 5): the burn-down while faults hit it.

Run it as ``scripts/bench-burn --faults`` (see ``docs/benchmarks.md``, "Throughput under
faults"). A private redis-server (no persistence, a free port) and one measurement:

  * N no-op jobs (``burn.marks.mark``) go in through the journal (``Queue.enqueue_many``,
    durable: every one is accepted) with a forwarder (``python -m hybridq forward --lease L``)
    running; untimed, until all N are in the RQ queue;
  * the clock starts, then ONE worker command (``hybridq worker`` with its defaults, or
    ``--worker-args``), in a session of its own;
  * F faults hit it at even steps of progress: fault *i* when *i*/(F+1) of the N jobs have run,
    their kinds in seeded rounds of the chosen ones: ``worker-kill`` (SIGKILL the worker
    command's whole process group and its descendants, then start it again),
    ``redis-restart`` (SIGKILL redis-server, start it again empty on the same port),
    ``flushall`` and ``forwarder-kill`` (SIGKILL, then start it again). A process is started
    again 0.5 s after its kill (a supervisor's pause, as in ``hybridq chaos``); a worker or
    forwarder that exits on its own is started again too, and counted;
  * each run of a job appends ``job_id pid time`` to a file; ``seconds`` runs from the worker's
    start to the first run of the last job, jobs/s = N / seconds; then the benchmark waits until
    the forwarder's ledger holds all N as succeeded (``settled_s``), and ``2 x lease`` more for a
    late duplicate.

Verdict, from that file, the fault log and hybridq's ledger (``hybridq status``):

  * **lost**: accepted jobs that never ran, or that the ledger does not hold as succeeded at the
    end (the larger of the two counts);
  * **dup_execution**: a run of a job after a run of it had ended, unless a fault explains it,
    exactly as ``hybridq chaos`` counts it (``hybridq.testing.chaos``): the run's process was
    SIGKILLed less than a second after the job ended (its outcome not stored yet), or Redis lost
    its data (restart, FLUSHALL) at most 3 s after the job ended (the outcome was in Redis, not
    yet in the ledger: the window of docs/guarantees.md). Such runs are counted as ``excused``.

With a baseline (the default, not with ``--quick``), the same burn-down runs first without
faults, and the ratio faults / no faults is printed. The exit status is 1 if a job was lost or
ran again unexcused (a guarantee broken), 0 otherwise, whatever the throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib
import redis
from benchlib import Figure
from burndown import BENCH, BIN, QUEUE, Failed, Procs, kill_groups, spawn, tail
from hybridq.testing.chaos import ChaosConfig
from hybridq.testing.chaos_check import DATA_LOSS, KILLS, Run, excuse
from hybridq.testing.embedded import RedisServer
from hybridq.testing.topology import Fault, children_of

KINDS = ("worker-kill", "redis-restart", "flushall", "forwarder-kill")
TASK = "burn.marks.mark"
BATCH = 1000
POLL_S = 0.02
RESTART_PAUSE_S = 0.5
#: As ``hybridq chaos``: a run that ended this long before Redis lost its data may run again.
WINDOW_S = ChaosConfig().window_s


@dataclass
class Config:
    base: str
    server: RedisServer
    n: int
    worker_args: list[str]
    lease_s: float
    drain_s: float
    kinds: tuple[str, ...]
    keep: bool = False


@dataclass
class Burn:
    """The processes of one measurement and what their jobs noted."""

    cfg: Config
    d: Path
    env: dict[str, str]
    effects: Path
    forwarder: Procs = field(default_factory=list)
    worker: Procs = field(default_factory=list)
    runs: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    restarts: Counter[str] = field(default_factory=Counter)
    offset: int = 0
    partial: bytes = b""
    generation: int = 0

    def start_forwarder(self) -> None:
        argv = [sys.executable, "-m", "hybridq", "forward", "--journal", str(self.d / "journal")]
        argv += ["--redis", self.cfg.server.url, "--lease", f"{self.cfg.lease_s:g}"]
        self.generation += 1
        self.forwarder = spawn([argv], self.d, f"forwarder{self.generation}", self.env)

    def start_worker(self) -> None:
        argv = [str(BIN / "hybridq"), "worker", *self.cfg.worker_args, "--redis", self.cfg.server.url, QUEUE]
        self.generation += 1
        self.worker = spawn([argv], self.d, f"worker{self.generation}", self.env)

    def poll(self) -> int:
        """Read the runs noted since the last call; the number of jobs that ran at least once."""
        with self.effects.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        for line in lines:
            job_id, pid, at = line.decode().split()
            self.runs[job_id].append((int(pid), float(at)))
        return len(self.runs)

    def keep_alive(self) -> None:
        """Start again a worker or forwarder that exited on its own (a supervisor's job)."""
        for name, procs, start in (
            ("worker", self.worker, self.start_worker),
            ("forwarder", self.forwarder, self.start_forwarder),
        ):
            if procs and procs[0][0].poll() is not None:
                self.restarts[f"{name} exited ({tail(procs)})"] += 1
                start()

    def inject(self, kind: str) -> Fault:
        at = time.time()
        pids: tuple[int, ...] = ()
        if kind in {"worker-kill", "forwarder-kill"}:
            procs = self.worker if kind == "worker-kill" else self.forwarder
            pids = kill_tree(procs[0][0])
            time.sleep(RESTART_PAUSE_S)
            (self.start_worker if kind == "worker-kill" else self.start_forwarder)()
        elif kind == "redis-restart":
            self.cfg.server.restart()
        elif kind == "flushall":
            self.cfg.server.flushall()
        else:
            raise ValueError(kind)
        return Fault(kind, at, time.time(), pids)

    def close(self) -> None:
        kill_groups(self.worker + self.forwarder)


def kill_tree(proc: subprocess.Popen[bytes]) -> tuple[int, ...]:
    """SIGKILL ``proc``'s process group and every descendant of it (a child may leave the group)."""
    pids = {proc.pid}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if (
                entry.isdigit()
                and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) == proc.pid
            ):
                pids.add(int(entry))
    todo = [proc.pid]
    while todo:
        for child in children_of(todo.pop()):
            if child not in pids:
                pids.add(child)
                todo.append(child)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    return tuple(sorted(pids))


def fill(burn: Burn, n: int) -> set[str]:
    """``n`` durable enqueues; returns their job ids once all ``n`` are in the RQ queue."""
    from hybridq import Queue  # noqa: PLC0415
    from hybridq.producer.queue import shared_writer  # noqa: PLC0415
    from hybridq.protocol import keys  # noqa: PLC0415

    q = Queue(QUEUE, str(burn.d / "journal"))
    ids: set[str] = set()
    try:
        for first in range(0, n, BATCH):
            ids.update(
                j.id for j in q.enqueue_many([q.prepare(TASK) for _ in range(first, min(n, first + BATCH))])
            )
    finally:
        shared_writer(q.journal, q.durability).close()
    timeout = 60 + n / 500
    with redis.Redis.from_url(burn.cfg.server.url) as conn:
        deadline = time.monotonic() + timeout
        while conn.llen(keys.rq_queue(QUEUE)) < benchlib.ready_to_burn(n):
            if time.monotonic() > deadline or burn.forwarder[0][0].poll() is not None:
                raise Failed(
                    f"the forwarder did not queue {benchlib.ready_to_burn(n)} jobs within {timeout:.0f} s {tail(burn.forwarder)}"
                )
            time.sleep(POLL_S)
    return ids


def ledger(burn: Burn) -> dict[str, Any]:
    from hybridq.ops.status import collect_status  # noqa: PLC0415

    return collect_status(str(burn.d / "journal"))


def measure(cfg: Config, faults: int, rng: random.Random, say: Any) -> dict[str, Any]:
    """One burn-down of ``cfg.n`` jobs with ``faults`` faults; its figures and verdict."""
    cfg.server.flushall()
    d = Path(tempfile.mkdtemp(prefix="faults-" if faults else "baseline-", dir=cfg.base))
    effects = d / "effects"
    effects.touch()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), env.get("PYTHONPATH")]))
    env["BURN_DONE_FILE"] = str(effects)
    env["HYBRIDQ_ALLOW"] = "burn.marks"
    burn = Burn(cfg, d, env, effects)
    steps = [cfg.n * (i + 1) // (faults + 1) for i in range(faults)]
    schedule: list[str] = []
    log: list[Fault] = []
    try:
        burn.start_forwarder()
        ids = fill(burn, cfg.n)
        t0 = time.time()
        burn.start_worker()
        done, progress_at = 0, time.monotonic()
        # A worker faster than the polling can finish past several steps at once, or all of
        # them: a fault whose step was passed still fires (at the end, if need be).
        while done < cfg.n or steps:
            if (ran := burn.poll()) > done:
                done, progress_at = ran, time.monotonic()
            elif time.monotonic() - progress_at > cfg.drain_s:
                say(f"  no job ran for {cfg.drain_s:g} s: {cfg.n - done} never ran")
                break
            if steps and done >= steps[0]:
                steps.pop(0)
                if not schedule:  # seeded rounds of every kind: each is covered
                    schedule = rng.sample(cfg.kinds, len(cfg.kinds))
                log.append(burn.inject(schedule.pop()))
                say(f"  [{time.time() - t0:6.1f}s] {done:>7,} of {cfg.n:,} ran: {log[-1].name}")
                continue
            burn.keep_alive()
            time.sleep(POLL_S)
        firsts = [min(at for _, at in burn.runs[i]) for i in ids if i in burn.runs]
        seconds = (max(firsts) - t0) if firsts else float("nan")
        status, deadline = ledger(burn), time.monotonic() + cfg.drain_s
        while status["succeeded"] < cfg.n and time.monotonic() < deadline:
            burn.keep_alive()
            time.sleep(0.5)
            status = ledger(burn)
        settled = time.time() - t0
        time.sleep(max(2.0, 2 * cfg.lease_s))  # long enough for a late duplicate to show itself
        burn.poll()
        return verdict(ids, burn, log, status) | {
            "n": cfg.n,
            "seconds": round(seconds, 3),
            "jobs_per_s": round(cfg.n / seconds, 1) if firsts else 0.0,
            "settled_s": round(settled, 3),
            "restarts": dict(burn.restarts),
        }
    finally:
        burn.close()
        if not cfg.keep:
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(Exception):
            cfg.server.flushall()


def verdict(ids: set[str], burn: Burn, log: list[Fault], status: dict[str, Any]) -> dict[str, Any]:
    """lost, dup_execution (as ``hybridq chaos`` counts it), the excused re-runs and the faults."""
    killed = {pid: f for f in log if f.name in KILLS for pid in f.pids}
    losses = [f for f in log if f.name in DATA_LOSS]
    excused: Counter[str] = Counter()
    violations = []
    for job_id, runs in burn.runs.items():
        for (pid0, at0), (pid1, at1) in itertools.pairwise(sorted(runs, key=lambda r: r[1])):
            # A no-op job notes its run at its end: the run's start and end are the same instant.
            prev, run = Run("B", 0, pid0, at0), Run("B", 0, pid1, at1)
            cause = excuse(prev, Run("E", 0, pid0, at0), run, killed, losses, [], WINDOW_S)
            if cause is None:
                violations.append(
                    f"{job_id} ran again at {at1:.3f} (pid {pid1}) after a run ended at {at0:.3f} (pid {pid0})"
                )
            else:
                excused[cause.name] += 1
    never_ran = len(ids - set(burn.runs))
    not_succeeded = len(ids) - int(status["succeeded"])
    return {
        "faults": dict(Counter(f.name for f in log)),
        "lost": max(never_ran, not_succeeded),
        "never_ran": never_ran,
        "ledger": {
            k: status[k] for k in ("accepted", "succeeded", "failed", "pending", "duplicates_suppressed")
        },
        "dup_execution": len(violations),
        "excused_reruns": dict(excused),
        "unknown_ran": len(set(burn.runs) - ids),
        "violations": violations[:100],
    }


# -- the report ---------------------------------------------------------------------------------


def report(results: dict[str, dict[str, Any]]) -> list[Figure]:
    """One line per run (then its ledger, excused re-runs, violations), the ratio, the verdict."""
    print()
    for name, r in results.items():
        faults = ", ".join(f"{k}={v}" for k, v in sorted(r["faults"].items())) or "none"
        print(
            f"{name:<9} {r['n']:>7,} jobs  {r['jobs_per_s']:>8,.0f} jobs/s  {r['seconds']:7.1f} s to run, "
            f"{r['settled_s']:.1f} s to the ledger  lost={r['lost']} dup_execution={r['dup_execution']}  "
            f"faults: {faults}"
        )
        print(f"          ledger {r['ledger']}; excused re-runs {r['excused_reruns'] or 'none'}")
        if r["restarts"]:
            print(f"          started again after exiting on their own: {r['restarts']}")
        for v in r["violations"][:10]:
            print(f"          VIOLATION {v}")
    figures = []
    if "baseline" in results and results["baseline"]["jobs_per_s"] > 0:
        ratio = results["faults"]["jobs_per_s"] / results["baseline"]["jobs_per_s"]
        print(f"\njobs/s under faults / without faults: {ratio:.2f}x (one run each, side by side)")
        figures.append(Figure("jobs/s under faults / without faults", [ratio]))
    verdict = "OK: nothing lost, no finished job ran again" if ok(results) else "FAILED: a guarantee broke"
    print(f"RESULT: {verdict}")
    return figures


def ok(results: dict[str, dict[str, Any]]) -> bool:
    return all(r["lost"] == 0 and r["dup_execution"] == 0 and r["unknown_ran"] == 0 for r in results.values())


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/bench-burn --faults", description=__doc__.split("\n\n", maxsplit=1)[0]
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", maxsplit=1)[1]
    p.add_argument(
        "--quick",
        action="store_true",
        help="2,000 jobs, 4 faults (one of each kind), no baseline: a smoke run (< 2 min)",
    )
    p.add_argument("--n", type=int, default=None, help="jobs (default 50,000; 2,000 with --quick)")
    p.add_argument("--count", type=int, default=None, help="faults (default 8; 4 with --quick)")
    p.add_argument(
        "--kinds", default=",".join(KINDS), help=f"fault kinds, comma-separated (default {','.join(KINDS)})"
    )
    p.add_argument(
        "--worker-args", default="", help="arguments for `hybridq worker` (default none: its defaults)"
    )
    p.add_argument(
        "--lease",
        type=float,
        default=2.0,
        help="the forwarder's --lease, seconds (default 2, as hybridq chaos)",
    )
    p.add_argument(
        "--drain",
        type=float,
        default=None,
        help="give up after this long without progress (default 60; 30 with --quick)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="seed of the fault kinds' order (default: random, printed)"
    )
    baseline = p.add_mutually_exclusive_group()
    baseline.add_argument(
        "--baseline",
        action="store_true",
        default=None,
        help="also run without faults first (the default without --quick)",
    )
    baseline.add_argument("--no-baseline", dest="baseline", action="store_false", help="do not")
    p.add_argument("--dir", default=None, help="parent of the temporary directories (default: a new tempdir)")
    p.add_argument(
        "--keep", action="store_true", help="keep the run's directory (journal, logs) to look into"
    )
    benchlib.add_json_option(p)
    args = p.parse_args(argv)
    args.n = benchlib.pick(args.n, args.quick, 2000, 50_000)
    args.count = benchlib.pick(args.count, args.quick, 4, 8)
    args.drain = benchlib.pick(args.drain, args.quick, 30.0, 60.0)
    args.baseline = (not args.quick) if args.baseline is None else args.baseline
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if bad := sorted(set(args.kinds) - set(KINDS)) or ([] if args.kinds else ["(none)"]):
        p.error(f"--kinds: unknown {','.join(bad)}; choose from {','.join(KINDS)}")
    if args.n < 1 or args.count < 0 or args.lease <= 0 or args.drain <= 0:
        p.error("--n, --lease and --drain must be > 0, --count >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    base = benchlib.make_base("bench-burn-faults", args.dir)
    try:
        with RedisServer(directory=os.path.join(base, "redis")) as server:
            header = benchlib.print_redis_machine("hybridq burn-down under faults (issue 15)", base, server)
            command = shlex.join(["hybridq", "worker", *shlex.split(args.worker_args)])
            header["run"] = (
                f"mode={'quick' if args.quick else 'default'}, seed={seed}; {args.n:,} no-op jobs queued through "
                f"the journal (untimed), then `{command}` started; {args.count} faults ({','.join(args.kinds)}) "
                f"at even steps of progress; forwarder --lease {args.lease:g}"
                + ("; a baseline run without faults first" if args.baseline else "")
            )
            benchlib.print_field("run", header["run"])
            cfg = Config(
                base,
                server,
                args.n,
                shlex.split(args.worker_args),
                args.lease,
                args.drain,
                args.kinds,
                args.keep,
            )
            rng = random.Random(seed)  # an order of faults, not a secret
            results: dict[str, dict[str, Any]] = {}
            try:
                for name, count in ([("baseline", 0)] if args.baseline else []) + [("faults", args.count)]:
                    print(f"\n{name}:", file=sys.stderr)
                    results[name] = measure(cfg, count, rng, lambda s: print(s, file=sys.stderr, flush=True))
            except (Failed, OSError, redis.RedisError) as e:
                print(f"bench-burn --faults: {type(e).__name__}: {e}".replace("\n", " "))
                return 1
            figures = report(results)
            if args.json:
                benchlib.write_json(
                    args.json, "bench-burn-faults", header, results, figures, seed=seed, ok=ok(results)
                )
    finally:
        if args.keep:
            print(f"kept {base} (journal, logs)")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0 if ok(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
