"""Burn-down benchmark (issue 15): N jobs already queued, one worker command started, time to done.

Run it through ``scripts/bench-burn`` (it needs the ``bench`` extra; see ``docs/benchmarks.md``).
A private redis-server (no persistence) is started for the run. One measurement, for one system
and one workload:

  * FLUSHALL; N jobs of the workload (``burn.tasks``: no-op, 20 ms ``time.sleep``, ~5 ms of pure
    Python) are queued, untimed. hybridq's go in through the journal (``Queue.enqueue_many``,
    durable) with a forwarder (``python -m hybridq forward``) running, which stays up for the
    measurement (it harvests the completions, as in production); the clock waits until all N are
    in the RQ queue. The peers' go in through their own client (``rq.Queue.enqueue_many``,
    Dramatiq ``.send()``, Huey task call, Celery ``.delay()``);
  * the clock starts, then the worker command starts, with its defaults unless the row says
    otherwise (each process in a new session, logging to a file);
  * done when each of the N jobs has appended its byte to a file (the benchmark polls its size
    every 10 ms), so every system is counted by the same signal, from outside it. jobs/s is
    N / (time from the worker's start to the last job's mark): start-up counts, as it does when a
    backlog meets a fresh deploy;
  * then every process group is killed (SIGTERM, then SIGKILL after 5 s), so nothing is left over.

A measurement that has not finished within ``--max-seconds`` is stopped and its rate is the jobs
done over the time taken (marked ``*``: slow rows would otherwise take minutes); one that fails
(a worker exits, jobs never queued) is reported as failed and the run goes on. Each repetition
runs every workload, its rows in an order rotated each repetition. Reported: medians over
repetitions, spreads (min..max), each row's ratio to Dramatiq's defaults (per repetition, then the
median), and the targets of issue 15 as PASS/FAIL. The exit status is 0: a report, not a test.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import functools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import benchlib
import hybridq
import redis
from benchlib import Figure, Sample
from hybridq.testing.embedded import RedisServer
from proccpu import Meter

BENCH = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
QUEUE = "burn"
BATCH = 500
POLL_S = 0.01
READY_TIMEOUT_S = 60
STOP_GRACE_S = 5


@dataclass(frozen=True)
class Row:
    """One worker command: its key, its group (for ``--peers``), its label and how to start it."""

    key: str
    group: str
    label: str
    argv: Callable[[str], list[list[str]]]  # Redis URL -> one argv per process


def _hq(url: str, extra: list[str], procs: int) -> list[list[str]]:
    return [[str(BIN / "hybridq"), "worker", *extra, "--redis", url, QUEUE]] * procs


def _rq(url: str, extra: list[str], procs: int) -> list[list[str]]:
    return [[str(BIN / "rq"), "worker", *extra, "-u", url, QUEUE]] * procs


ROWS = [
    Row("hq", "hybridq", "hybridq worker (defaults)", lambda u: _hq(u, [], 1)),
    # The old default (RQ's Worker: a forked work-horse per job), so old and new stay comparable.
    # A flag the installed hybridq lacks makes the command exit: that row is reported as failed.
    Row("hq_rq", "hybridq", "hybridq worker --rq (fork per job)", lambda u: _hq(u, ["--rq"], 1)),
    Row("hq_simple2", "hybridq", "hybridq worker --simple x 2 processes", lambda u: _hq(u, ["--simple"], 2)),
    Row(
        "dramatiq",
        "dramatiq",
        "dramatiq (defaults: a process per core, 8 threads)",
        lambda _u: [[str(BIN / "dramatiq"), "burn.dramatiq_app"]],
    ),
    Row(
        "dramatiq_p2",
        "dramatiq",
        "dramatiq -p 2 -t 8",
        lambda _u: [[str(BIN / "dramatiq"), "-p", "2", "-t", "8", "burn.dramatiq_app"]],
    ),
    Row(
        "huey",
        "huey",
        "huey_consumer (defaults: 1 thread)",
        lambda _u: [[str(BIN / "huey_consumer"), "burn.huey_app.huey"]],
    ),
    Row(
        "huey_p2",
        "huey",
        "huey_consumer -w 2 -k process",
        lambda _u: [[str(BIN / "huey_consumer"), "-w", "2", "-k", "process", "burn.huey_app.huey"]],
    ),
    Row(
        "huey_t16",
        "huey",
        "huey_consumer -w 16 -k thread",
        lambda _u: [[str(BIN / "huey_consumer"), "-w", "16", "-k", "thread", "burn.huey_app.huey"]],
    ),
    Row(
        "celery",
        "celery",
        "celery worker (defaults: prefork, a process per core)",
        lambda _u: [[str(BIN / "celery"), "-A", "burn.celery_app", "worker"]],
    ),
    Row(
        "celery_c2",
        "celery",
        "celery worker -c 2 (prefork)",
        lambda _u: [[str(BIN / "celery"), "-A", "burn.celery_app", "worker", "-c", "2"]],
    ),
    Row(
        "celery_t16",
        "celery",
        "celery worker -P threads -c 16",
        lambda _u: [[str(BIN / "celery"), "-A", "burn.celery_app", "worker", "-P", "threads", "-c", "16"]],
    ),
    Row("rq", "rq", "rq worker (defaults: fork per job)", lambda u: _rq(u, [], 1)),
    Row(
        "rq_simple2",
        "rq",
        "rq worker -w SimpleWorker x 2 processes",
        lambda u: _rq(u, ["-w", "rq.worker.SimpleWorker"], 2),
    ),
]
BY_KEY = {r.key: r for r in ROWS}
WORKLOADS = {"noop": "no-op", "io": "20 ms I/O (sleep)", "cpu": "~5 ms CPU (pure Python)"}
BASELINE = "dramatiq"
#: Issue 15's targets: hybridq's defaults / Dramatiq's defaults, per workload.
TARGETS = {"noop": ("B1", 1.0), "io": ("B2", 0.9)}


class Failed(Exception):
    """A measurement that could not run; its message says why (one line)."""


@dataclass
class Config:
    base: str
    url: str
    server: RedisServer
    n: dict[str, int]  # jobs per measurement, by workload
    max_seconds: float
    #: Print each measurement's course (``--timeline``): jobs done and each part's CPU over time.
    timeline: bool = False


# -- processes ----------------------------------------------------------------------------------

Procs = list[tuple[subprocess.Popen[bytes], Path]]


@functools.cache
def compiled() -> None:
    """Byte-compile hybridq and the benchmark's task modules, once, before any clock starts.

    pip compiles a wheel's modules as it installs them, so every peer's come compiled; an editable
    install (this checkout) is not, and where PYTHONDONTWRITEBYTECODE is set nothing ever writes
    the files: each ``hybridq worker`` then compiled hybridq's ~50 modules from source as it
    started (~70 ms of CPU, measured), which no installed hybridq does. Written where Python reads
    them (``__pycache__``, or under PYTHONPYCACHEPREFIX).
    """
    for directory in (Path(hybridq.__file__).parent, BENCH):
        compileall.compile_dir(directory, quiet=1)


def child_env(cfg: Config, done_file: Path) -> dict[str, str]:
    compiled()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), env.get("PYTHONPATH")]))
    env["BURN_REDIS_URL"] = cfg.url
    env["BURN_DONE_FILE"] = str(done_file)
    env["HYBRIDQ_ALLOW"] = "burn.tasks"  # hybridq's worker runs only allowed functions
    return env


def spawn(argvs: list[list[str]], d: Path, name: str, env: dict[str, str]) -> Procs:
    """Each argv in a new session (so its whole process group can be killed), logging to ``d``."""
    procs: Procs = []
    for i, argv in enumerate(argvs):
        log = d / f"{name}-{i}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=d,
                start_new_session=True,
            )
        procs.append((proc, log))
    return procs


def kill_groups(procs: Procs) -> None:
    """SIGTERM each process group, SIGKILL it after a grace period: no process is left over."""
    for proc, _ in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc, _ in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc, _ in procs:
        # Also the group's other members (work-horses, pool children) if the leader is gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(procs: Procs) -> str:
    """The last line of the first log of a process that exited, for a one-line failure."""
    for proc, log in procs:
        if proc.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            return f"{Path(str(proc.args[0])).name} exited {proc.returncode}: {lines[-1] if lines else ''}"  # type: ignore[index]
    return ""


# -- queueing the backlog (untimed) -------------------------------------------------------------


def fill_hybridq(cfg: Config, workload: str, n: int, d: Path, env: dict[str, str]) -> Procs:
    """A forwarder, then ``n`` durable enqueues; returns once all ``n`` are in the RQ queue."""
    from hybridq import Queue  # noqa: PLC0415  # only the parent needs it
    from hybridq.producer.queue import shared_writer  # noqa: PLC0415
    from hybridq.protocol import keys  # noqa: PLC0415  # only the parent needs it

    journal = str(d / "journal")
    fwd = spawn(
        [[sys.executable, "-m", "hybridq", "forward", "--journal", journal, "--redis", cfg.url]],
        d,
        "forwarder",
        env,
    )
    q = Queue(QUEUE, journal)
    try:
        for first in range(0, n, BATCH):
            q.enqueue_many([q.prepare(f"burn.tasks.{workload}") for _ in range(first, min(n, first + BATCH))])
    finally:
        shared_writer(q.journal, q.durability).close()
    with redis.Redis.from_url(cfg.url) as conn:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while conn.llen(keys.rq_queue(QUEUE)) < benchlib.ready_to_burn(n):
            if time.monotonic() > deadline or fwd[0][0].poll() is not None:
                kill_groups(fwd)
                raise Failed(
                    f"the forwarder did not queue {benchlib.ready_to_burn(n)} jobs within {READY_TIMEOUT_S} s {tail(fwd)}"
                )
            time.sleep(POLL_S)
    return fwd


def fill_rq(cfg: Config, workload: str, n: int) -> None:
    import rq  # noqa: PLC0415

    with redis.Redis.from_url(cfg.url) as conn:
        q = rq.Queue(QUEUE, connection=conn)
        for first in range(0, n, BATCH):
            with conn.pipeline() as pipe:
                q.enqueue_many(
                    [
                        rq.Queue.prepare_data(f"burn.tasks.{workload}")
                        for _ in range(first, min(n, first + BATCH))
                    ],
                    pipeline=pipe,
                )
                pipe.execute()


def fill_peer(cfg: Config, group: str, workload: str, n: int) -> None:
    """``n`` jobs through the peer's own client (its app module, imported here once)."""
    os.environ["BURN_REDIS_URL"] = cfg.url  # read by the app modules at import
    if group == "rq":
        fill_rq(cfg, workload, n)
    elif group == "dramatiq":
        from burn import dramatiq_app  # noqa: PLC0415

        actor = dramatiq_app.ACTORS[workload]
        for _ in range(n):
            actor.send()
    elif group == "huey":
        from burn import huey_app  # noqa: PLC0415

        for _ in range(n):
            huey_app.TASKS[workload]()
    elif group == "celery":
        from burn import celery_app  # noqa: PLC0415

        for _ in range(n):
            celery_app.TASKS[workload].delay()


