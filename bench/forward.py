"""Forwarder benchmark: hybridq's Forwarder into RQ next to ``rq.Queue.enqueue_many``, interleaved.

Run it through ``scripts/bench-forward`` (see ``docs/benchmarks.md``). A private redis-server (no
persistence) is started for the run.

  * F1: a journal pre-filled with N jobs (``Queue.enqueue_many``, not timed) is forwarded by one
    timed ``Forwarder.step()`` through ``RQTransport`` (batch_size 500, and 1000), next to
    ``rq.Queue.enqueue_many`` of the same N jobs in batches of 1,000 (one pipeline each) into the
    same Redis. FLUSHALL before each; the three run in an order rotated each repetition; every
    run checks that ``rq:queue:default`` then holds exactly N jobs.
  * F4 (harvest): N completion events already in the forwarder's stream, as the worker writes
    them; timed: ``Forwarder.step()`` until the ledger holds all N outcomes (fsync per batch)
    and the stream is empty, next to a bare ``XRANGE COUNT 1000`` + ``XDEL`` loop of the same
    events as the reference (``hybridq/forwarder/harvest.py``).
  * F2: with a forwarder idle in a background thread (``Forwarder.run()``), enqueue one job and
    poll LLEN of ``rq:queue:default`` in a tight loop (no sleeps) until it appears; a short pause
    between samples keeps the system idle. Interleaved with it, the same for ``rq.Queue.enqueue``
    (visible once it returns) as context.

Reported: medians over repetitions, spreads (min..max), and the target ratios.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import benchlib
import redis
import rq
from benchlib import Figure, Sample, latency_us, p50, per_rep
from enqueue import FUNC
from harvest import F4_PACED, F4_ROWS, harvest_once, paced_cells, run_f4
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.producer.queue import shared_writer
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from rq.serializers import JSONSerializer

PEER_BATCH = 1000
#: F4's bound, events/s: the concurrent worker aims at 4,000-8,000 no-op jobs/s on 2 cores.
HARVEST_TARGET = 10_000
RQ_QUEUE_KEY = "rq:queue:default"


@dataclass
class Config:
    base: str
    repeat: int
    n: int
    samples: int  # F2 samples per repetition
    pause_s: float  # F2 idle time between samples
    url: str
    server: RedisServer


# -- F1 -----------------------------------------------------------------------------------------


def prefill(journal: str, n: int) -> None:
    """Write ``n`` jobs into a fresh journal in batches of 1,000 (durable, not timed)."""
    q = Queue("default", journal)
    try:
        for start in range(0, n, 1000):
            q.enqueue_many([q.prepare(FUNC, (i,)) for i in range(start, min(n, start + 1000))])
    finally:
        shared_writer(q.journal, q.durability).close()


def check_llen(cfg: Config, n: int, who: str) -> None:
    with cfg.server.client() as client:
        got = client.llen(RQ_QUEUE_KEY)
    if got != n:
        sys.exit(f"bench-forward: {who} left {got} jobs in {RQ_QUEUE_KEY}, expected {n}")


def forward_once(cfg: Config, pristine: str, batch_size: int, profile: bool = False) -> Sample:
    """Copy the pre-filled journal, then time one Forwarder.step() over it."""
    journal = tempfile.mkdtemp(prefix=f"fwd{batch_size}-", dir=cfg.base)
    shutil.rmtree(journal)
    shutil.copytree(pristine, journal)
    transport = RQTransport(cfg.url)
    fwd = Forwarder(journal, transport, batch_size=batch_size)
    try:
        fwd.open()  # lock, recovery scan, checkpoint: not timed
        transport.ping()
        gc.collect()
        if profile:
            benchlib.profile_call(f"Forwarder.step() of {cfg.n:,} jobs, batch_size {batch_size}", fwd.step)
            return Sample(cfg.n, 1.0)
        t0 = time.perf_counter()
        done = fwd.step()
        elapsed = time.perf_counter() - t0
    finally:
        fwd.close()
        transport.close()
        shutil.rmtree(journal, ignore_errors=True)
    if done != cfg.n:
        sys.exit(f"bench-forward: step() forwarded {done} jobs, expected {cfg.n}")
    check_llen(cfg, cfg.n, f"Forwarder(batch_size={batch_size})")
    return Sample(done, elapsed, extra={"batches": fwd.stats.batches})


def rq_many_once(cfg: Config) -> Sample:
    """``rq.Queue.enqueue_many`` of the same N jobs, batches of 1,000, one pipeline each."""
    conn = redis.Redis.from_url(cfg.url)
    q = rq.Queue("default", connection=conn, serializer=JSONSerializer)
    prepare = rq.Queue.prepare_data
    n = cfg.n
    try:
        conn.ping()
        gc.collect()
        t0 = time.perf_counter()
        for start in range(0, n, PEER_BATCH):
            pipe = conn.pipeline()
            q.enqueue_many(
                [prepare(FUNC, (i,)) for i in range(start, min(n, start + PEER_BATCH))], pipeline=pipe
            )
            pipe.execute()
        elapsed = time.perf_counter() - t0
    finally:
        conn.close()
    check_llen(cfg, n, "rq enqueue_many")
    return Sample(n, elapsed)


F1_ROWS = [
    ("fwd500", "Forwarder.step() via RQTransport, batch_size 500"),
    ("fwd1000", "Forwarder.step() via RQTransport, batch_size 1000"),
    ("rqmany", "rq enqueue_many, batches of 1,000, pipelined (peer)"),
]


def run_f1(cfg: Config, rep: int) -> dict[str, Sample]:
    pristine = os.path.join(tempfile.mkdtemp(prefix="prefill-", dir=cfg.base), "journal")
    prefill(pristine, cfg.n)
    units: list[tuple[str, Callable[[], Sample]]] = [
        ("fwd500", lambda: forward_once(cfg, pristine, 500)),
        ("fwd1000", lambda: forward_once(cfg, pristine, 1000)),
        ("rqmany", lambda: rq_many_once(cfg)),
    ]
    out: dict[str, Sample] = {}
    try:
        for key, unit in benchlib.rotated(units, rep):
            cfg.server.flushall()
            out[key] = unit()
            cfg.server.flushall()
    finally:
        shutil.rmtree(os.path.dirname(pristine), ignore_errors=True)
    return out


# -- F2 -----------------------------------------------------------------------------------------


def run_f2(cfg: Config, rep: int) -> dict[str, Sample]:
    """Latency samples: hybridq enqueue -> visible in Redis, and rq enqueue -> visible (peer)."""
    cfg.server.flushall()
    d = tempfile.mkdtemp(prefix="f2-", dir=cfg.base)
    journal = os.path.join(d, "journal")
    q = Queue("default", journal)
    transport = RQTransport(cfg.url)
    fwd = Forwarder(journal, transport)
    poll = redis.Redis.from_url(cfg.url)
    peer_conn = redis.Redis.from_url(cfg.url)
    peer = rq.Queue("peer", connection=peer_conn, serializer=JSONSerializer)
    peer_key = "rq:queue:peer"
    thread: threading.Thread | None = None
    visible: list[int] = []  # enqueue call -> visible
    after_ack: list[int] = []  # enqueue returned -> visible (the forwarder's share)
    peer_lat: list[int] = []
    clock = time.perf_counter_ns
    try:
        fwd.open()
        thread = threading.Thread(target=fwd.run, name="forwarder", daemon=True)
        thread.start()
        expected = peer_expected = 0
        for i in range(cfg.samples + 5):  # the first 5 warm up (connections, first segment)
            hq_first = (i + rep) % 2 == 0
            for side in ("hq", "rq") if hq_first else ("rq", "hq"):
                time.sleep(cfg.pause_s)
                if side == "hq":
                    expected += 1
                    t0 = clock()
                    q.enqueue(FUNC, i, 0)
                    t1 = clock()
                    while poll.llen(RQ_QUEUE_KEY) < expected:
                        pass
                    t2 = clock()
                    if i >= 5:
                        visible.append(t2 - t0)
                        after_ack.append(t2 - t1)
                else:
                    peer_expected += 1
                    t0 = clock()
                    peer.enqueue(FUNC, i, 0)
                    while poll.llen(peer_key) < peer_expected:
                        pass
                    t2 = clock()
                    if i >= 5:
                        peer_lat.append(t2 - t0)
    finally:
        fwd.stop()
        if thread is not None:
            thread.join(10)
        fwd.close()
        transport.close()
        shared_writer(q.journal, q.durability).close()
        poll.close()
        peer_conn.close()
        shutil.rmtree(d, ignore_errors=True)
        cfg.server.flushall()
    seconds = cfg.samples * cfg.pause_s
    return {
        "f2hq": Sample(len(visible), seconds, visible),
        "f2ack": Sample(len(after_ack), seconds, after_ack),
        "f2rq": Sample(len(peer_lat), seconds, peer_lat),
    }


F2_ROWS = [
    ("f2hq", "hybridq enqueue -> in rq:queue:default (forwarder idle in a thread)"),
    ("f2ack", "  of which: enqueue returned -> in rq:queue:default"),
    ("f2rq", "rq Queue.enqueue -> in its queue (peer, context)"),
]
LABELS = dict([*F1_ROWS, *F4_ROWS, F4_PACED, *F2_ROWS])


# -- report -------------------------------------------------------------------------------------


def print_tables(results: dict[str, list[Sample]]) -> None:
    rows: list[tuple[str, ...]] = [
        ("F1 measurement", "jobs/s (median)", "spread (min..max)", "seconds (median)")
    ]
    for key, label in F1_ROWS:
        samples = results[key]
        med, rng = benchlib.spread([s.rate for s in samples], ",.0f")
        rows.append((label, med, rng, f"{statistics.median(s.seconds for s in samples):.2f}"))
    benchlib.print_rows(rows, {1, 2, 3})
    rows = [("F4 measurement", "events/s (median)", "spread (min..max)", "ledger fsyncs")]
    for key, label in F4_ROWS:
        samples = results[key]
        med, rng = benchlib.spread([s.rate for s in samples], ",.0f")
        fsyncs = samples[0].extra.get("fsyncs")
        rows.append((label, med, rng, "-" if fsyncs is None else f"{fsyncs:.0f}"))
    benchlib.print_rows(rows, {1, 2, 3})
    rows = [
        (
            "F4 paced (per repetition)",
            "offered events/s",
            "harvested events/s",
            "CPU us/event",
            "of a core",
            "events/fsync",
        )
    ]
    rows += [(F4_PACED[1], *paced_cells(s)) for s in results[F4_PACED[0]]]
    benchlib.print_rows(rows, {1, 2, 3, 4, 5})
    rows = [("F2 latency (per repetition, then median)", "p50 ms", "p95 ms", "p99 ms", "max ms")]
    for key, label in F2_ROWS:
        samples = results[key]
        cells = [
            benchlib.med_range([latency_us(s, q) / 1000 for s in samples], ".2f") for q in (50, 95, 99, 100)
        ]
        rows.append((label, *cells))
    benchlib.print_rows(rows, {1, 2, 3, 4})


def print_ratios(results: dict[str, list[Sample]]) -> list[Figure]:
    """Print the targets (F1, F2) and the context ratios; return them (targets first)."""
    target = benchlib.target
    print("targets (ratio per repetition, median of the ratios):")
    targets = [
        target("F1", "F1 forwarder (batch 500) / rq enqueue_many", per_rep(results, "fwd500", "rqmany"), 0.8),
        target(
            "F1", "F1 forwarder (batch 1000) / rq enqueue_many", per_rep(results, "fwd1000", "rqmany"), 0.8
        ),
        target(
            "F4",
            "F4 harvest into the ledger, events/s",
            [s.rate for s in results["f4hq"]],
            HARVEST_TARGET,
            unit=" events/s",
            widths=(44, 10),
        ),
        target(
            "F2",
            "F2 enqueue -> visible p50",
            [latency_us(s, 50) / 1000 for s in results["f2hq"]],
            5,
            at_most=True,
            unit=" ms",
        ),
    ]
    print()
    context = benchlib.print_context(
        [
            ("forwarder batch 1000 / batch 500", per_rep(results, "fwd1000", "fwd500")),
            ("F4 harvest into the ledger / bare XRANGE+XDEL", per_rep(results, "f4hq", "f4ref")),
            ("F2 p50: hybridq enqueue->visible / rq enqueue->visible", per_rep(results, "f2hq", "f2rq", p50)),
        ],
        56,
    )
    benchlib.print_result([f.ok for f in targets])
    return targets + context


def shown(key: str, sample: Sample) -> str:
    """A sample on the progress line (stderr)."""
    if key.startswith("f2"):
        return f"p50 {latency_us(sample, 50) / 1000:8.2f} ms"
    if key == F4_PACED[0]:
        return f"{sample.rate:>10,.0f} events/s, {paced_cells(sample)[2]} us CPU/event"
    if key.startswith("f4"):
        return f"{sample.rate:>10,.0f} events/s"
    return f"{sample.rate:>10,.0f} jobs/s"


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = benchlib.arg_parser("scripts/bench-forward", __doc__)
    p.add_argument(
        "--n", type=int, default=None, help="jobs forwarded per F1 measurement (default 20,000; 2,000 quick)"
    )
    p.add_argument(
        "--harvest-rate",
        type=float,
        default=8000.0,
        help="events/s the paced F4 row writes (default 8,000: the top of the workers' aim)",
    )
    p.add_argument(
        "--samples", type=int, default=None, help="F2 samples per repetition (default 200; 40 quick)"
    )
    p.add_argument(
        "--dir", default=None, help="parent of the temporary journal directories (default: a new tempdir)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print a cProfile of one Forwarder.step() forwarding, and one harvesting (F4)",
    )
    benchlib.add_json_option(p)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with stderr
    repeat = benchlib.pick(args.repeat, args.quick, 2, 5)
    n = benchlib.pick(args.n, args.quick, 2000, 20_000)
    samples = benchlib.pick(args.samples, args.quick, 40, 200)
    if repeat < 1 or n < 1 or samples < 1:
        sys.exit("bench-forward: --repeat, --n and --samples must be >= 1")
    base = benchlib.make_base("bench-forward", args.dir)
    try:
        with RedisServer(directory=os.path.join(base, "redis")) as server:
            cfg = Config(base, repeat, n, samples, pause_s=0.005, url=server.url, server=server)
            header = benchlib.print_redis_machine("hybridq forwarder benchmark", base, server)
            header["run"] = (
                f"mode={'quick' if args.quick else 'default'}, {repeat} repetitions; F1 forwards "
                f"{n:,} jobs of {FUNC}(i) per row and repetition (order rotated); F4 harvests {n:,} "
                f"completion events, then the same paced at {args.harvest_rate:,.0f}/s; F2 takes {samples} samples "
                f"per repetition, {cfg.pause_s * 1000:g} ms pause between, polling LLEN with no sleep"
            )
            benchlib.print_field("run", header["run"])
            print()
            results = benchlib.run_repetitions(
                repeat,
                [
                    functools.partial(run_f1, cfg),
                    functools.partial(run_f4, server, base, n, args.harvest_rate, prefill),
                    functools.partial(run_f2, cfg),
                ],
                LABELS,
                68,
                shown,
            )
            print_tables(results)
            figures = print_ratios(results)
            if args.json:
                # F1 rows are jobs/s; F2 rows are latency samples (their "rate" is samples per pause).
                rows = benchlib.json_rows(results, dict(F1_ROWS), "jobs/s")
                rows |= benchlib.json_rows(results, dict([*F4_ROWS, F4_PACED]), "events/s")
                rows |= benchlib.json_rows(results, dict(F2_ROWS), "samples/s (latency only)")
                benchlib.write_json(args.json, "bench-forward", header, rows, figures)
            if args.profile:
                print()
                pristine = os.path.join(tempfile.mkdtemp(prefix="profile-", dir=base), "journal")
                prefill(pristine, n)
                server.flushall()
                forward_once(cfg, pristine, 500, profile=True)
                print()
                server.flushall()
                harvest_once(server.url, base, pristine, n, profile=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
