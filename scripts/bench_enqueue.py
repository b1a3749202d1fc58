"""Enqueue benchmark: hybridq's durable ``Queue.enqueue`` next to ``rq.Queue.enqueue``, interleaved.

Run it through ``scripts/bench-enqueue`` (see ``docs/benchmarks.md``). A private redis-server (no
persistence) is started for the run. Each repetition runs three groups, in an order rotated each
repetition; within a group the members take turns in slices of jobs (round-robin, the order
rotated by one each repetition), so a burst of load from another tenant of the shared machine
hits all of them alike. Every group gets fresh journal directories and a FLUSHALLed Redis.

  * 1 thread:   raw write+fdatasync (the disk's floor), hybridq ``Queue.enqueue``, ``rq.Queue.enqueue``
  * 16 threads: hybridq (one ``Queue`` shared, group commit) vs rq (one connection pool shared)
  * batches:    ``Queue.enqueue_many`` of 1,000 prepared jobs vs ``rq.Queue.enqueue_many`` of 1,000

Reported: the median over repetitions, the spread (min..max), and the target ratios (P1-P4),
each computed per repetition and then reduced to its median.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import redis
import rq
from hybridq import Queue
from hybridq.embedded import RedisServer
from hybridq.producer import shared_writer
from rq.serializers import JSONSerializer

#: Only the dotted path is recorded at enqueue time (neither side imports it).
FUNC = "tests.tasks.add"
THREADS = 16
BATCH = 1000
RAW_PAYLOAD = b"x" * 100
WARMUP_OPS = 20


@dataclass
class Config:
    base: str
    repeat: int
    n: int  # jobs per measurement (per contestant and repetition)
    slices: int  # round-robin turns per measurement
    url: str
    server: RedisServer


@dataclass
class Sample:
    """One measurement of one repetition."""

    jobs: int
    seconds: float
    lat_ns: list[int] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds else float("nan")


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of sorted nanosecond latencies, in microseconds."""
    if not sorted_ns:
        return float("nan")
    rank = max(0, min(len(sorted_ns) - 1, round(q / 100 * len(sorted_ns)) - 1))
    return sorted_ns[rank] / 1000


# -- timing loops -------------------------------------------------------------------------------


def counted_loop(op: Callable[[int], object], ops: int) -> Sample:
    """Call ``op(0)`` ``ops`` times; time every call."""
    lat: list[int] = []
    clock = time.perf_counter_ns
    start = now = clock()
    for _ in range(ops):
        t0 = now
        op(0)
        now = clock()
        lat.append(now - t0)
    return Sample(ops, (now - start) / 1e9, lat)


