"""Threads that one fsync acknowledged together wake the forwarder with one nudge, not one each.

Every enqueue is still followed by a nudge sent after its records were written (docs/forwarder.md):
its own, or another thread's that read the writer's position once they were.
"""

from __future__ import annotations

import socket
import threading
import time
import types
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.journal import FileOps
from hybridq.journal.writer import JournalWriter
from hybridq.producer import commit as producer
from hybridq.protocol import nudge

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


def test_two_threads_making_the_sender_socket_at_once_leave_none_unclosed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forwarder's lookup check nudges from its own thread while a producer nudges: the first
    send of a process made two sockets and dropped one unclosed (a ResourceWarning, which failed
    tests/crash/test_s7_key_table_full_disk.py about once in five runs)."""
    made: list[socket.socket] = []
    real = socket.socket

    def make(*args: object) -> socket.socket:
        sock = real(*args)  # type: ignore[arg-type]
        made.append(sock)
        time.sleep(0.05)  # long enough for the other thread to find no socket either
        return sock

    fake = types.SimpleNamespace(
        socket=make, AF_UNIX=socket.AF_UNIX, SOCK_DGRAM=socket.SOCK_DGRAM, SOCK_CLOEXEC=socket.SOCK_CLOEXEC
    )
    monkeypatch.setattr(nudge, "socket", fake)  # this module's sockets only
    sender = nudge._Sender()
    both = threading.Barrier(2, timeout=5)

    def send() -> None:
        both.wait()
        sender.send("\0hybridq-test-none")

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    try:
        assert made
        assert [sock for sock in made if sock is not sender.sock and sock.fileno() != -1] == []
    finally:
        sender.close()
        for sock in made:
            sock.close()


def test_a_nudge_while_this_thread_makes_the_socket_is_skipped_not_waited_for() -> None:
    """``Forwarder.stop()`` nudges from a signal handler, which may run while its own thread holds
    the lock that makes the socket: a blocking lock hung the process there (a review's probe)."""
    sender = nudge._Sender()
    assert sender._making.acquire(blocking=False)  # as the interrupted thread holds it
    try:
        started = time.monotonic()
        sender.send("\0hybridq-test-none")  # the signal handler's nudge: returns at once
        assert time.monotonic() - started < 1.0
        assert sender.sock is None
    finally:
        sender._making.release()
        sender.close()
    sender.send("\0hybridq-test-none")  # later nudges make it as before
    try:
        assert sender.sock is not None
    finally:
        sender.close()


def test_threads_on_both_chains_are_each_covered_by_a_nudge(
    monkeypatch: pytest.MonkeyPatch, journal_dir: Path
) -> None:
    """Delayed calls go to the process's second chain (docs/journal.md): a nudge covers a job when
    it was sent after that job's own chain had written it, whatever the other chain did."""
    writers = {
        False: JournalWriter(journal_dir, fileops=SlowSync()),
        True: JournalWriter(journal_dir, fileops=SlowSync()),
    }
    sent: list[tuple[tuple[str, int], tuple[str, int]]] = []
    monkeypatch.setattr(producer, "shared_writer", lambda *_a, delayed=False, **_k: writers[delayed])
    monkeypatch.setattr(
        producer, "nudge", lambda *_a, **_k: sent.append((writers[False].written, writers[True].written))
    )
    queue = Queue(journal=journal_dir)
    uncovered = []
    jobs = []
    lock = threading.Lock()

    def work(t: int) -> None:
        for i in range(10):
            job = queue.enqueue("tests.tasks.add", i, 1, delay=3600 if (t + i) % 2 else None)
            with lock:
                jobs.append(job)
            rec = job.record
            if not any(c == rec.writer_id and seq >= rec.seq for pair in sent for c, seq in pair):
                uncovered.append(job)

    try:
        pool = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        for writer in writers.values():
            writer.close()
    assert {job.record.writer_id for job in jobs} == {w.writer_id for w in writers.values()}
    assert not uncovered
