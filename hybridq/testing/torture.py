"""The pool worker's torture tier (issue 26): faults aimed at claims taken ahead, judged from outside.

``python -m hybridq.testing.torture`` (``scripts/torture``; a short seeded run is
``tests/integration/test_torture.py``, in the default test run) runs, on this machine:

* a Redis master with a replica that lags (its link goes through a fault proxy adding latency);
* ``hybridq forward`` and two pools (``hybridq worker``, one process each; pool A imports
  :mod:`hybridq.testing.ahead`, so it takes jobs ahead of its threads whatever runs), each
  reaching Redis through a fault proxy of its own;
* a producer enqueueing jobs at a steady rate: quick ones, 20-200 ms of I/O, 1-4 s ones, and
  tasks that hold the GIL for one to three leases (a C call through ``ctypes.PyDLL``).

While they run, a seeded schedule injects, one at a time:

================  ======================================================================
snapshot-restart  ``SAVE``, then SIGKILL the master and start it from that dump (older state)
cut-off           one pool's proxy moves no bytes for 1.5-3 leases (its host cut off)
warm-stop         a burst of quick jobs, then SIGTERM to a pool (restarted once it exits)
hard-stop         a burst, then SIGKILL to a pool and its processes (restarted)
burst             hundreds of quick jobs at once (take-ahead backlogs)
promote           SIGKILL the master; the lagging replica is promoted, every client moved to it
================  ======================================================================

:mod:`hybridq.testing.torture_check` judges the run from the tasks' effects file, the
acknowledgements and the ledger alone: a run that started after the ledger held its job
finished, an accepted job never run, or a stall fails it. Every repeated run is explained.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridq.context import current_job
from hybridq.testing.faultproxy import FaultProxy
from hybridq.testing.torture_check import LedgerWatch, Progress, Verdict, judge, read_runs

__all__ = ["FAULTS", "TortureConfig", "TortureResult", "main", "run_torture", "task"]

FAULTS = ("snapshot-restart", "cut-off", "warm-stop", "hard-stop", "burst", "promote")
QUEUE = "torture"
#: The task, by path (``python -m`` runs this module as ``__main__``).
TASK = "hybridq.testing.torture.task"
#: The kinds of job, and how often each is enqueued.
KINDS = (("quick", 0.55), ("io", 0.25), ("long", 0.12), ("gil", 0.08))
#: The replica's link lags by this much each way (seconds).
REPLICA_LAG_S = 0.3


def task(effects: str, token: str, kind: str, seconds: float) -> str:
    """The torture job: ``B`` at its start, its work, ``E`` at its end (one write each)."""
    job = current_job()
    job_id, attempt = (job.id, job.attempt) if job is not None else ("-", 0)
    _note(effects, "B", job_id, token, attempt)
    if kind == "gil":
        import ctypes  # noqa: PLC0415

        libc = ctypes.PyDLL(None)  # a C call that keeps the GIL: no thread of this process runs
        libc.sleep.argtypes = [ctypes.c_uint]
        left = max(1, round(seconds))
        while left > 0:
            left = libc.sleep(left)
    elif seconds > 0:
        time.sleep(seconds)
    _note(effects, "E", job_id, token, attempt)
    return token


def _note(path: str, kind: str, job_id: str, token: str, attempt: int) -> None:
    line = f"{kind} {job_id} {token} {attempt} {os.getpid()} {time.time():.6f}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class TortureConfig:
    """What to run (``python -m hybridq.testing.torture --help``)."""

    duration_s: float = 60.0
    seed: int = 0
    faults: tuple[str, ...] = FAULTS
    #: The forwarder's lease (seconds).
    lease_s: float = 2.0
    #: Jobs per second from the producer (bursts come on top).
    rate: float = 6.0
    threads: int = 4
    #: Seconds between the end of one fault and the next (drawn from [gap/2, gap*3/2]).
    gap_s: float = 5.0
    #: After the faults, how long the drain may go without a job ending.
    drain_s: float = 120.0
    #: (c): jobs waiting and none ending for this long fails the run.
    stall_s: float = 60.0
    directory: str | None = None


@dataclass
class TortureResult:
    """The verdict and the figures of one run."""

    seed: int
    verdict: Verdict
    faults: dict[str, int]
    seconds: float
    directory: str
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """What the checker says."""
        return self.verdict.ok

    def lines(self) -> list[str]:
        """The figure lines."""
        v = self.verdict
        repeats = sum(v.repeats.values())
        out = [
            "faults: " + " ".join(f"{name}={n}" for name, n in self.faults.items()),
            (
                f"accepted={v.accepted} runs={v.runs} repeated_runs={repeats} "
                f"after_finished={len(v.after_finished)} never_ran={len(v.never_ran)} "
                f"stalls={len(v.stalls)}"
            ),
        ]
        out += [f"repeated ({n}): {why}" for why, n in sorted(v.repeats.items())]
        out += [f"VIOLATION (a) {x}" for x in v.after_finished[:20]]
        out += [f"VIOLATION (b) job {x} never ran to its end" for x in v.never_ran[:20]]
        out += [f"VIOLATION (c) {x}" for x in v.stalls[:20]]
        return out

    def to_json(self) -> dict[str, Any]:
        """The JSON report."""
        v = self.verdict
        return {
            "seed": self.seed,
            "ok": self.ok,
            "seconds": round(self.seconds, 1),
            "faults": self.faults,
            "accepted": v.accepted,
            "runs": v.runs,
            "repeats": v.repeats,
            "after_finished": v.after_finished[:100],
            "never_ran": v.never_ran[:100],
            "stalls": v.stalls,
            "directory": self.directory,
        }


class _Stack:
    """The processes and servers of one run (see the module docstring)."""

    def __init__(self, cfg: TortureConfig, root: str, say: Callable[[str], None]) -> None:
        from hybridq.producer import Queue  # noqa: PLC0415 - only the harness enqueues

        self.cfg, self.root, self.say = cfg, root, say
        self.journal = os.path.join(root, "journal")
        self.effects = os.path.join(root, "effects.txt")
        self.log = open(os.path.join(root, "processes.log"), "a", encoding="utf-8")  # noqa: SIM115
        self.env = {**os.environ, "HYBRIDQ_ALLOW": "hybridq.testing.torture", "PYTHONUNBUFFERED": "1"}
        self.servers = 0
        self.master = self._server()
        self.replica: Any = None
        self.link: FaultProxy | None = None
        self.proxies = [self._proxy() for _ in range(3)]  # the forwarder's, pool A's, pool B's
        self.forwarder: subprocess.Popen[str] | None = None
        self.pools: list[subprocess.Popen[str] | None] = [None, None]
        self.stopping: dict[int, float] = {}  # pool -> when it was asked to stop warmly
        self.queue = Queue(QUEUE, self.journal)
        self.acked: dict[str, float] = {}
        self.lock = threading.Lock()

    def _server(self, *extra: str, like: Any = None) -> Any:
        """A new server (``like``: on that one's port and directory, to start from its dump)."""
        from hybridq.testing.embedded import RedisServer  # noqa: PLC0415 - imports redis

        if like is None:
            self.servers += 1
            server = RedisServer(directory=os.path.join(self.root, f"redis-{self.servers}"), extra_args=extra)
        else:
            server = RedisServer(port=like.port, directory=like.directory, extra_args=extra)
        server.start()
        return server

    def _proxy(self) -> FaultProxy:
        proxy = FaultProxy("127.0.0.1", self.master.port)
        proxy.start()
        return proxy

    def start(self) -> None:
        self._new_replica()
        self.start_forwarder()
        for n in range(len(self.pools)):
            self.start_pool(n)

    def _new_replica(self) -> None:
        self.link = FaultProxy("127.0.0.1", self.master.port)
        self.link.start()
        self.link.latency(REPLICA_LAG_S)
        self.replica = self._server("--replicaof", "127.0.0.1", str(self.link.port))

    def _spawn(self, argv: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=self.env)  # noqa: S603

    def start_forwarder(self) -> None:
        argv = [sys.executable, "-m", "hybridq", "forward", "--journal", self.journal]
        argv += ["--redis", self.proxies[0].url, "--lease", str(self.cfg.lease_s)]
        self.forwarder = self._spawn(argv)

    def start_pool(self, n: int) -> None:
        argv = [sys.executable, "-m", "hybridq", "worker", "--redis", self.proxies[1 + n].url]
        argv += ["--processes", "1", "--threads", str(self.cfg.threads)]
        argv += ["--name", f"pool{n}-{time.time():.0f}"]
        if n == 0:
            argv += ["--import", "hybridq.testing.ahead"]
        self.pools[n] = self._spawn([*argv, QUEUE])
        self.stopping.pop(n, None)

    def keep_alive(self) -> None:
        """Restart what exited; a pool stopping warmly is SIGKILLed after 30 s."""
        if self.forwarder is None or self.forwarder.poll() is not None:
            self.start_forwarder()
        for n, proc in enumerate(self.pools):
            if proc is None or proc.poll() is not None:
                self.start_pool(n)
            elif n in self.stopping and time.monotonic() - self.stopping[n] > 30:
                self._kill_tree(proc.pid)

    def enqueue(self, rng: random.Random, n: int = 1, *, quick: bool = False) -> None:
        """Enqueue ``n`` jobs (quick ones only, with ``quick``); acknowledged ones are noted."""
        calls = []
        for _ in range(n):
            kind = "quick" if quick else rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
            seconds = {
                "quick": 0.0,
                "io": rng.uniform(0.02, 0.2),
                "long": rng.uniform(1.0, 4.0),
                "gil": rng.uniform(1.0, 3.0) * self.cfg.lease_s,
            }[kind]
            token = f"{kind}-{rng.getrandbits(40):x}"
            calls.append(self.queue.prepare(TASK, (self.effects, token, kind, round(seconds, 3))))
        jobs = self.queue.enqueue_many(calls)
        now = time.time()
        with self.lock:
            for job in jobs:
                self.acked[job.id] = now

    # -- faults -------------------------------------------------------------------------------

    def snapshot_restart(self, rng: random.Random) -> None:
        with contextlib.closing(self.master.client()) as client:
            client.save()
        time.sleep(rng.uniform(0.2, 1.5))  # work goes on: the dump is older than what is lost
        self.master.kill()
        # Started from the dump, a master (a promoted replica is no longer one).
        self.master = self._server(like=self.master)

    def promote(self) -> None:
        """SIGKILL the master; promote the replica (behind by its link's lag); move every client."""
        old, self.master = self.master, self.replica
        old.kill()
        with contextlib.closing(self.master.client()) as client:
            client.execute_command("REPLICAOF", "NO", "ONE")
        for proxy in self.proxies:
            proxy.upstream = ("127.0.0.1", self.master.port)
            proxy.reset()
        if self.link is not None:
            self.link.stop()
        old.stop()
        self._new_replica()

    def stop_pool(self, n: int, *, hard: bool) -> tuple[int, ...]:
        proc = self.pools[n]
        if proc is None or proc.poll() is not None:
            return ()
        if hard:
            return self._kill_tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        self.stopping[n] = time.monotonic()
        return ()

    def _kill_tree(self, pid: int) -> tuple[int, ...]:
        from hybridq.testing.topology import children_of  # noqa: PLC0415

        pids = (pid, *children_of(pid))
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return pids

    def close(self) -> None:
        procs = [p for p in [self.forwarder, *self.pools] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._kill_tree(proc.pid)
                proc.wait()
        for proxy in [*self.proxies, self.link]:
            if proxy is not None:
                proxy.stop()
        for server in (self.master, self.replica):
            if server is not None:
                server.stop()
        self.log.close()


def run_torture(cfg: TortureConfig, *, say: Callable[[str], None] = print) -> TortureResult:
    """Run the tier (module docstring); its verdict."""
    unknown = sorted(set(cfg.faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    started = time.monotonic()
    root = cfg.directory or tempfile.mkdtemp(prefix="hybridq-torture-")
    os.makedirs(root, exist_ok=True)
    rng = random.Random(cfg.seed)  # noqa: S311 - a replayable schedule
    stack = _Stack(cfg, root, say)
    watch = LedgerWatch(stack.journal)
    progress = Progress(cfg.stall_s)
    counts = dict.fromkeys(cfg.faults, 0)
    try:
        stack.start()
        watch.start()
        say(f"torture directory: {root}")
        _serve(stack, cfg, rng, counts, progress, started, say)
        say(f"faults over: {len(stack.acked)} jobs acknowledged; draining")
        _drain(stack, cfg, progress)
        time.sleep(cfg.lease_s * 2)  # a late repeat shows itself
        _post_mortem(stack)
    finally:
        watch.stop()
        stack.close()
    runs = read_runs(stack.effects)
    verdict = judge(stack.acked, runs, watch.finished)
    verdict.stalls = progress.stalls
    result = TortureResult(cfg.seed, verdict, counts, time.monotonic() - started, root)
    with open(os.path.join(root, "faults.json"), "w", encoding="utf-8") as f:
        json.dump(counts, f)
    return result


def _serve(
    stack: _Stack,
    cfg: TortureConfig,
    rng: random.Random,
    counts: dict[str, int],
    progress: Progress,
    started: float,
    say: Callable[[str], None],
) -> None:
    end = time.monotonic() + cfg.duration_s
    next_job = time.monotonic()
    next_fault = time.monotonic() + rng.uniform(cfg.gap_s / 2, cfg.gap_s * 1.5)
    schedule: list[str] = []
    cut: tuple[FaultProxy, float] | None = None
    while time.monotonic() < end:
        now = time.monotonic()
        stack.keep_alive()
        _check(stack, progress)
        if now >= next_job:
            stack.enqueue(rng)
            next_job += rng.expovariate(cfg.rate)
        if cut is not None and now >= cut[1]:
            cut[0].blackhole(on=False)
            cut[0].reset()
            cut = None
            next_fault = now + rng.uniform(cfg.gap_s / 2, cfg.gap_s * 1.5)
        if cut is None and cfg.faults and now >= next_fault:
            if not schedule:
                schedule = rng.sample(cfg.faults, len(cfg.faults))
            name = schedule.pop()
            counts[name] += 1
            say(f"[{now - started:6.1f}s] {name}")
            cut = _inject(stack, cfg, name, rng)
            next_fault = time.monotonic() + rng.uniform(cfg.gap_s / 2, cfg.gap_s * 1.5)
        time.sleep(0.02)
    if cut is not None:
        cut[0].blackhole(on=False)
        cut[0].reset()


def _inject(
    stack: _Stack, cfg: TortureConfig, name: str, rng: random.Random
) -> tuple[FaultProxy, float] | None:
    """Inject ``name``; a cut-off returns its proxy and when to lift it."""
    pool = rng.randrange(len(stack.pools))
    if name == "snapshot-restart":
        stack.snapshot_restart(rng)
    elif name == "promote":
        stack.promote()
    elif name == "cut-off":
        proxy = stack.proxies[1 + pool]
        proxy.blackhole()
        return proxy, time.monotonic() + rng.uniform(1.5, 3.0) * cfg.lease_s
    elif name in ("warm-stop", "hard-stop"):
        stack.enqueue(rng, rng.randint(30, 120), quick=True)
        time.sleep(rng.uniform(0.1, 0.8))
        stack.stop_pool(pool, hard=name == "hard-stop")
    elif name == "burst":
        stack.enqueue(rng, rng.randint(100, 400), quick=True)
    return None


def _check(stack: _Stack, progress: Progress) -> None:
    runs = read_runs(stack.effects)
    finished = {job for job, lines in runs.items() if any(r.kind == "E" for r in lines)}
    with stack.lock:
        waiting = sum(1 for job in stack.acked if job not in finished)
    progress.check(len(finished), waiting)


def _drain(stack: _Stack, cfg: TortureConfig, progress: Progress) -> None:
    deadline = time.monotonic() + cfg.drain_s
    done = -1
    while time.monotonic() < deadline:
        stack.keep_alive()
        runs = read_runs(stack.effects)
        finished = sum(1 for job in stack.acked if any(r.kind == "E" for r in runs.get(job, ())))
        progress.check(finished, len(stack.acked) - finished)
        if finished == len(stack.acked):
            return
        if finished > done:
            done, deadline = finished, time.monotonic() + cfg.drain_s
        time.sleep(0.5)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _post_mortem(stack: _Stack) -> None:
    """Note what Redis holds of every accepted job that never ended (``stuck.txt``)."""
    runs = read_runs(stack.effects)
    stuck = [job for job in stack.acked if not any(r.kind == "E" for r in runs.get(job, ()))]
    if not stuck:
        return
    with (
        contextlib.closing(stack.master.client()) as client,
        open(os.path.join(stack.root, "stuck.txt"), "w", encoding="utf-8") as f,
    ):
        for job in stuck:
            fields = client.hgetall(f"rq:job:{job}")
            fields.pop(b"data", None)
            queue, inter = f"rq:queue:{QUEUE}", f"rq:queue:{QUEUE}:intermediate"
            where = (client.lpos(queue, job), client.lpos(inter, job))
            f.write(f"{job} queue/intermediate={where} hash={fields}\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridq.testing.torture``: run, print the figure lines; exit 1 on a violation."""
    parser = argparse.ArgumentParser(
        prog="python -m hybridq.testing.torture", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of faults (default 60)")
    parser.add_argument(
        "--seed", type=int, default=None, help="the schedule's seed (default: random, printed)"
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated (default: all)")
    parser.add_argument("--rate", type=float, default=6.0, help="jobs per second, bursts aside (default 6)")
    parser.add_argument("--report", default=None, help="write the JSON report here")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory when it passes")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    cfg = TortureConfig(
        duration_s=args.duration,
        seed=seed,
        faults=tuple(f for f in args.faults.split(",") if f),
        rate=args.rate,
    )
    _say(f"torture: seed={seed} (replay: --seed {seed} --duration {args.duration:g})")
    result = run_torture(cfg, say=_say)
    for line in result.lines():
        _say(line)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=2)
    if result.ok:
        _say(
            f"OK seed={seed}: no run after the ledger's finish, none lost, no stall ({result.seconds:.0f} s)"
        )
        if not args.keep:
            shutil.rmtree(result.directory, ignore_errors=True)
        return 0
    _say(f"FAILED seed={seed}: the run's files are in {result.directory}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