# -- one measurement ----------------------------------------------------------------------------


def measure(cfg: Config, row: Row, workload: str) -> Sample:
    """Queue ``n`` jobs, start ``row``'s worker command, time until all are done; stop everything."""
    n = cfg.n[workload]
    cfg.server.flushall()
    d = Path(tempfile.mkdtemp(prefix=f"{row.key}-{workload}-", dir=cfg.base))
    done_file = d / "done"
    done_file.touch()
    env = child_env(cfg, done_file)
    procs: Procs = []
    try:
        if row.group == "hybridq":
            procs += fill_hybridq(cfg, workload, n, d, env)
        else:
            fill_peer(cfg, row.group, workload, n)
        meter = Meter(cfg.url, {"forwarder": [p.pid for p, _ in procs], "worker": []})
        meter.start()
        t0 = time.perf_counter()
        workers = spawn(row.argv(cfg.url), d, row.key, env)
        meter.groups["worker"] = [p.pid for p, _ in workers]
        procs += workers
        deadline = t0 + cfg.max_seconds
        course: list[tuple[float, int, dict[str, float]]] = []
        while True:
            done = done_file.stat().st_size
            now = time.perf_counter()
            if cfg.timeline:
                course.append((now - t0, done, meter.stop()))
            if done >= n or now > deadline:
                used = meter.stop()
                if cfg.timeline:
                    print_course(row, workload, course)
                CPU.setdefault((workload, row.key), []).append({k: v / max(done, 1) for k, v in used.items()})
                return Sample(n, now - t0) if done >= n else Sample(done, now - t0, extra={"capped": 1.0})
            if all(p.poll() is not None for p, _ in workers):
                raise Failed(f"{done} of {n} jobs done when the worker exited; {tail(workers)}")
            time.sleep(POLL_S)
    finally:
        kill_groups(procs)
        shutil.rmtree(d, ignore_errors=True)
        cfg.server.flushall()


