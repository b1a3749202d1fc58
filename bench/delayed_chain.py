"""A steady mix of immediate jobs and jobs delayed an hour: what stays on disk and in memory (issue 29).

One process enqueues ``--jobs`` jobs (~200 B of arguments), 1 in ``--every`` of them delayed by
an hour (its own ``enqueue`` call, the others ``enqueue_many`` calls of ``--every - 1``), while a
forwarder (in the same process, the in-memory transport's worker running each job) forwards,
harvests and compacts after every call. The producer's segments are sealed past
``--segment-bytes`` (default 1 MiB, so that 50,000 jobs fill a dozen; a real producer's are
64 MiB, and a day of them is what a day-delayed job pins). Once every immediate job finished
and compaction ran, it prints:

  * the journal's segment files and bytes (``segment_usage``), and the ledger's; and the bytes
    the journal's segments hold on disk (``st_blocks``: less than their size once finished
    records were punched out of them, ``hybridq.journal.holes``);
  * the ledger's ``st_blocks`` too, and its ids files' (the successes punched out of it kept as
    ids, ``hybridq.ledger.punched_ids``);
  * the forwarder's ledger index memory: tracemalloc's bytes allocated by ``hybridq/ledger/``
    code that are still alive (started before the forwarder opened);
  * the delayed jobs still pending (all of them: they are an hour away).

``--steady S``: the forwarder's clock (simulated) advances S seconds a call, and each delayed
job runs an hour after its call on that clock: with 10 s a call, the delayed jobs of the first
140 of 500 calls come due and run during the run, as in a steady state (their ``done`` entries
go to the ledger while their segment stays).

``--keyed``: each delayed job has an explicit ``idempotency_key``, whose ``key`` entry the
forwarder appends to its ledger when it reads the job (docs/enqueue.md, "Enqueue-if-absent").

``--pin``: before anything else, one job delayed an hour with an explicit ``idempotency_key``
(in the main chain: it pins the first segment and, until it runs, every later one), and no
other delayed job unless ``--every`` says so (``--every 0``: none).

Runs against whatever ``hybridq`` is importable (PYTHONPATH): run it on two trees to compare.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
import tracemalloc

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.reader import segment_usage
from hybridq.ledger.store import ledger_dir
from hybridq.ops.status import collect_status
from hybridq.producer import writers
from hybridq.transport import MemoryTransport

PAD = "x" * 200


def ledger_index_bytes() -> int:
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(inclusive=True, filename_pattern="*/hybridq/ledger/*")]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


def allocated(journal: str) -> int:
    """Bytes of disk the journal's segment files hold (``st_blocks``: punched ranges hold none)."""
    return sum(entry.stat().st_blocks * 512 for entry in os.scandir(journal) if entry.name.endswith(".wal"))


def ids_files(ledger: str) -> tuple[int, int]:
    """The ledger's ids files (``hybridq.ledger.punched_ids``; none before it): their count and ``st_blocks`` x 512."""
    try:
        found = [e for e in os.scandir(ledger) if e.name.endswith(".ids.state")]
    except FileNotFoundError:
        return 0, 0
    return len(found), sum(e.stat().st_blocks * 512 for e in found)


