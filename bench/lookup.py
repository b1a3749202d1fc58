"""Lookup benchmark: ``hybridq.fetch_job`` and ``job.status`` against ``Job.get_status()``.

Run it through ``scripts/bench-lookup`` (short by default: 20,000 jobs; ``--jobs 1000000`` for
the issue's size). It builds a journal of N jobs (no fsync: the build is not what is measured),
a ledger where 90% of them finished with a small result, 5% wait for a retry and 5% have no
entry yet, and the checkpoint of a forwarder that pushed them all; then the lookup index, as the
forwarder builds it on its first start (timed). Then, on a random sample of ids, side by side:

* ``fetch_job(id)``: the index read plus the job's envelope from the journal;
* ``job.status`` and ``job.result`` on the job it returned;
* ``fetch_job`` of an unknown id (the index, then the journal past the index: empty here);
* ``Job.get_status()`` on the same jobs (it reads the whole ledger: a few samples only).

Prints p50 and p99 per operation (microseconds) and the ratio of the medians. The sample is
random over the whole journal, so p99 includes first reads of cold index and segment pages.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib
from hybridq import Job, Queue, fetch_job
from hybridq.journal import Durability
from hybridq.journal.records import ChainPosition
from hybridq.ledger.checkpoint import Checkpoint, save_checkpoint
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import open_ledger_writer
from hybridq.lookup.index import LookupIndex

FUNC = "tests.tasks.add"
BATCH = 5000


def build(journal: str, jobs: int) -> tuple[list[str], float]:
    """A journal of ``jobs`` jobs, its ledger and checkpoint; the ids, and the index build time."""
    queue = Queue(journal=journal, durability=Durability.NO_FSYNC)
    ledger = open_ledger_writer(journal)
    ids: list[str] = []
    positions: dict[str, ChainPosition] = {}
    now = time.time()
    for start in range(0, jobs, BATCH):
        made = queue.enqueue_many(
            [queue.prepare(FUNC, (i, i)) for i in range(start, min(jobs, start + BATCH))]
        )
        entries = []
        for n, job in enumerate(made, start):
            ids.append(job.id)
            rec = job.record
            loc = (rec.writer_id, rec.segment, rec.offset)
            positions[rec.writer_id] = ChainPosition(rec.segment, 0, rec.seq + 1)
            if n % 20 == 0:
                continue  # no entry yet: forwarded, running
            if n % 20 == 1:
                entries.append(
                    Entry("retry", job.id, loc, attempt=1, run_at=now + 3600, at=now, error="E: x")
                )
                continue
            entries.append(
                Entry(
                    "done",
                    job.id,
                    loc,
                    outcome="succeeded",
                    at=now,
                    result={"n": n},
                    result_kept=True,
                    started=now,
                )
            )
        ledger.append_many([e.to_bytes() for e in entries])
    ledger.close()
    save_checkpoint(journal, Checkpoint(positions=positions, forwarded=jobs))
    index = LookupIndex(journal)
    started = time.perf_counter()
    index.open()
    index.catch_up()
    while index.building:  # as the forwarder does, a step at a time
        index.catch_up()
    index.close()
    return ids, time.perf_counter() - started


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def p(samples: list[float], q: float) -> float:
    """Percentile ``q`` (0 to 100) of the samples (seconds), in microseconds."""
    return benchlib.quantile(samples, q) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench-lookup", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs in the journal (the issue's: 1000000)")
    parser.add_argument("--samples", type=int, default=2000, help="lookups timed per operation")
    parser.add_argument("--get-status", type=int, default=5, help="Job.get_status() calls timed")
    parser.add_argument("--dir", default=None, help="where to build the journal (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="bench-lookup-", dir=args.dir)
    try:
        journal = os.path.join(base, "journal")
        t = time.perf_counter()
        ids, index_s = build(journal, args.jobs)
        print(f"built {args.jobs:,} jobs in {time.perf_counter() - t:.1f} s (lookup index: {index_s:.1f} s)")
        rng = random.Random(7)
        sample = [rng.choice(ids) for _ in range(args.samples)]
        it = iter(sample * 2)
        jobs: list[Job] = []

        def fetch() -> None:
            found = fetch_job(next(it), journal=journal)
            assert found is not None
            jobs.append(found)

        rows: dict[str, list[float]] = {}
        rows["fetch_job(id)"] = timed(fetch, args.samples)
        jit = iter(jobs * 3)
        rows["job.status"] = timed(lambda: next(jit).status, args.samples)
        rows["job.result"] = timed(lambda: next(jit).result, args.samples)
        rows["fetch_job(unknown id)"] = timed(
            lambda: fetch_job("no-such-id", journal=journal), args.samples // 4
        )
        git = iter(jobs)
        rows["Job.get_status()"] = timed(lambda: next(git).get_status(), args.get_status)
        statuses = {s: [j.status for j in jobs[:200]].count(s) for s in ("forwarded", "retrying", "finished")}
        print(f"statuses of the first 200 sampled: {statuses}")
        print(f"{'operation':<24}{'n':>6}{'p50 us':>12}{'p99 us':>12}")
        for name, samples in rows.items():
            print(f"{name:<24}{len(samples):>6}{p(samples, 50):>12.1f}{p(samples, 99):>12.1f}")
        ratio = statistics.median(rows["Job.get_status()"]) / statistics.median(rows["job.status"])
        print(f"Job.get_status() / job.status (medians): {ratio:,.0f}x")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak RSS of this process (the build included): {peak:,.0f} MiB")
        if args.json:
            figures = {k: {"n": len(v), "p50_us": p(v, 50), "p99_us": p(v, 99)} for k, v in rows.items()}
            print(json.dumps({"jobs": args.jobs, "index_build_s": index_s, "ops": figures}, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