def print_course(row: Row, workload: str, course: list[tuple[float, int, dict[str, float]]]) -> None:
    """One measurement's course, about every 0.1 s: seconds since the worker command started,
    jobs done, and the CPU milliseconds each part used so far (``--timeline``).

    Reading each part's CPU from ``/proc`` at every poll costs the machine a little itself.
    """
    first = next((t for t, done, _ in course if done), None)
    cells, last = [], -1.0
    for t, done, used in course:
        if t - last >= 0.1:
            parts = " ".join(f"{part[0]}{used[part] * 1000:.0f}" for part in CPU_PARTS if part in used)
            cells.append(f"{t:.1f}s:{done} ({parts})")
            last = t
    start = "none" if first is None else f"{first:.3f} s"
    print(f"  course {workload} {row.key}: first job done at {start}; " + ", ".join(cells))


#: CPU seconds per job each part used during the timed burn, per (workload, row key) and
#: repetition: parts "forwarder" (hybridq rows only), "worker" (the row's process groups) and
#: "redis". Less sensitive to a shared machine than jobs/s, and it says where the time went.
CPU: dict[tuple[str, str], list[dict[str, float]]] = {}
CPU_PARTS = ("forwarder", "worker", "redis")


def print_cpu(rows: list[Row], workloads: list[str]) -> dict[str, dict[str, float]]:
    """The CPU table (medians over repetitions, us per job); returns it by ``workload/row key``."""
    table: list[tuple[str, ...]] = [("workload, worker command", *CPU_PARTS, "total")]
    out: dict[str, dict[str, float]] = {}
    for workload in workloads:
        for row in rows:
            reps = CPU.get((workload, row.key))
            if not reps:
                continue
            med = {part: statistics.median(r.get(part, 0.0) for r in reps) * 1e6 for part in CPU_PARTS}
            med["total"] = statistics.median(sum(r.get(p, 0.0) for p in CPU_PARTS) for r in reps) * 1e6
            out[f"{workload}/{row.key}"] = med
            cells = (
                "" if part == "forwarder" and row.group != "hybridq" else f"{med[part]:,.0f}"
                for part in CPU_PARTS
            )
            table.append((f"{workload}: {row.label}", *cells, f"{med['total']:,.0f}"))
    if out:
        print("CPU per job during the timed burn, medians (us; /proc and Redis's INFO cpu):")
        benchlib.print_rows(table, {1, 2, 3, 4})
        print()
    return out