def ran(transport: MemoryTransport) -> int:
    """The delayed jobs run so far (the only jobs with a ``run_at``)."""
    return sum(1 for job_id in transport.executions if transport.jobs[job_id].run_at is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--segment-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--steady",
        type=float,
        default=0.0,
        metavar="S",
        help="simulated seconds per call: the forwarder's clock advances, so the delayed jobs come due "
        "during the run (0: real time, none does)",
    )
    parser.add_argument(
        "--keyed", action="store_true", help="each delayed job with an explicit idempotency_key"
    )
    parser.add_argument(
        "--punch-done",
        action="store_true",
        help="the ledger puncher also punches the successes of jobs in punched journal ranges",
    )
    parser.add_argument(
        "--pin", action="store_true", help="first, one keyed job delayed an hour (it pins the main chain)"
    )
    args = parser.parse_args()
    # The main chain's segment size: a tree before issue 29's change has one writer per process
    # (made with JournalWriter's default), a tree after it passes its own main and delayed sizes.
    writers.JournalWriter = functools.partial(JournalWriter, max_segment_bytes=args.segment_bytes)  # type: ignore[misc]
    writers.DEFAULT_MAX_SEGMENT_BYTES = args.segment_bytes  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory(prefix="bench-dchain-") as journal:
        queue = Queue(journal=journal)
        transport = MemoryTransport()
        tracemalloc.start()
        sim = [time.time()]
        clock = (lambda: sim[0]) if args.steady else time.time
        forwarder = Forwarder(journal, transport, reconcile_interval_s=3600.0, clock=clock)
        forwarder.open()
        completions = forwarder.completions
        assert completions is not None
        if args.punch_done:
            completions.compactor.ledger_puncher.done_in_ranges = True

        def turn() -> None:
            forwarder.step()
            transport.work()
            completions.hurry(reconcile=False)
            completions.compactor.hurry()
            forwarder.step()

        peak_bytes = peak_ledger = peak_alloc = delayed = 0
        started = time.perf_counter()
        if args.pin:
            queue.enqueue("bench.noop", -1, PAD, delay=3600, idempotency_key="pin")
            delayed += 1
        step = args.every or 100
        for start in range(0, args.jobs, step):
            queue.enqueue_many(
                [queue.prepare("bench.noop", (i, PAD)) for i in range(start, start + step - (args.every > 0))]
            )
            key = f"remind:{start}" if args.keyed else None
            if args.every and args.steady:
                sim[0] += args.steady
                queue.enqueue("bench.noop", start, PAD, run_at=sim[0] + 3600, idempotency_key=key)
            elif args.every:
                queue.enqueue("bench.noop", start, PAD, delay=3600, idempotency_key=key)
            delayed += args.every > 0
            turn()
            peak_bytes = max(peak_bytes, segment_usage(journal)[1])
            peak_alloc = max(peak_alloc, allocated(journal))
            peak_ledger = max(peak_ledger, segment_usage(ledger_dir(journal))[1])
        for _ in range(600):
            if collect_status(journal)["pending"] == delayed - ran(transport):
                break
            turn()
        for _ in range(3):  # the last sealed segments' deletion
            turn()
        # The ledger's punch reads one segment a pass, once the journal moved on (a tree before
        # it has none: the same turns cost nothing there).
        lp = getattr(completions.compactor, "ledger_puncher", None)
        for _ in range(20):
            turn()
        ledger_on_disk = allocated(ledger_dir(journal))
        id_files, id_bytes = ids_files(ledger_dir(journal))
        segments, size = segment_usage(journal)
        on_disk = allocated(journal)
        ledger_segments, ledger_size = segment_usage(ledger_dir(journal))
        index = ledger_index_bytes()
        pending, delayed_ran = collect_status(journal)["pending"], ran(transport)
        forwarder.close()
        print(
            f"jobs={args.jobs} delayed={delayed} keyed={args.keyed} segment_bytes={args.segment_bytes} "
            f"seconds={time.perf_counter() - started:.1f}\n"
            f"journal: peak_bytes={peak_bytes} after: segments={segments} bytes={size}\n"
            f"journal on disk (st_blocks): peak={peak_alloc} after={on_disk}\n"
            f"ledger: peak_bytes={peak_ledger} after: segments={ledger_segments} bytes={ledger_size}\n"
            f"ledger on disk (st_blocks): after={ledger_on_disk}"
            f" punched={getattr(lp, 'punched', 0)} entries_looked={getattr(lp, 'looked', 0)}"
            f" ids files={id_files} on disk={id_bytes}\n"
            f"ledger index (tracemalloc, hybridq/ledger/ allocations alive): {index} B\n"
            f"pending after: {pending}; delayed jobs run: {delayed_ran} (steady={args.steady} s a call)"
        )


if __name__ == "__main__":
    main()
