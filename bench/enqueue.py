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
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import benchlib
import redis
import rq
from benchlib import Contestant, Figure, Sample, latency_us, p50, per_rep
from hybridq import Queue
from hybridq.producer.queue import shared_writer
from hybridq.testing.embedded import RedisServer
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

    return Contestant(op, lambda: close_queue(q), per_op=BATCH)


def setup_rq_many(_d: str, cfg: Config) -> Contestant:
    conn = redis.Redis.from_url(cfg.url)
    q = rq.Queue("default", connection=conn, serializer=JSONSerializer)
    prepare = rq.Queue.prepare_data

    def op(_t: int) -> None:
        q.enqueue_many([prepare(FUNC, (i,)) for i in range(BATCH)])  # one pipeline per call

    return Contestant(op, conn.close, per_op=BATCH)


Setup = Callable[[str, Config], Contestant]


def run_group(cfg: Config, members: list[tuple[str, Setup]], rep: int) -> dict[str, Sample]:
    """Each member enqueues ``cfg.n`` jobs, round-robin in ``cfg.slices`` turns (order rotated)."""

    def measure(c: Contestant) -> Sample:
        ops = max(1, round(cfg.n / cfg.slices / c.per_op))
        return counted_loop(c.op, ops) if c.threads == 1 else threaded_counted(c.op, ops, c.threads)

    cfg.server.flushall()
    try:
        return benchlib.run_group(
            cfg.base,
            cfg,
            members,
            rep,
            turns=cfg.slices,
            warmup_ops=WARMUP_OPS,
            warm=lambda c: c.op(0),  # first segment, connections, imports: before timing
            measure=measure,
            batch_latency=True,
        )
    finally:
        cfg.server.flushall()


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


# -- this benchmark's report --------------------------------------------------------------------


def print_table(results: dict[str, list[Sample]]) -> None:
    head = ("measurement", "jobs/s (median)", "spread (min..max)", "p50 us", "p99 us", "other")
    rows = [head]
    for b in ROWS:
        samples = results[b.key]
        med, rng = benchlib.spread([s.rate for s in samples], ",.0f")
        p50s = benchlib.med_range([latency_us(s, 50) for s in samples], ",.0f")
        p99s = benchlib.med_range([latency_us(s, 99) for s in samples], ",.0f")
        if b.key.endswith("many"):
            p50s, p99s = (f"{x} /1,000" for x in (p50s, p99s))
        other = ""
        if "per_fsync" in samples[0].extra:
            other = benchlib.med_range([s.extra["per_fsync"] for s in samples], ".1f") + " jobs/fsync"
        rows.append((b.label, med, rng, p50s, p99s, other))
    benchlib.print_rows(rows, {1, 2, 3, 4})


def print_ratios(results: dict[str, list[Sample]]) -> list[Figure]:
    """Print the targets (P1-P4) and the context ratios; return them (targets first)."""
    target = benchlib.target
    print("targets (ratio per repetition, median of the ratios):")
    targets = [
        target("P1", "P1 enqueue 1 thread: hybridq / rq", per_rep(results, "hq1", "rq1"), 1.5),
        target("P2", "P2 enqueue 16 threads: hybridq / rq", per_rep(results, "hq16", "rq16"), 5),
        target("P3", "P3 enqueue_many(1,000): hybridq / rq", per_rep(results, "hqmany", "rqmany"), 10),
        target(
            "P4", "P4 hybridq p50 / raw fdatasync p50", per_rep(results, "hq1", "raw1", p50), 2, at_most=True
        ),
        target(
            "P4",
            "P4 hybridq p99 (1 thread)",
            [latency_us(s, 99) / 1000 for s in results["hq1"]],
            3,
            at_most=True,
            unit=" ms",
        ),
    ]
    print()
    context = benchlib.print_context(
        [
            ("hybridq 1 thread / raw fdatasync loop (jobs/s)", per_rep(results, "hq1", "raw1")),
            ("hybridq 16 threads / hybridq 1 thread", per_rep(results, "hq16", "hq1")),
            ("rq 16 threads / rq 1 thread", per_rep(results, "rq16", "rq1")),
            ("hybridq enqueue_many / hybridq 1 thread", per_rep(results, "hqmany", "hq1")),
            ("rq enqueue_many / rq 1 thread", per_rep(results, "rqmany", "rq1")),
        ],
        48,
    )
    benchlib.print_result([f.ok for f in targets])
    return targets + context


def profile_hybridq(cfg: Config) -> None:
    """cProfile of the hybridq rows (1-thread enqueue and enqueue_many), for a miss's report."""
    d = tempfile.mkdtemp(prefix="profile-", dir=cfg.base)
    try:
        for key, setup, ops in (("hq1", setup_hq, 2000), ("hqmany", setup_hq_many, 10)):
            c = setup(os.path.join(d, key), cfg)
            c.op(0)
            try:
                benchlib.profile_call(
                    f"{LABELS[key]} ({ops} calls)", lambda c=c, ops=ops: counted_loop(c.op, ops)
                )
            finally:
                c.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = benchlib.arg_parser("scripts/bench-enqueue", __doc__)
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
    benchlib.add_json_option(p)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with stderr
    repeat = benchlib.pick(args.repeat, args.quick, 2, 5)
    n = benchlib.pick(args.n, args.quick, 1000, 6000)
    if repeat < 1 or n < BATCH:
        sys.exit(f"bench-enqueue: --repeat must be >= 1 and --n >= {BATCH}")
    base = benchlib.make_base("bench-enqueue", args.dir)
    try:
        with RedisServer(directory=os.path.join(base, "redis")) as server:
            cfg = Config(base, repeat, n, slices=4 if args.quick else 6, url=server.url, server=server)
            header = benchlib.print_redis_machine("hybridq enqueue benchmark", base, server)
            header["run"] = (
                f"mode={'quick' if args.quick else 'default'}, {repeat} repetitions; per "
                f"repetition each row enqueues {n:,} jobs of {FUNC}(...) in {cfg.slices} round-robin turns; "
                f"{THREADS} threads in the threaded rows; rq uses the JSON serializer"
            )
            benchlib.print_field("run", header["run"])
            print()
            results = benchlib.run_repetitions(
                repeat,
                [lambda rep, group=group: run_group(cfg, group, rep) for group in GROUPS],
                LABELS,
                52,
                lambda _key, sample: f"{sample.rate:>10,.0f} jobs/s",
            )
            print_table(results)
            figures = print_ratios(results)
            if args.json:
                rows = benchlib.json_rows(results, LABELS, "jobs/s")
                for key in ("hqmany", "rqmany"):  # their latencies are of one call of 1,000 jobs
                    rows[key]["latency_per"] = BATCH
                benchlib.write_json(args.json, "bench-enqueue", header, rows, figures)
            if args.profile:
                print()
                profile_hybridq(cfg)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