# -- the run ------------------------------------------------------------------------------------

Results = dict[str, dict[str, list[Sample | None]]]  # workload -> row key -> per repetition


def run(cfg: Config, rows: list[Row], workloads: list[str], repeat: int) -> tuple[Results, dict[str, str]]:
    results: Results = {w: {r.key: [] for r in rows} for w in workloads}
    errors: dict[str, str] = {}
    for rep in range(repeat):
        for workload in benchlib.rotated(workloads, rep):
            for row in benchlib.rotated(rows, rep):
                try:
                    s: Sample | None = measure(cfg, row, workload)
                except (Failed, OSError, redis.RedisError, ImportError) as e:
                    s = None
                    errors[f"{workload}/{row.key}"] = f"{type(e).__name__}: {e}".replace("\n", " ")
                results[workload][row.key].append(s)
                shown = (
                    "FAILED" if s is None else f"{s.rate:>9,.0f} jobs/s" + ("  (capped)" if s.extra else "")
                )
                print(
                    f"  [rep {rep + 1}/{repeat}] {workload:<4} {row.label:<55} {shown}",
                    file=sys.stderr,
                    flush=True,
                )
    print(file=sys.stderr)
    return results, errors


def ratios(samples: list[Sample | None], base: list[Sample | None]) -> list[float]:
    """This row's jobs/s over the baseline's, for each repetition where both ran."""
    return [a.rate / b.rate for a, b in zip(samples, base, strict=True) if a is not None and b is not None]


def ratio_cell(values: list[float]) -> str:
    """``median x (min..max)`` of per-repetition ratios, or empty."""
    if not values:
        return ""
    med, rng = benchlib.spread(values, ".2f")
    return f"{med}x ({rng})"


