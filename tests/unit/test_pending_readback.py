"""The stats tracker when a block cannot be read back, and what a read-back costs (issue 29).

A block of waiting jobs is kept as a summary and read back from the journal when one of its
jobs finishes or a step that failed cuts it. A read that fails must leave the count honest
(never saved for the next start), and never turn a step's own error, or a stop, into another.
"""

from __future__ import annotations

import errno
import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.errors import JournalCorruption
from hybridq.journal import ChainPosition, JournalReader, JournalWriter
from hybridq.journal.commit import Durability
from hybridq.journal.holes import Hole, add_holes
from hybridq.journal.records import Loc
from hybridq.ledger.checkpoint import forwarder_holder
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.lookup import pending
from hybridq.lookup.pending import PendingTracker
from hybridq.lookup.pending_blocks import BLOCK_BYTES
from hybridq.lookup.pending_file import DeferredCount, save_count
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder


@pytest.fixture(autouse=True)
def no_rows_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of waiting jobs a summary, as in a forwarder past 100,000 waiting jobs."""
    monkeypatch.setattr(pending, "ROWS_KEPT", 0)


def jobs(path: Path, count: int, *, size: int = 0) -> list[tuple[Loc, tuple[str, float]]]:
    """``count`` jobs of queue ``q`` created at 1000, 1001...; ``size``: bytes of argument each."""
    with JournalWriter(path, durability=Durability.NO_FSYNC) as writer:
        for start in range(0, count, 64):
            writer.append_many(
                [
                    json.dumps({"queue": "q", "created_at": 1000.0 + i, "args": ["x" * size]}).encode()
                    for i in range(start, min(count, start + 64))
                ]
            )
    return [
        ((r.writer_id, r.segment_index, r.offset), ("q", 1000.0 + i))
        for i, r in enumerate(JournalReader(path).records())
    ]


def failing(monkeypatch: pytest.MonkeyPatch, times: int = 1) -> None:
    """The next ``times`` read-backs fail (too many open files)."""
    real, left = pending.read_rows, [times]

    def flaky(*args: Any) -> Any:
        if left[0]:
            left[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real(*args)

    monkeypatch.setattr(pending, "read_rows", flaky)


def saved_count(journal: Path) -> Path:
    return journal / "lookup" / "pending.state"


def test_a_block_not_read_back_makes_the_count_inexact_and_no_stop_saves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Fails before: the block's 512 jobs stayed counted, and a clean stop saved that count for
    # the next start, which took it (its key does not change): too high for good.
    records = jobs(tmp_path, 1024)
    count = DeferredCount()
    count.start(str(tmp_path), {}, LedgerIndex(), load_compacted(str(tmp_path)))
    assert count.advance(60.0)
    for loc, job in records:
        count.live.saw(loc, job)
    failing(monkeypatch)
    with caplog.at_level(logging.WARNING, "hybridq.forwarder"):
        for loc, _ in records[:512]:  # every job of the first block finishes
            count.done(loc)
    assert "cannot read" in caplog.text
    assert count.live.inexact
    assert count.live.pending == {"q": 1024}  # too high: it says so, and is not saved
    loc = records[-1][0]
    positions = {loc[0]: ChainPosition(loc[1], loc[2] + 1, 0)}
    save_count(str(tmp_path), count, positions, load_compacted(str(tmp_path)))
    assert not saved_count(tmp_path).exists()


def test_a_block_not_read_back_keeps_its_oldest_through_a_restarts_join(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails before: the join found the block's least again from its (shared, empty) rows: none,
    # so the oldest became the next block's (1512), too young, while job 1000 still waits.
    records = jobs(tmp_path, 1024)
    tracker = PendingTracker(str(tmp_path))
    for loc, job in records:
        tracker.saw(loc, job)
    failing(monkeypatch)
    tracker.done(records[5][0])
    assert tracker.inexact
    assert tracker.oldest() == 1000.0
    live = PendingTracker(str(tmp_path))
    live.take_older(tracker)
    assert live.oldest() == 1000.0  # too old rather than too young, as the docs say


def test_a_rewind_that_cannot_read_back_leaves_the_segment_whole_and_counts_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails before: rewind raised the read's error (out of a step's error handler, or a stop).
    records = jobs(tmp_path, 1024)
    tracker, ref = PendingTracker(str(tmp_path)), PendingTracker()
    for loc, job in records:
        tracker.saw(loc, job)
        ref.saw(loc, job)
    cut = records[100][0]
    failing(monkeypatch)
    tracker.rewind({cut[0]: ChainPosition(cut[1], cut[2], 0)})
    assert tracker.inexact
    for loc, job in records[100:]:  # read again: each was counted already
        tracker.saw(loc, job)
    for loc, _ in records[::3]:
        tracker.done(loc)
        ref.done(loc)
    assert (tracker.pending, tracker.oldest(), tracker.consumed) == (ref.pending, ref.oldest(), ref.consumed)


def test_a_failed_step_whose_rewind_cannot_read_back_raises_its_own_error(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails before: the read-back's OSError replaced the push's error (a Stopped became a crash).
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 1, 1)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    try:
        forwarder.step()
        queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(5)])

        def broken(batch: object) -> None:
            raise RuntimeError("push failed")

        with monkeypatch.context() as patch:
            patch.setattr(forwarder, "_push", broken)
            failing(patch)
            with pytest.raises(RuntimeError, match="push failed"):
                forwarder.step()  # its 5 records share the first job's block: cut, read back
        forwarder.step()
        assert forwarder.state.pending.pending == {"default": 6}  # read again, counted once
        assert forwarder.state.pending.inexact
    finally:
        forwarder.close()
    assert not saved_count(journal_dir).exists()


def test_a_stop_goes_on_when_the_count_cannot_be_saved(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails before: a JournalCorruption escaped ForwarderState.close(), so the forwarder's
    # close() never released the lookup, the flows, the lock.
    def corrupt(*_args: object) -> None:
        raise JournalCorruption("00000000.wal", 64, "checksum mismatch")

    monkeypatch.setattr("hybridq.forwarder.state.save_count", corrupt)
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    forwarder.step()
    forwarder.close()
    assert forwarder_holder(str(journal_dir)) is None  # the lock was released


def test_a_read_back_reads_about_a_mib_whatever_the_jobs_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails before: 40 jobs of 100 KB were one block, read back in one 4 MB read (512 of them:
    # 50 MB, 146 MB at the peak, inside the forwarder's loop).
    records = jobs(tmp_path, 40, size=100_000)
    tracker, ref = PendingTracker(str(tmp_path)), PendingTracker()
    for loc, job in records:
        tracker.saw(loc, job)
        ref.saw(loc, job)
    spans: list[int] = []
    real = pending.read_rows

    def measured(journal: str | None, seg: tuple[str, int], start: int, end: int, count: int) -> Any:
        spans.append(end - start)
        return real(journal, seg, start, end, count)

    monkeypatch.setattr(pending, "read_rows", measured)
    for loc, _ in records:
        tracker.done(loc)
        ref.done(loc)
    assert tracker.pending == ref.pending == {}
    assert len(spans) > 1
    assert max(spans) < BLOCK_BYTES + 100_200  # up to a MiB, plus the last record


def test_a_loaded_count_finds_each_blocks_least_again() -> None:
    # Fails before: a least that finished and was not found again yet was saved, then loaded as is.
    tracker = PendingTracker()  # every block rows
    for i in range(10):
        tracker.saw(("w", 0, 64 + 100 * i), ("q", 1000.0 + i))
    tracker.done(("w", 0, 64))  # the oldest finished: found again when asked
    again = PendingTracker.from_bytes(tracker.to_bytes())
    assert again.oldest() == tracker.oldest() == 1001.0


def test_a_restart_joining_the_count_before_it_keeps_the_oldest() -> None:
    # The tracker before blocks (main at 430c554) lost the older count's leasts to find again
    # when it took a segment over whole: `oldest` said a finished job's creation time.
    older, live = PendingTracker(), PendingTracker()
    for i in range(3):
        older.saw(("w", 0, 64 + 100 * i), ("q", 1000.0 + i))
    live.saw(("w", 1, 64), ("q", 2000.0))
    older.done(("w", 0, 64))
    live.take_older(older)
    assert live.oldest() == 1001.0
    assert live.pending == {"q": 3}


def test_an_error_of_the_count_on_an_outcome_neither_fails_the_step_nor_skips_the_pushed_list(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Fails before: the stats cache's error escaped ForwarderState.append, and the outcomes after
    # it in the batch stayed in the pushed list (reconciled again, for nothing).
    queue = Queue(journal=journal_dir)
    queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(3)])
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    try:
        forwarder.step()
        locs = [(r.writer_id, r.segment_index, r.offset) for r in JournalReader(journal_dir).records()]
        assert all(forwarder.state.pushed.listed(loc) for loc in locs)

        def broken(*_args: object) -> None:
            raise KeyError("a bug in the count")

        monkeypatch.setattr(PendingTracker, "done", broken)
        with caplog.at_level(logging.ERROR, logger="hybridq.forwarder"):
            forwarder.state.append([Entry("done", "", loc, outcome="invalid", at=0.0) for loc in locs])
        assert not any(forwarder.state.pushed.listed(loc) for loc in locs)
        assert forwarder.state.pending.inexact  # never saved for the next start
        assert sum("pending count" in r.getMessage() for r in caplog.records) == 1  # logged once
    finally:
        forwarder.close()
    assert not saved_count(journal_dir).exists()


def test_a_saved_count_naming_a_queue_it_does_not_list_is_not_loaded() -> None:
    # Fails before: a row's (or a sum's) queue id past the saved names loaded, then failed the
    # forwarder's step with an IndexError when its job finished (load_count catches ValueError).
    tracker = PendingTracker()
    for i in range(4):
        tracker.saw(("w", 0, 64 + 100 * i), ("a" if i % 2 else "b", 1000.0 + i))
    raw = tracker.to_bytes()
    (n,) = struct.unpack_from("<I", raw)
    head = json.loads(raw[4 : 4 + n])
    head["names"] = head["names"][:1]  # one queue's id now names nothing
    body = json.dumps(head).encode()
    with pytest.raises(ValueError, match="no such queue"):
        PendingTracker.from_bytes(struct.pack("<I", len(body)) + body + raw[4 + n :])


def test_a_read_back_skips_the_records_punched_since_they_were_read(tmp_path: Path) -> None:
    """Issue 29: the forwarder punches finished records (hybridq.journal.holes) of a block.

    The tracker held it as a summary; reading it back for another queue's first outcome skips them.
    """
    path = tmp_path / "j"
    with JournalWriter(path, durability=Durability.NO_FSYNC) as writer:
        for queue in ("a", "b"):
            writer.append_many(
                [
                    json.dumps({"queue": queue, "created_at": 1000.0 + i, "args": []}).encode()
                    for i in range(100)
                ]
            )
    records = list(JournalReader(path).records())
    tracker = PendingTracker(str(path))
    for i, r in enumerate(records):
        tracker.saw((r.writer_id, r.segment_index, r.offset), ("a" if i < 100 else "b", 1000.0 + i % 100))
    for r in records[:100]:
        tracker.done((r.writer_id, r.segment_index, r.offset))
    first, last = records[0], records[99]
    add_holes(str(path), first.writer_id, 0, [Hole(first.offset, last.end, first.seq, last.seq + 1, 100)])
    tracker.done((records[100].writer_id, 0, records[100].offset))  # reads the block back
    assert not tracker.inexact
    assert tracker.pending == {"b": 99}
    assert tracker.oldest() == 1001.0
