"""The stats tracker's memory does not grow with the jobs waiting (issue 29), and it counts the same.

It held about 20 bytes per record read (offset, creation time, queue): 20 MB over a million
waiting jobs. It now holds a summary per block of records none of whose jobs finished, and
reads a block back from the journal when one does; a tracker with no journal (every record as
a row, as before) is the reference it must agree with.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import pytest
from hybridq.journal import ChainPosition, JournalReader, JournalWriter
from hybridq.journal.records import Loc
from hybridq.lookup import pending
from hybridq.lookup.pending import PendingTracker, job_fields
from hybridq.lookup.pending_blocks import DEAD

#: What a forwarder keeps as rows before it keeps summaries.
ROWS_KEPT = pending.ROWS_KEPT


@pytest.fixture(autouse=True)
def no_rows_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of waiting jobs a summary (a test may set the forwarder's default back)."""
    monkeypatch.setattr(pending, "ROWS_KEPT", 0)


def waiting(tracker: PendingTracker, count: int, *, per_segment: int = 150_000) -> None:
    for i in range(count):
        tracker.saw(("w", i // per_segment, 64 + 300 * (i % per_segment)), (f"q{i % 3}", 1000.0 + i))


def held(count: int) -> int:
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        tracker = PendingTracker("/nonexistent")  # never read: none of the jobs finished
        waiting(tracker, count)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert tracker.pending == {f"q{i}": count // 3 + (i < count % 3) for i in range(3)}
    assert tracker.oldest() == 1000.0
    return grown


def test_the_tracker_does_not_grow_with_the_jobs_waiting() -> None:
    small, large = held(10_000), held(200_000)
    # 190,000 more waiting jobs in one more segment: it was 3.8 MB more (20 bytes each).
    assert large - small < 32 << 10, (small, large)


def journal_of(path: Path, count: int, seed: int) -> list[tuple[Loc, tuple[str, float] | None]]:
    rng = random.Random(seed)
    with JournalWriter(path, max_segment_bytes=8 << 10) as writer:
        for _ in range(count // 50):
            batch = [
                b"not a job"
                if rng.random() < 0.03
                else json.dumps({"queue": rng.choice("abc"), "created_at": rng.uniform(0, 1e6)}).encode()
                for _ in range(50)
            ]
            writer.append_many(batch)
    return [
        ((r.writer_id, r.segment_index, r.offset), job_fields(r.payload))
        for r in JournalReader(path).records()
    ]


def same(a: PendingTracker, b: PendingTracker) -> None:
    assert (a.pending, a.oldest(), a.consumed) == (b.pending, b.oldest(), b.consumed)


def test_the_blocks_read_back_count_what_rows_count(tmp_path: Path) -> None:
    records = journal_of(tmp_path, 3000, seed=7)
    rng = random.Random(7)
    fast, ref = PendingTracker(str(tmp_path)), PendingTracker()
    for loc, job in records:
        # Some were terminal when read (a restart over a drained part): those go in as rows.
        read = None if rng.random() < 0.02 else job
        fast.saw(loc, read)
        ref.saw(loc, read)
    assert sum(len(s.rows) for s in fast.segments.values()) < len(records) / 20
    same(fast, ref)
    order = [loc for loc, _ in records] + [("w", 99, 64), ("nope", 0, 64)]
    rng.shuffle(order)
    for n, loc in enumerate(order[: len(order) * 2 // 3]):
        fast.done(loc)
        ref.done(loc)
        if n % 97 == 0:
            fast.done(loc)  # told twice: counted once
            same(fast, ref)
    same(fast, ref)
    again = PendingTracker.from_bytes(fast.to_bytes(), str(tmp_path))
    same(again, ref)
    # A step that failed: the records after a position are read again.
    cut = records[len(records) // 2][0]
    for tracker in (again, ref):
        tracker.rewind({cut[0]: ChainPosition(cut[1], cut[2], 0)})
    same(again, ref)
    for loc, job in records[len(records) // 2 :]:
        again.saw(loc, job)
        ref.saw(loc, job)
    for loc in order[len(order) * 2 // 3 :]:
        again.done(loc)
        ref.done(loc)
        same(again, ref)
    for loc, _ in records:  # every one finished (the half read again: its jobs pending again)
        again.done(loc)
    assert again.pending == {}
    assert again.oldest() is None


def test_a_restart_joins_the_count_before_it_to_its_own(tmp_path: Path) -> None:
    records = journal_of(tmp_path, 1000, seed=3)
    half = len(records) // 2 + 7  # mid-block, mid-segment
    older, live, ref = PendingTracker(str(tmp_path)), PendingTracker(str(tmp_path)), PendingTracker()
    for n, (loc, job) in enumerate(records):
        (older if n < half else live).saw(loc, job)
        ref.saw(loc, job)
    for loc, _ in records[::3]:
        for tracker in (older, live, ref):
            tracker.done(loc)
    live.take_older(older)
    same(live, ref)
    for loc, _ in records[1::3]:
        live.done(loc)
        ref.done(loc)
    same(live, ref)


def test_a_step_that_failed_cuts_a_block_whose_jobs_all_finished(tmp_path: Path) -> None:
    # Such a block dropped its rows: the records it keeps are read back to know where to cut.
    records = journal_of(tmp_path, 600, seed=5)
    fast, ref = PendingTracker(str(tmp_path)), PendingTracker()
    for loc, job in records:
        fast.saw(loc, job)
        ref.saw(loc, job)
    cut = records[250][0]
    for loc, _ in records:
        if loc[1] <= cut[1]:  # every job of the segment cut (its one block) finished
            fast.done(loc)
            ref.done(loc)
    assert set(fast.segments[cut[:2]].rows.values()) == {DEAD}
    for tracker in (fast, ref):
        tracker.rewind({cut[0]: ChainPosition(cut[1], cut[2], 0)})
    same(fast, ref)
    for loc, job in records[250:]:
        fast.saw(loc, job)
        ref.saw(loc, job)
    same(fast, ref)
    for loc, _ in records:
        fast.done(loc)
    assert fast.pending == {}
    assert fast.consumed == len(records)


def test_records_read_after_every_job_of_their_block_finished(tmp_path: Path) -> None:
    # The forwarder keeps up: the open segment's last block empties, then more records come.
    records = journal_of(tmp_path, 300, seed=11)
    fast, ref = PendingTracker(str(tmp_path)), PendingTracker()
    for n, (loc, job) in enumerate(records):
        fast.saw(loc, job)
        ref.saw(loc, job)
        if n % 10 == 9:
            for done, _ in records[n - 9 : n + 1]:
                fast.done(done)
                ref.done(done)
            same(fast, ref)
    assert not DEAD.offsets  # the rows of a block none of whose jobs is pending: none, shared
    again = PendingTracker.from_bytes(fast.to_bytes(), str(tmp_path))
    same(again, ref)


def test_the_tracker_holds_at_most_its_rows_kept_past_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pending, "ROWS_KEPT", 5_000)
    small, large = held(10_000), held(200_000)
    assert large - small < 32 << 10, (small, large)
    tracker = PendingTracker("/nonexistent")
    waiting(tracker, 50_000)
    assert 5_000 <= tracker.held < 5_000 + 512
    assert sum(len(r.offsets) for s in tracker.segments.values() for r in s.rows.values()) == tracker.held


def test_a_burn_downs_jobs_finish_with_their_blocks_never_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default: fewer than ROWS_KEPT jobs read and not finished, every block is rows.
    monkeypatch.setattr(pending, "ROWS_KEPT", ROWS_KEPT)

    def refuse(*args: object) -> None:
        raise AssertionError(f"a block read back: {args}")

    monkeypatch.setattr(pending, "read_rows", refuse)
    records = journal_of(tmp_path, 3000, seed=13)
    fast, ref = PendingTracker(str(tmp_path)), PendingTracker()
    for n, (loc, job) in enumerate(records):
        fast.saw(loc, job)
        ref.saw(loc, job)
        if n % 100 == 99:  # the front of the drain finishes as more are read
            for done, _ in records[n - 199 : n - 99] if n >= 199 else ():
                fast.done(done)
                ref.done(done)
            same(fast, ref)
    for loc, _ in records:
        fast.done(loc)
        ref.done(loc)
    same(fast, ref)
    assert fast.pending == {}
    assert fast.held == 0  # every block's rows went with its last job
