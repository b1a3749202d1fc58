"""``hybridq.stats`` next to the full scan (``collect_status``, what ``status --json`` did), one run.

Run it through ``scripts/bench-stats`` (see ``docs/benchmarks.md``). It builds one journal of N
jobs (default 20,000; ``--million`` for 1,000,000) on two queues, forwarded by a forwarder with the
in-memory transport: every job of queue ``a`` finished (one in a hundred failed), every job of
queue ``b`` still pending, so no segment can be compacted and the ledger holds N/2 outcomes. Then
it times, interleaved in rounds: ``stats()`` with the forwarder caught up, ``stats()`` with
``--tail`` jobs accepted after the forwarder stopped (read from the journal), and
``collect_status()``. It checks that both give the same figures. Reported: p50 and p99 per row,
and the ratio of the p50s.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import benchlib
from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.ops.status import collect_status, stats
from hybridq.ops.status_counts import from_snapshot as _from_snapshot
from hybridq.transport import MemoryTransport

CHUNK = 50_000
SEGMENT_BYTES = 64 << 20  # the writer's default


def fail_some(env: Envelope, _attempt: int) -> None:
    if env.args[0] % 100 == 0:
        raise ValueError("one in a hundred")


def build(journal: str, jobs: int) -> None:
    """``jobs`` jobs, forwarded; queue a finished, queue b pending; the forwarder closed."""
    a, b = Queue("a", journal=journal), Queue("b", journal=journal)
    transport = MemoryTransport()
    forwarder = Forwarder(journal, transport, reconcile_interval_s=1e9, batch_size=5000)
    forwarder.open()
    started = time.monotonic()
    with JournalWriter(journal, max_segment_bytes=SEGMENT_BYTES) as writer:
        for start in range(0, jobs, CHUNK):
            n = min(CHUNK, jobs - start)
            envs = [(a if i % 2 == 0 else b).prepare(print, (i,)) for i in range(start, start + n)]
            for at in range(0, n, 1000):
                writer.append_many(e.to_bytes() for e in envs[at : at + 1000])
            forwarder.step()
            transport.work("a", func=fail_some)
            forwarder.step()  # harvests the outcomes into the ledger
            # Forget what "Redis" holds (memory): the outcomes are in the ledger, and no
            # reconcile pass runs to notice that queue b's jobs are gone.
            for name in (
                "queues",
                "jobs",
                "deliveries",
                "runs",
                "claimed",
                "status",
                "results",
                "executions",
            ):
                getattr(transport, name).clear()
            print(f"  {start + n:>9,} jobs  {time.monotonic() - started:6.1f} s", file=sys.stderr)
    forwarder.close()


def timed(fn: Callable[[], Any], times: list[float]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    times.append((time.perf_counter() - t0) * 1000)
    return out


def compare(journal: str) -> None:
    """Exit unless stats() and the scan agree (ages: to within the scan's own duration)."""
    fast = stats(journal)
    t0 = time.monotonic()
    slow = collect_status(journal)
    took = time.monotonic() - t0
    ages = ("oldest_pending_age_s", "forwarding_lag_s")
    a = {k: v for k, v in fast.items() if k not in ages}
    b = {k: v for k, v in slow.items() if k not in ages}
    if a != b or any(abs(fast[k] - slow[k]) > took + 1 for k in ages):
        sys.exit(f"stats() and the scan disagree:\n{fast}\n{slow}")


def main() -> None:
    p = argparse.ArgumentParser(prog="bench-stats", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--million", action="store_true", help="a 1,000,000-job journal (minutes)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 20; 3 with --million)")
    p.add_argument("--fast-per-round", type=int, default=20, help="stats() calls per round and row")
    p.add_argument("--tail", type=int, default=1000, help="jobs accepted after the forwarder stopped")
    p.add_argument("--dir", default=None, help="where the temporary journal goes")
    args = p.parse_args()
    jobs = 1_000_000 if args.million else args.jobs
    rounds = args.rounds or (3 if args.million else 20)
    base = tempfile.mkdtemp(prefix="bench-stats-", dir=args.dir)
    journal = f"{base}/journal"
    try:
        print(f"building a {jobs:,}-job journal in {journal}", file=sys.stderr)
        build(journal, jobs)
        caught_up: list[float] = []
        with_tail: list[float] = []
        scan: list[float] = []
        assert _from_snapshot(journal) is not None, "stats() would scan: no usable snapshot"
        compare(journal)
        for r in range(rounds):
            for _ in range(args.fast_per_round):
                timed(lambda: stats(journal), caught_up)
            timed(lambda: collect_status(journal), scan)
            print(f"  round {r + 1}/{rounds}", file=sys.stderr)
        queue = Queue("b", journal=journal)
        queue.enqueue_many([queue.prepare(print, (i,)) for i in range(args.tail)])
        compare(journal)
        for _ in range(rounds):
            for _ in range(args.fast_per_round):
                timed(lambda: stats(journal), with_tail)
        out = stats(journal)
        print(
            f"\njournal: {jobs:,} jobs forwarded ({out['succeeded']:,} succeeded, {out['failed']:,} failed,"
        )
        print(f"         {out['pending']:,} pending), {out['journal']['bytes'] / 1e6:.0f} MB in")
        print(f"         {out['journal']['segments']} segments; ledger: {jobs // 2:,} outcomes")
        print(f"\n{'':38} {'p50 ms':>9} {'p99 ms':>9} {'calls':>6}")
        rows = [
            ("stats(), forwarder caught up", caught_up),
            (f"stats(), {args.tail:,} jobs not yet forwarded", with_tail),
            ("collect_status() (the full scan)", scan),
        ]
        for name, values in rows:
            print(
                f"{name:38} {benchlib.quantile(values, 50):9.3f} {benchlib.quantile(values, 99):9.3f} {len(values):6}"
            )
        ratio = statistics.median(scan) / statistics.median(caught_up)
        print(f"\nscan p50 / stats() p50 (caught up): {ratio:,.0f}x; figures identical: yes")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