def print_report(results: Results, rows: list[Row], errors: dict[str, str]) -> list[Figure]:
    figures: list[Figure] = []
    for workload, by_row in results.items():
        print(f"{WORKLOADS[workload]} jobs:")
        table: list[tuple[str, ...]] = [
            ("worker command", "jobs/s (median)", "spread (min..max)", "seconds", f"/ {BASELINE}")
        ]
        base = by_row.get(BASELINE)
        for row in rows:
            ok = [s for s in by_row[row.key] if s is not None]
            if not ok:
                table.append((row.label, "failed", "", "", ""))
                continue
            med, rng = benchlib.spread([s.rate for s in ok], ",.0f")
            star = "*" if any(s.extra for s in ok) else ""
            r = ratios(by_row[row.key], base) if base else []
            table.append(
                (
                    row.label,
                    med + star,
                    rng,
                    f"{statistics.median(s.seconds for s in ok):.1f}",
                    ratio_cell(r),
                )
            )
            if r and row.key != BASELINE:
                figures.append(Figure(f"{workload}: {row.label} / {BASELINE} defaults", r))
        benchlib.print_rows(table, {1, 2, 3, 4})
    capped = any(
        s is not None and s.extra for by_row in results.values() for ss in by_row.values() for s in ss
    )
    if capped:
        print("* stopped at --max-seconds in at least one repetition: jobs done / time taken\n")
    for what, why in errors.items():
        print(f"failed: {what}: {why}")
    if errors:
        print()
    print("targets (issue 15; hybridq worker defaults / dramatiq defaults, per repetition, then median):")
    for workload, (tid, bound) in TARGETS.items():
        by_row = results.get(workload, {})
        r = ratios(by_row["hq"], by_row[BASELINE]) if "hq" in by_row and BASELINE in by_row else []
        name = f"{tid} {WORKLOADS[workload]}: hybridq / dramatiq, jobs/s"
        if r:
            figures.append(benchlib.target(tid, name, r, bound))
        else:
            why = (
                "workload not selected"
                if workload not in results
                else "a row not selected"
                if "hq" not in by_row
                else "no repetition where both ran"
            )
            print(f"  n/a   {name:<44} {why}; target >= {bound:g}x")
    print()
    verdicts = [f.ok for f in figures if f.goal]
    if verdicts:
        benchlib.print_result(verdicts)
    else:
        print("RESULT: no target measured in this run")
    return figures


# -- main ---------------------------------------------------------------------------------------


def pick_list(value: str | None, known: list[str], what: str) -> list[str]:
    if value is None:
        return known
    chosen = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in chosen if x not in known]
    if bad or not chosen:
        sys.exit(f"bench-burn: unknown {what} {','.join(bad) or '(none)'}; choose from {','.join(known)}")
    return chosen


