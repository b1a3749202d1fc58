"""Threads that one fsync acknowledged together wake the forwarder with one nudge, not one each.

Every enqueue is still followed by a nudge sent after its records were written (docs/forwarder.md):
its own, or another thread's that read the writer's position once they were.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.journal import FileOps
from hybridq.journal.writer import JournalWriter
from hybridq.producer import queue as producer

THREADS = 16


class SlowSync(FileOps):
    def fdatasync(self, fd: int) -> None:
        time.sleep(0.002)  # appenders pile up behind each fsync
        super().fdatasync(fd)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch, journal_dir: Path) -> list[tuple[str, int]]:
    """The writer's position at each nudge sent (the forwarder reads at least that far)."""
    positions: list[tuple[str, int]] = []
    writer = JournalWriter(journal_dir, fileops=SlowSync())
    monkeypatch.setattr(producer, "shared_writer", lambda *_a, **_k: writer)
    monkeypatch.setattr(producer, "nudge", lambda *_a, **_k: positions.append(writer.written))
    yield positions
    writer.close()


def test_one_thread_nudges_after_every_enqueue(journal_dir: Path, sent: list[tuple[str, int]]) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue("tests.tasks.add", i, 1) for i in range(5)]
    assert [seq for _, seq in sent] == [job.record.seq for job in jobs]


def test_threads_acknowledged_together_share_a_nudge(journal_dir: Path, sent: list[tuple[str, int]]) -> None:
    queue = Queue(journal=journal_dir)
    jobs = []
    uncovered = []
    lock = threading.Lock()

    def work() -> None:
        for i in range(10):
            job = queue.enqueue("tests.tasks.add", i, 1)
            with lock:
                jobs.append(job)
            # A nudge sent after this job's record was written covers it.
            if not any(chain == job.record.writer_id and seq >= job.record.seq for chain, seq in sent):
                uncovered.append(job)

    pool = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert len(jobs) == THREADS * 10
    assert not uncovered
    # One nudge per enqueue before (160 here); now about one per fsync.
    assert len(sent) <= len(jobs) // 2, len(sent)
