"""The saved ledger index's save and load at a given size: time, and tracemalloc's peak (issue 29).

``--jobs`` finished jobs (1,000,000 by default) of ~330 bytes over ``--segments`` journal
segments (20), all ``succeeded``; with ``--cap N`` the index first spills past N offsets in
memory (``LedgerIndex.spill_past``, the forwarder's ``index_offsets_max``) and the load spills
as it reads, when the code has it (format 6 on; an older checkout loads whole, then spills).
The save is :func:`hybridq.ledger.saved_index.save`, the load :func:`~hybridq.ledger.saved_index.load`
(the state file's checksum checked, the JSON parsed, the index built), in a temporary directory
of ``--dir`` (a disk). ``--memory``: each traced by tracemalloc (its peak printed; the time is
then tracemalloc's too, so time and memory are separate runs). Prints the file's size too.
No journal but the state file, no Redis.

``--replay``: instead, a ledger of ``--jobs`` ``done`` entries (a journal chain of
``--segments`` segments, all live) replayed at a start without a saved index
(:func:`~hybridq.ledger.saved_index.resume`, the cap checked during the replay when the code
has it; an older checkout replays whole, then the forwarder spills).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import tempfile
import time
import tracemalloc

from hybridq.journal import JournalWriter
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.outcomes import SegmentOutcomes
from hybridq.ledger.store import open_ledger_writer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--segments", type=int, default=20)
    ap.add_argument("--cap", type=int, default=None)
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--dir", default=".")
    ap.add_argument("--replay", action="store_true")
    args = ap.parse_args()
    if args.replay:
        replay(args)
        return
    per = args.jobs // args.segments
    index = LedgerIndex()
    for s in range(args.segments):
        index.terminal["chain", s] = SegmentOutcomes.from_groups(
            {"succeeded": range(4096, 4096 + 330 * per, 330)}
        )
        index.terminal_count += per
        index.totals["succeeded"] += per
    with tempfile.TemporaryDirectory(dir=args.dir) as journal:
        if args.cap is not None:
            index.spill_past(journal, args.cap)
        streaming = "cap" in inspect.signature(saved_index.load).parameters

        def save() -> None:
            saved_index.save(journal, index, {}, {})

        def load() -> None:
            saved = saved_index.load(journal, None, args.cap) if streaming else saved_index.load(journal)
            assert saved is not None
            if args.cap is not None and not streaming:
                saved.index.spill_past(journal, args.cap)
            assert saved.index.terminal_count == per * args.segments

        for name, run in (("save", save), ("load", load)):
            gc.collect()
            if args.memory:
                tracemalloc.start()
            start = time.perf_counter()
            run()
            took = time.perf_counter() - start
            peak = tracemalloc.get_traced_memory()[1] if args.memory else 0
            tracemalloc.stop()
            size = os.path.getsize(os.path.join(journal, saved_index.SAVED_INDEX_NAME + ".state"))
            print(
                f"{name}: {took:.3f} s"
                + (f", peak {peak / 1e6:.1f} MB" if args.memory else "")
                + f" ({per * args.segments} jobs, {args.segments} segments, cap {args.cap}, file {size / 1e6:.1f} MB)"
            )


def replay(args: argparse.Namespace) -> None:
    per = args.jobs // args.segments
    with tempfile.TemporaryDirectory(dir=args.dir) as journal:
        with JournalWriter(journal, max_segment_bytes=4096) as jw:  # a chain whose segments are live
            for _ in range(args.segments):
                jw.append_many([b'{"x": "' + b"y" * 3000 + b'"}'])
            chain = jw.writer_id
        with open_ledger_writer(journal) as writer:
            for s in range(args.segments):
                for start in range(0, per, 10_000):
                    writer.append_many(
                        Entry(
                            "done", f"j{s}-{i}", (chain, s, 4096 + 330 * i), outcome="succeeded", at=1.0
                        ).to_bytes()
                        for i in range(start, min(per, start + 10_000))
                    )
        keys = KeyTable(os.path.join(journal, "keys.sqlite"))
        capped = "cap" in inspect.signature(saved_index.resume).parameters
        gc.collect()
        if args.memory:
            tracemalloc.start()
        start = time.perf_counter()
        if capped:
            index, _, _ = saved_index.resume(journal, Compacted(), keys, args.cap)
        else:
            index, _, _ = saved_index.resume(journal, Compacted(), keys)
            if args.cap is not None:
                index.spill_past(journal, args.cap)
        took = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] if args.memory else 0
        tracemalloc.stop()
        assert index.terminal_count == per * args.segments
        keys.close()
        print(
            f"replay: {took:.3f} s"
            + (f", peak {peak / 1e6:.1f} MB" if args.memory else "")
            + f" ({per * args.segments} jobs, {args.segments} segments, cap {args.cap})"
        )


if __name__ == "__main__":
    main()