EPILOG = """\
each measurement: FLUSHALL; N jobs queued (untimed; hybridq's through the journal, with a
forwarder running); the clock starts and ONE worker command starts; done when every job has
appended its byte to a file (polled every 10 ms); every process group killed. jobs/s = N / time.

rows (--peers takes a system or a row key):
  hq          hybridq worker                          (defaults)
  hq_rq       hybridq worker --rq                     (RQ's Worker: a forked work-horse per job)
  hq_simple2  hybridq worker --simple, 2 processes
  dramatiq    dramatiq burn.dramatiq_app              (defaults: a process per core, 8 threads)
  dramatiq_p2 dramatiq -p 2 -t 8 ...                  (2 cores, whatever the machine has)
  huey        huey_consumer burn.huey_app.huey        (defaults: 1 thread)
  huey_p2     huey_consumer -w 2 -k process ...
  huey_t16    huey_consumer -w 16 -k thread ...
  celery      celery -A burn.celery_app worker        (defaults: prefork, a process per core)
  celery_c2   celery -A burn.celery_app worker -c 2
  celery_t16  celery -A burn.celery_app worker -P threads -c 16
  rq          rq worker                               (defaults: a forked work-horse per job)
  rq_simple2  rq worker -w rq.worker.SimpleWorker, 2 processes
a row whose command exits (a flag this hybridq does not have yet, say) is reported as failed,
with the last line of its log, and the run goes on.

targets (issue 15), printed as PASS/FAIL; the exit status is 0 either way (a report):
  B1  hybridq defaults / dramatiq defaults, no-op jobs     >= 1.0x
  B2  hybridq defaults / dramatiq defaults, 20 ms I/O jobs >= 0.9x

--faults switches to throughput under faults: the same burn-down while the worker, Redis and
the forwarder are killed or flushed (scripts/bench-burn --faults --help).

see docs/benchmarks.md ("Burn-down", "Throughput under faults").
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = benchlib.arg_parser("scripts/bench-burn", __doc__)
    for action in p._actions:
        if action.dest == "repeat":
            action.help = "interleaved repetitions (default 3; 1 with --quick)"
        elif action.dest == "quick":
            action.help = "no-op jobs only, small counts, 1 repetition: a smoke run (~20 s)"
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument(
        "--n", type=int, default=None, help="no-op jobs per measurement (default 5,000; 200 with --quick)"
    )
    p.add_argument(
        "--n-slow",
        type=int,
        default=None,
        help="I/O- and CPU-bound jobs per measurement (default 1,000; 100 with --quick)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop a measurement after this long and report jobs done / time (default 20; 4 with --quick)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="workloads, comma-separated: noop,io,cpu (default all; noop with --quick)",
    )
    groups = list(dict.fromkeys(r.group for r in ROWS))
    p.add_argument(
        "--peers",
        default=None,
        help=f"systems or rows, comma-separated: {','.join(groups)} or {','.join(BY_KEY)} (default all; "
        f"{BASELINE} always runs: the ratios' denominator)",
    )
    p.add_argument("--dir", default=None, help="parent of the temporary directories (default: a new tempdir)")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="print each measurement's course: when its first job was done, then about every 0.1 s the "
        "jobs done and the CPU ms each part (f: forwarder, w: worker, r: Redis) used so far",
    )
    benchlib.add_json_option(p)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    if "--faults" in argv:  # throughput under faults: a mode of its own
        import burndown_faults  # noqa: PLC0415

        return burndown_faults.main([a for a in argv if a != "--faults"])
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with stderr
    repeat = benchlib.pick(args.repeat, args.quick, 1, 3)
    n_fast = benchlib.pick(args.n, args.quick, 200, 5000)
    n_slow = benchlib.pick(args.n_slow, args.quick, 100, 1000)
    max_s = benchlib.pick(args.max_seconds, args.quick, 4.0, 20.0)
    if repeat < 1 or n_fast < 1 or n_slow < 1 or max_s <= 0:
        sys.exit("bench-burn: --repeat, --n, --n-slow and --max-seconds must be > 0")
    workloads = pick_list(args.only if args.only or not args.quick else "noop", list(WORKLOADS), "workload")
    names = pick_list(args.peers, [*dict.fromkeys(r.group for r in ROWS), *BY_KEY], "peer")
    rows = [r for r in ROWS if r.key in names or r.group in names or r.key == BASELINE]
    missing = [r.argv("redis://")[0][0] for r in rows if not Path(r.argv("redis://")[0][0]).exists()]
    if missing:
        sys.exit(
            f"bench-burn: not installed: {', '.join(missing)} (install the bench extra: pip install -e '.[bench]')"
        )
    base = benchlib.make_base("bench-burn", args.dir)
    try:
        with RedisServer(directory=os.path.join(base, "redis")) as server:
            n = {"noop": n_fast, "io": n_slow, "cpu": n_slow}
            cfg = Config(base, server.url, server, n, max_s, timeline=args.timeline)
            header = benchlib.print_redis_machine("hybridq burn-down benchmark (issue 15)", base, server)
            v = benchlib.version
            header["peers"] = (
                f"dramatiq {v('dramatiq')}, huey {v('huey')}, celery {v('celery')}, kombu {v('kombu')}"
            )
            header["run"] = (
                f"mode={'quick' if args.quick else 'default'}, {repeat} repetitions; per measurement "
                + ", ".join(f"{n[w]:,} {w}" for w in workloads)
                + " jobs queued (untimed), then one worker command started; timed from its start to the "
                f"last job's mark in a file (polled every {POLL_S * 1000:g} ms); stopped after {max_s:g} s "
                "(*); rows in an order rotated each repetition"
            )
            for label in ("peers", "run"):
                benchlib.print_field(label, header[label])
            print()
            results, errors = run(cfg, rows, workloads, repeat)
            figures = print_report(results, rows, errors)
            cpu = print_cpu(rows, workloads)
            if args.json:
                json_rows: dict[str, dict[str, object]] = {}
                for workload, by_row in results.items():
                    for row in rows:
                        ok = [s for s in by_row[row.key] if s is not None]
                        key = f"{workload}/{row.key}"
                        json_rows[key] = (
                            benchlib.row_dict(row.label, ok, "jobs/s") if ok else {"label": row.label}
                        ) | {
                            "workload": workload,
                            "system": row.group,
                            "n": n[workload],
                            "capped_reps": sum(1 for s in ok if s.extra),
                            "error": errors.get(key, ""),
                            "cpu_us_per_job": cpu.get(key, {}),
                        }
                benchlib.write_json(args.json, "bench-burn", header, json_rows, figures)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