def threaded_counted(op: Callable[[int], object], ops: int, threads: int) -> Sample:
    """``threads`` threads call ``op(thread index)`` ``ops // threads`` times each; time every call."""
    each = max(1, ops // threads)
    lats: list[list[int]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)
    clock = time.perf_counter_ns
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        lat = lats[t]
        barrier.wait()
        try:
            now = clock()
            for _ in range(each):
                t0 = now
                op(t)
                now = clock()
                lat.append(now - t0)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    start = clock()
    for t in pool:
        t.join()
    elapsed = (clock() - start) / 1e9
    if errors:
        raise errors[0]
    return Sample(each * threads, elapsed, [x for lat in lats for x in lat])


# -- contestants --------------------------------------------------------------------------------


@dataclass
class Contestant:
    """One side of a comparison. ``op(thread_index)`` enqueues ``jobs_per_op`` jobs."""

    op: Callable[[int], object]
    close: Callable[[], None] = lambda: None
    threads: int = 1
    jobs_per_op: int = 1
    fsyncs: Callable[[], int] | None = None


def close_queue(q: Queue) -> None:
    """Seal the process's shared writer of this (temporary) journal."""
    shared_writer(q.journal, q.durability).close()


def setup_raw(d: str, _cfg: Config) -> Contestant:
    fd = os.open(os.path.join(d, "raw.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def op(_t: int) -> None:
        os.write(fd, RAW_PAYLOAD)
        os.fdatasync(fd)

    return Contestant(op, lambda: os.close(fd))


def setup_hq(d: str, _cfg: Config, threads: int = 1) -> Contestant:
    q = Queue("default", os.path.join(d, "journal"))
    enqueue = q.enqueue
    writer = shared_writer(q.journal, q.durability)

    def op(_t: int) -> None:
        enqueue(FUNC, 1, 2)

    return Contestant(op, lambda: close_queue(q), threads, fsyncs=lambda: writer.fsync_count)


def setup_rq(_d: str, cfg: Config, threads: int = 1) -> Contestant:
    pool = redis.ConnectionPool.from_url(cfg.url, max_connections=threads + 4)
    conn = redis.Redis(connection_pool=pool)
    queues = [rq.Queue("default", connection=conn, serializer=JSONSerializer) for _ in range(threads)]

    def op(t: int) -> None:
        queues[t].enqueue(FUNC, 1, 2)

    return Contestant(op, pool.disconnect, threads)


def setup_hq_many(d: str, _cfg: Config) -> Contestant:
    q = Queue("default", os.path.join(d, "journal"))
    prepare = q.prepare

    def op(_t: int) -> None:
        q.enqueue_many([prepare(FUNC, (i,)) for i in range(BATCH)])

    return Contestant(op, lambda: close_queue(q), jobs_per_op=BATCH)


def setup_rq_many(_d: str, cfg: Config) -> Contestant:
    conn = redis.Redis.from_url(cfg.url)
    q = rq.Queue("default", connection=conn, serializer=JSONSerializer)
    prepare = rq.Queue.prepare_data

    def op(_t: int) -> None:
        q.enqueue_many([prepare(FUNC, (i,)) for i in range(BATCH)])  # one pipeline per call

    return Contestant(op, conn.close, jobs_per_op=BATCH)


Setup = Callable[[str, Config], Contestant]


def run_group(cfg: Config, members: list[tuple[str, Setup]], rep: int) -> dict[str, Sample]:
    """Each member enqueues ``cfg.n`` jobs, round-robin in ``cfg.slices`` turns (order rotated)."""
    cfg.server.flushall()
    dirs: list[str] = []
    live: dict[str, Contestant] = {}
    samples = {key: Sample(0, 0.0) for key, _ in members}
    try:
        for key, setup in members:
            dirs.append(tempfile.mkdtemp(prefix=f"{key}-", dir=cfg.base))
            c = live[key] = setup(dirs[-1], cfg)
            for _ in range(max(1, WARMUP_OPS // c.jobs_per_op)):
                c.op(0)  # first segment, connections, imports: before timing
        gc.collect()
        fsyncs = dict.fromkeys(live, 0)
        for turn in range(cfg.slices):
            shift = (turn + rep) % len(members)
            for key, _ in members[shift:] + members[:shift]:
                c = live[key]
                ops = max(1, round(cfg.n / cfg.slices / c.jobs_per_op))
                before = c.fsyncs() if c.fsyncs else 0
                part = counted_loop(c.op, ops) if c.threads == 1 else threaded_counted(c.op, ops, c.threads)
                if c.fsyncs:
                    fsyncs[key] += c.fsyncs() - before
                s = samples[key]
                s.jobs += part.jobs * c.jobs_per_op
                s.seconds += part.seconds
                s.lat_ns.extend(part.lat_ns)
        for key, c in live.items():
            if c.fsyncs:
                samples[key].extra["per_fsync"] = samples[key].jobs / max(1, fsyncs[key])
    finally:
        for c in live.values():
            c.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        cfg.server.flushall()
    return samples


@dataclass
class Row:
    key: str
    label: str


ROWS = [
    Row("raw1", "raw write+fdatasync 100 B, 1 thread (disk floor)"),
    Row("hq1", "hybridq Queue.enqueue, 1 thread (fsync/call)"),
    Row("rq1", "rq Queue.enqueue, 1 thread (Redis, no persistence)"),
    Row("hq16", "hybridq Queue.enqueue, 16 threads, 1 Queue"),
    Row("rq16", "rq Queue.enqueue, 16 threads, 1 pool"),
    Row("hqmany", "hybridq prepare x1,000 + enqueue_many"),
    Row("rqmany", "rq prepare_data x1,000 + enqueue_many"),
]
LABELS = {r.key: r.label for r in ROWS}

SINGLE: list[tuple[str, Setup]] = [("raw1", setup_raw), ("hq1", setup_hq), ("rq1", setup_rq)]
THREADED: list[tuple[str, Setup]] = [
    ("hq16", lambda d, c: setup_hq(d, c, THREADS)),
    ("rq16", lambda d, c: setup_rq(d, c, THREADS)),
]
BATCHES: list[tuple[str, Setup]] = [("hqmany", setup_hq_many), ("rqmany", setup_rq_many)]
GROUPS = [SINGLE, THREADED, BATCHES]


# -- machine facts and reporting (bench_forward.py imports these) -------------------------------


def mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, device, filesystem type) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("?", "?", "?")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        dev, mnt, fstype = line.split()[:3]
        mnt = mnt.replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
            best = (mnt, dev, fstype)
    return best


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def git_revision() -> str:
    """Commit of the working tree, and whether hybridq/ has uncommitted changes."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "hybridq"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return rev + (" (hybridq/ has uncommitted changes)" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def print_machine(title: str, base: str, server: RedisServer) -> None:
    mnt, dev, fstype = mount_of(base)
    with server.client() as client:
        info = client.info("server")
    print(title)
    print(f"  date        {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"  machine     nproc={os.cpu_count()}  cpu={cpu_model()}  loadavg={os.getloadavg()[0]:.2f}")
    print(f"  kernel      {platform.system()} {platform.release()} ({platform.machine()})")
    print(f"  python      {platform.python_version()} ({platform.python_implementation()})")
    print(f"  versions    hybridq {version('hybridq')}, rq {version('rq')}, redis-py {version('redis')}")
    print(
        f"  redis       redis-server {info.get('redis_version', '?')} ({server.executable}), "
        f"{server.url}, no persistence"
    )
    print(f"  commit      {git_revision()}")
    print(f"  journal dir {base}")
    print(f"  filesystem  {fstype} on {dev}, mounted at {mnt}")


def spread(values: list[float], fmt: str) -> tuple[str, str]:
    return format(statistics.median(values), fmt), f"{min(values):{fmt}}..{max(values):{fmt}}"


def med_range(values: list[float], fmt: str) -> str:
    m, r = spread(values, fmt)
    return f"{m} ({r})"


def print_rows(rows: list[tuple[str, ...]], right: set[int]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print()


def verdict_line(
    name: str, values: list[float], ok: bool, goal: str, unit: str = "x", what: str = ""
) -> bool:
    med = statistics.median(values)
    print(
        f"  {'PASS' if ok else 'FAIL'}  {name:<44} {med:8.2f}{unit}  (spread {min(values):.2f}..{max(values):.2f})"
        f"  target {goal}" + (f"  [{what}]" if what else "")
    )
    return ok


def print_result(ok: list[bool]) -> None:
    failed = ok.count(False)
    if failed:
        print(f"RESULT: {failed} of {len(ok)} targets FAIL (this is a report; exit status stays 0)")
    else:
        print(f"RESULT: all {len(ok)} targets PASS")


def profile_call(title: str, fn: Callable[[], object], top: int = 18) -> None:
    """Run ``fn`` under cProfile and print where the time goes (cumulative and own time)."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    print(f"profile: {title}")
    stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs()
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


# -- this benchmark's report --------------------------------------------------------------------


def print_table(results: dict[str, list[Sample]]) -> None:
    head = ("measurement", "jobs/s (median)", "spread (min..max)", "p50 us", "p99 us", "other")
    rows = [head]
    for b in ROWS:
        samples = results[b.key]
        med, rng = spread([s.rate for s in samples], ",.0f")
        p50 = med_range([percentile(sorted(s.lat_ns), 50) for s in samples], ",.0f")
        p99 = med_range([percentile(sorted(s.lat_ns), 99) for s in samples], ",.0f")
        if b.key.endswith("many"):
            p50, p99 = (f"{x} /1,000" for x in (p50, p99))
        other = ""
        if "per_fsync" in samples[0].extra:
            other = med_range([s.extra["per_fsync"] for s in samples], ".1f") + " jobs/fsync"
        rows.append((b.label, med, rng, p50, p99, other))
    print_rows(rows, {1, 2, 3, 4})


def print_ratios(results: dict[str, list[Sample]]) -> None:
    def per_rep(num: str, den: str, f: Callable[[Sample], float] = lambda s: s.rate) -> list[float]:
        return [f(a) / f(b) for a, b in zip(results[num], results[den], strict=True)]

    def p50(s: Sample) -> float:
        return percentile(sorted(s.lat_ns), 50)

    p1 = per_rep("hq1", "rq1")
    p2 = per_rep("hq16", "rq16")
    p3 = per_rep("hqmany", "rqmany")
    p4a = per_rep("hq1", "raw1", p50)
    p4b = [percentile(sorted(s.lat_ns), 99) / 1000 for s in results["hq1"]]
    print("targets (ratio per repetition, median of the ratios):")
    ok = [
        verdict_line("P1 enqueue 1 thread: hybridq / rq", p1, statistics.median(p1) >= 1.5, ">= 1.5x"),
        verdict_line("P2 enqueue 16 threads: hybridq / rq", p2, statistics.median(p2) >= 5, ">= 5x"),
        verdict_line("P3 enqueue_many(1,000): hybridq / rq", p3, statistics.median(p3) >= 10, ">= 10x"),
        verdict_line("P4 hybridq p50 / raw fdatasync p50", p4a, statistics.median(p4a) <= 2, "<= 2x"),
        verdict_line("P4 hybridq p99 (1 thread)", p4b, statistics.median(p4b) <= 3, "<= 3 ms", " ms"),
    ]
    print()
    print("context (no target; same-run ratios):")
    for name, values in (
        ("hybridq 1 thread / raw fdatasync loop (jobs/s)", per_rep("hq1", "raw1")),
        ("hybridq 16 threads / hybridq 1 thread", per_rep("hq16", "hq1")),
        ("rq 16 threads / rq 1 thread", per_rep("rq16", "rq1")),
        ("hybridq enqueue_many / hybridq 1 thread", per_rep("hqmany", "hq1")),
        ("rq enqueue_many / rq 1 thread", per_rep("rqmany", "rq1")),
    ):
        print(
            f"        {name:<48} {statistics.median(values):6.2f}x  (spread {min(values):.2f}..{max(values):.2f})"
        )
    print()
    print_result(ok)


def profile_hybridq(cfg: Config) -> None:
    """cProfile of the hybridq rows (1-thread enqueue and enqueue_many), for a miss's report."""
    d = tempfile.mkdtemp(prefix="profile-", dir=cfg.base)
    try:
        for key, setup, ops in (("hq1", setup_hq, 2000), ("hqmany", setup_hq_many, 10)):
            c = setup(os.path.join(d, key), cfg)
            c.op(0)
            try:
                profile_call(f"{LABELS[key]} ({ops} calls)", lambda c=c, ops=ops: counted_loop(c.op, ops))
            finally:
                c.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench-enqueue", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeat", type=int, default=None, help="interleaved repetitions (default 5; 2 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="small counts, for smoke testing (< 30 s)")
    p.add_argument(
        "--n",
        type=int,
        default=None,
        help="jobs per measurement per repetition (default 6,000; 1,000 with --quick)",
    )
    p.add_argument(
        "--dir", default=None, help="parent of the temporary journal directories (default: a new tempdir)"
    )
    p.add_argument("--profile", action="store_true", help="also print a cProfile of the hybridq rows")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with stderr
    repeat = args.repeat if args.repeat is not None else (2 if args.quick else 5)
    n = args.n if args.n is not None else (1000 if args.quick else 6000)
    if repeat < 1 or n < BATCH:
        sys.exit(f"bench-enqueue: --repeat must be >= 1 and --n >= {BATCH}")
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="bench-enqueue-", dir=args.dir)
    try:
        with RedisServer(directory=os.path.join(base, "redis")) as server:
            cfg = Config(base, repeat, n, slices=4 if args.quick else 6, url=server.url, server=server)
            print_machine("hybridq enqueue benchmark", base, server)
            print(
                f"  run         mode={'quick' if args.quick else 'default'}, {repeat} repetitions; per "
                f"repetition each row enqueues {n:,} jobs of {FUNC}(...) in {cfg.slices} round-robin turns; "
                f"{THREADS} threads in the threaded rows; rq uses the JSON serializer"
            )
            print()
            results: dict[str, list[Sample]] = {r.key: [] for r in ROWS}
            for rep in range(repeat):
                shift = rep % len(GROUPS)
                for group in GROUPS[shift:] + GROUPS[:shift]:
                    for key, sample in run_group(cfg, group, rep).items():
                        results[key].append(sample)
                        print(
                            f"  [rep {rep + 1}/{repeat}] {LABELS[key]:<52} {sample.rate:>10,.0f} jobs/s",
                            file=sys.stderr,
                            flush=True,
                        )
            print(file=sys.stderr)
            print_table(results)
            print_ratios(results)
            if args.profile:
                print()
                profile_hybridq(cfg)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
