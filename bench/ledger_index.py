"""The ledger's in-memory index per finished job (issue 29): what the harvest and the pushes ask of it.

``--jobs`` jobs (200,000 by default) of ~330 bytes, 200,000 a journal segment (64 MiB),
finished in one of these orders, each a separate run (``--mode``):

  * ``inorder``: offsets finishing in increasing order (a FIFO drain):
    ``apply_succeeded(loc)`` then ``is_terminal(loc)``, as the harvest then its deletes ask;
  * ``succeeded``: ``apply_succeeded`` alone, in order (the replay of a ledger at start);
  * ``apply``: ``inorder`` through :meth:`LedgerIndex.apply` of prebuilt ``done`` entries (the harvest
    folds in what it appended);
  * ``shuffled``: ``apply_succeeded`` + ``is_terminal`` in an order shuffled within windows of
    10,000 jobs (priorities, fair keys, retries);
  * ``pending``: half of the jobs finished (every other one, not timed), then ``is_terminal`` of
    every job (what the pushes and the reconcile pass ask: mostly jobs not finished);
  * ``scattered``: as ``pending``, in an order shuffled over all the jobs (each lookup in another
    block of a spilled map);
  * ``none``: only the setup (subtract its instructions from the others' under callgrind; the
    entries of ``apply`` are built in its setup only: subtract ``--mode none --entries``; the
    half of ``pending``'s jobs finished in its setup: ``--mode none --half``).

``--spill``: the maps of the setup's finished jobs are moved to disk before the timed part
(``hybridq.ledger.outcome_spill``: ``pending`` and ``scattered`` then time lookups in a spilled
map); ``--cap N``: the index spills past N offsets in memory (``LedgerIndex.spill_past``, as the
forwarder's ``index_offsets_max``) while the timed part adds. Both write their files in the
``.index-spill/`` of a temporary directory of ``--dir``, as a forwarder in its journal's (the
current one by default: a disk, not a tmpfs).

``--memory``: what the index holds at the end (tracemalloc, the whole run traced: the time
printed is then not the index's alone).

Prints seconds per job. Deterministic counts: ``valgrind --tool=callgrind`` of each mode minus
``none``. No journal, no Redis: the index alone.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
import tracemalloc

from hybridq.ledger import index as index_module
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex

#: Jobs per 64 MiB journal segment at ~330 bytes a record.
PER_SEGMENT = 200_000
RECORD = 330


def locs(jobs: int) -> list[tuple[str, int, int]]:
    """Where ``jobs`` jobs of the same chain are recorded, oldest first."""
    return [("chain", i // PER_SEGMENT, 4096 + RECORD * (i % PER_SEGMENT)) for i in range(jobs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200_000)
    parser.add_argument(
        "--mode",
        choices=("inorder", "succeeded", "apply", "shuffled", "pending", "scattered", "none"),
        default="inorder",
    )
    parser.add_argument("--spill", action="store_true", help="move the setup's maps to disk first")
    parser.add_argument("--cap", type=int, default=None, help="spill past this many offsets in memory")
    parser.add_argument(
        "--dir",
        default=".",
        help="where the temporary directory of the spill files (its .index-spill/) is made",
    )
    parser.add_argument("--memory", action="store_true", help="trace what the index holds (tracemalloc)")
    parser.add_argument("--entries", action="store_true", help="build apply's entries in any mode")
    parser.add_argument("--half", action="store_true", help="finish pending's half of the jobs in any mode")
    args = parser.parse_args()
    where = locs(args.jobs)
    if args.mode == "shuffled":
        rng = random.Random(29)
        for start in range(0, len(where), 10_000):
            window = where[start : start + 10_000]
            rng.shuffle(window)
            where[start : start + 10_000] = window
    entries = []
    if args.mode == "apply" or args.entries:
        entries = [Entry("done", f"job-{i}", loc, outcome="succeeded", at=1.0) for i, loc in enumerate(where)]
    if args.memory:
        tracemalloc.start()
    index = LedgerIndex()
    if args.mode in ("pending", "scattered") or args.half:
        for loc in where[::2]:
            index.apply_succeeded(loc)
    spill_dir = tempfile.TemporaryDirectory(dir=args.dir)
    if args.spill:
        assert all(done.spill(spill_dir.name) for done in index.terminal.values())
    if args.cap is not None:
        index.spill_past(spill_dir.name, args.cap)
    if args.mode == "scattered":
        random.Random(29).shuffle(where)
    started = time.perf_counter()
    if args.mode in ("inorder", "shuffled"):
        for loc in where:
            index.apply_succeeded(loc)
            index.is_terminal(loc)
    elif args.mode == "succeeded":
        for loc in where:
            index.apply_succeeded(loc)
    elif args.mode == "apply":
        for entry in entries:
            index.apply(entry)
            index.is_terminal(entry.loc)
    elif args.mode in ("pending", "scattered"):
        found = sum(map(index.is_terminal, where))
        assert found == (args.jobs + 1) // 2
    elapsed = time.perf_counter() - started
    if args.mode not in {"pending", "scattered", "none"}:
        assert index.terminal_count == args.jobs
    spilled = sum(done.spilled for done in index.terminal.values())
    if args.memory:
        del where, entries
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        listed = sum(done.resident() for done in index.terminal.values())
        print(
            f"held: {held / 1e6:.2f} MB, {held / len(index.terminal):.0f} B a segment, {listed} offsets in memory"
        )
    print(
        f"{args.mode}: {elapsed / args.jobs * 1e9:.0f} ns per job ({args.jobs} jobs; {spilled} maps spilled)"
    )
    print(f"(the index of {index_module.__file__})", file=sys.stderr)


if __name__ == "__main__":
    main()
