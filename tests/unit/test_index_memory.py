"""What the ledger's in-memory index costs per finished job, measured with tracemalloc (not timed).

Issue 29's memory bound: until its journal segment is compacted, a finished job is one entry of
:attr:`LedgerIndex.terminal`: its offset in a sorted array and its outcome's code in a byte
(``hybridq.ledger.outcomes``), the latest few in a dict until they are merged in. A ``dict`` of
offsets took 57 bytes a job, and 58 more while its outcome was the entry's own string.
"""

from __future__ import annotations

import gc
import itertools
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.outcomes import SegmentOutcomes

#: Enough for the dict of the latest additions to be a small part (it holds up to 8, or a
#: 64th of the segment's jobs: their ints and slots, ~90 bytes each).
JOBS = 20_000
#: Bytes per finished job the index may grow by (5.5 measured: 4 for the offset, 1 for the
#: outcome, the recent dict; 57 with a dict of offsets, 115 before the outcome strings were
#: shared).
BOUND = 8


def test_finishing_jobs_grows_the_index_by_less_than_the_bound_per_job() -> None:
    raw = [
        Entry("done", f"job-{i}", ("chain", 3, 4096 + 300 * i), outcome="succeeded", at=1.0).to_bytes()
        for i in range(JOBS)
    ]
    index = LedgerIndex()
    index.apply(Entry.from_bytes(raw[0]))  # the segment's map exists before the count starts
    gc.collect()
    tracemalloc.start()
    try:
        for payload in raw[1:]:
            index.apply(Entry.from_bytes(payload))  # as the harvest and a restart's replay do
        gc.collect()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.terminal_count == JOBS
    assert grown / JOBS < BOUND, f"{grown / JOBS:.0f} bytes per finished job"


@pytest.mark.parametrize("jobs", [10, 100, 1000])
def test_a_segment_with_few_finished_jobs_costs_no_more_than_a_dict(jobs: int) -> None:
    """Many short chains each keep a segment with few finished jobs: its map costs less than the
    ``dict`` of offsets it replaced (one job costs the map's own object more: about 80 bytes)."""
    segments = 2000 * 10 // jobs
    # Each job's offset is an int of its own (as read from its entry), made while counting.

    def grown(build: Callable[[], object]) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            kept = build()
            gc.collect()
            size, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del kept
        return size

    def compact() -> LedgerIndex:
        index = LedgerIndex()
        for s in range(segments):
            for i in range(jobs):
                index.apply_succeeded((f"w{s}", 0, 4096 + 330 * i))
        return index

    def plain() -> dict[tuple[str, int], dict[int, str]]:  # as the index kept them before
        terminal: dict[tuple[str, int], dict[int, str]] = {}
        for s in range(segments):
            for i in range(jobs):
                terminal.setdefault((f"w{s}", 0), {})[4096 + 330 * i] = "succeeded"
        return terminal

    new, old = grown(compact), grown(plain)
    assert new < old, f"{new / segments / jobs:.1f} against {old / segments / jobs:.1f} bytes a job"


def test_a_punched_segment_costs_its_ranges_not_its_jobs() -> None:
    """Issue 29: the succeeded jobs of a punched range leave the map; the range stays (24 bytes).

    One job in 100 waiting (1 in 1,000 cancelled: kept listed), the runs between them punched.
    """
    waiting = {i for i in range(JOBS) if i % 100 == 50}
    cuts = [-1, *sorted(waiting), JOBS]
    spans = [
        (4096 + 300 * (a + 1), 4096 + 300 * b, b - a - 1) for a, b in itertools.pairwise(cuts) if b - a > 1
    ]
    index = LedgerIndex()
    for i in range(2):  # once before the count: the caches the first calls fill (abc's) are not the map
        index.apply(Entry("done", "warm", ("chain", 2, 4096 + 300 * i), outcome="succeeded", at=1.0))
    index.collapse(("chain", 2), [(4096, 4096 + 600, 2)])
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(JOBS):
            if i not in waiting:
                outcome = "cancelled" if i % 1000 == 7 else "succeeded"
                index.apply(Entry("done", f"job-{i}", ("chain", 3, 4096 + 300 * i), outcome=outcome, at=1.0))
        gc.collect()
        full, _ = tracemalloc.get_traced_memory()
        index.collapse(("chain", 3), spans)
        gc.collect()
        collapsed, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    done = index.terminal[("chain", 3)]
    assert index.terminal_count - 2 == len(done) == JOBS - len(waiting)
    assert len(list(done)) == sum(1 for i in range(JOBS) if i % 1000 == 7)
    assert full > 5 * JOBS * 0.99  # about 5.5 bytes a job before
    # After: the map's objects (about 1 KB), 24 bytes a range, 5 a listed job; in the whole
    # suite's process about 2 KB more is traced (9,217 bytes measured: caches the first collapse
    # fills), against 120 KB before the collapse.
    assert collapsed < 8192 + 24 * len(spans), f"{collapsed} bytes for {len(spans)} ranges (before: {full})"
    assert all(index.is_terminal(("chain", 3, 4096 + 300 * i)) != (i in waiting) for i in range(JOBS))


def test_past_its_cap_the_index_holds_the_cap_and_a_sample_per_spilled_segment(tmp_path: Path) -> None:
    """Issue 29: 2,000,000 finished jobs over 20 live segments (100,000 each in 18, the drain
    front's two with 20,000), under a cap of 100,000 offsets: the 18 move to disk, what stays is
    the front's offsets (5 bytes each) and per spilled segment its object, a sample of one offset
    in 512 and the block its last lookup read (4.5 KB): about 0.06 MB instead of 9.5 MB."""
    gc.collect()
    tracemalloc.start()
    try:
        index = LedgerIndex()
        for s in range(20):
            jobs = 100_000 if s < 18 else 20_000
            index.terminal["chain", s] = SegmentOutcomes.from_groups(
                {"succeeded": range(4096, 4096 + 330 * jobs, 330)}
            )
            index.terminal_count += jobs
        gc.collect()
        full, _ = tracemalloc.get_traced_memory()
        index.spill_past(str(tmp_path), 100_000)
        assert all(index.is_terminal(("chain", s, 4096 + 330 * 777)) for s in range(20))  # a block read each
        assert not index.is_terminal(("chain", 3, 4096 + 330 * 777 + 1))
        gc.collect()
        spilled, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [seg for seg, done in index.terminal.items() if not done.spilled] == [("chain", 18), ("chain", 19)]
    assert index.terminal_count == sum(map(len, index.terminal.values())) == 1_840_000
    assert full > 1_840_000 * 5
    # The front's 40,000 offsets (200 KB) and, per spilled segment, about 2 KB: 262 KB measured.
    assert spilled < 40_000 * 5 + 18 * 4096 + 8192, f"{spilled} bytes (in memory: {full})"
