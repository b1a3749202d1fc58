"""S7 for the forwarder: ENOSPC on its own writes (ledger, compaction state) mid-step.

The forwarder's run loop retries a step that hit a full disk (``Forwarder.run``); these tests
call ``step()`` the same way: once into the injected ENOSPC, then again with space. Whatever the
failing write was, no acknowledged job may be skipped or counted twice (issues 12.5, 12.6).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import JournalIOError
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import FileOps, JournalWriter
from hybridq.journal.reader import list_chains
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ledger.compacted import load_compacted
from hybridq.ops.status import collect_status
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport

from tests import tasks


class DiskFull:
    """Makes ``FileOps.write`` raise ENOSPC for files whose path ``matches``, ``count`` times."""

    def __init__(self, matches: Callable[[str], bool], count: int = 1) -> None:
        self.matches = matches
        self.left = 0
        self.count = count
        self.injected = 0

    def arm(self) -> None:
        self.left = self.count

    def write(self, real: Callable[[FileOps, int, bytes | memoryview], int]):
        def write(ops: FileOps, fd: int, data: bytes | memoryview) -> int:
            if self.left and self.matches(os.readlink(f"/proc/self/fd/{fd}")):
                self.left -= 1
                self.injected += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(ops, fd, data)

        return write


@pytest.fixture
def disk_full(monkeypatch: pytest.MonkeyPatch) -> Callable[..., DiskFull]:
    def make(matches: Callable[[str], bool], count: int = 1) -> DiskFull:
        full = DiskFull(matches, count)
        monkeypatch.setattr(FileOps, "write", full.write(FileOps.write))
        return full

    return make


def step_through_disk_full(forwarder: Forwarder, full: DiskFull) -> None:
    """One step into the injected ENOSPC (it must surface as such), then steps with space."""
    full.arm()
    with pytest.raises(JournalIOError) as info:
        forwarder.step()
    assert info.value.errno == errno.ENOSPC
    assert full.injected >= 1
    forwarder.step()


def test_enospc_recording_an_invalid_record_skips_no_job(journal_dir: Path, disk_full) -> None:
    queue = Queue(journal=journal_dir)
    before = [queue.enqueue(tasks.add, i, i).id for i in range(5)]
    _close_writers()
    with JournalWriter(journal_dir) as writer:
        writer.append(b'{"not": "an envelope"}')
    after = [queue.enqueue(tasks.add, i, i).id for i in range(5, 8)]
    _close_writers()
    full = disk_full(lambda path: f"{os.sep}ledger{os.sep}" in path)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        step_through_disk_full(forwarder, full)  # ENOSPC writing the invalid record's entry
        forwarder.step()
        # Every acknowledged job was pushed (before the fix the 5 read ahead of the invalid
        # record were dropped with the batch, and the checkpoint was saved past them).
        assert sorted(transport.queues["default"]) == sorted(before + after)
        transport.work()
        forwarder.completions.hurry()  # type: ignore[union-attr]
        for _ in range(3):
            forwarder.step()
    status = collect_status(str(journal_dir))
    # The invalid record is terminal (counted as failed), nothing is pending, and its segment
    # was compacted like the others.
    assert (status["accepted"], status["succeeded"], status["failed"], status["pending"]) == (9, 8, 1, 0)
    assert status["invalid_records"] == 1
    assert load_compacted(str(journal_dir)).invalid == 1
    assert load_checkpoint(str(journal_dir)).forwarded == 8


def test_enospc_saving_the_compaction_state_counts_each_segment_once(journal_dir: Path, disk_full) -> None:
    queue = Queue(journal=journal_dir)
    for chain in range(3):  # three chains of one sealed segment of 20 jobs each
        for i in range(20):
            queue.enqueue(tasks.add, chain, i)
        _close_writers()
    full = disk_full(lambda path: os.path.basename(path).startswith("compaction.state"))
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()
        transport.work()
        forwarder.completions.hurry(reconcile=False)  # type: ignore[union-attr]
        # The harvest makes all 60 terminal and compaction follows in the same step (no reconcile
        # pass reads the journal to wait for): ENOSPC saving compaction.state.
        step_through_disk_full(forwarder, full)
        forwarder.completions.hurry(reconcile=False)  # type: ignore[union-attr]
        forwarder.step()
    assert list_chains(str(journal_dir)) == {}  # all three segments compacted (chains forgotten)
    status = collect_status(str(journal_dir))
    # Before the fix: accepted=80 and succeeded=80 for 60 jobs (the segment counted twice).
    assert (status["accepted"], status["succeeded"], status["pending"]) == (60, 60, 0)
