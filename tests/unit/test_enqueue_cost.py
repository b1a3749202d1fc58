"""What a durable ``Queue.enqueue`` costs, counted rather than timed (issue 27).

These are the regressions the old timed guard (hybridq's enqueue rate over ``rq.Queue.enqueue``'s,
which flaked under load) stood for: a second fsync per call, a lock held across the fsync, a
Redis call on the producer path. Counts do not depend on the machine's load; the rates
themselves are P1-P3 of ``scripts/bench-enqueue`` (docs/benchmarks.md), measured side by side
with RQ in one run.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.producer.queue import _close_writers

FUNC = "tests.tasks.add"
THREADS = 16


class Syncs:
    """Counts ``fdatasync`` and ``fsync`` calls (optionally slowed down) and stream connections."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, delay_s: float = 0.0) -> None:
        self.syncs = 0
        self.connects: list[object] = []
        self._lock = threading.Lock()
        for name in ("fdatasync", "fsync"):
            monkeypatch.setattr(os, name, self._counted(getattr(os, name), delay_s))
        real_connect = socket.socket.connect
        # Only the enqueuing thread's: a thread an earlier test left running (a server's, a
        # client pool's) may connect meanwhile, and is not the enqueue (the full run saw one).
        caller = threading.get_ident()

        def connect(sock: socket.socket, address: object) -> None:
            # A Redis connection; the nudge is a datagram.
            if sock.type & socket.SOCK_STREAM and threading.get_ident() == caller:
                self.connects.append(address)
            real_connect(sock, address)

        monkeypatch.setattr(socket.socket, "connect", connect)

    def _counted(self, real, delay_s: float):
        def sync(fd: int) -> None:
            with self._lock:
                self.syncs += 1
            time.sleep(delay_s)
            real(fd)

        return sync


@pytest.fixture
def queue(journal_dir: Path) -> Iterator[Queue]:
    queue = Queue("default", journal_dir)
    for _ in range(3):  # the segment, its directory entry, the first records: not counted
        queue.enqueue(FUNC, 0, 0)
    yield queue
    _close_writers()


def test_one_enqueue_is_one_fsync_and_no_redis_connection(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Syncs(monkeypatch)
    for i in range(50):
        queue.enqueue(FUNC, i, i)
    assert counted.syncs == 50
    assert counted.connects == []


def test_enqueue_many_is_one_fsync_for_the_batch(queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Syncs(monkeypatch)
    jobs = queue.enqueue_many([queue.prepare(FUNC, (i, i)) for i in range(1000)])
    assert len(jobs) == 1000
    assert counted.syncs == 1


def test_concurrent_enqueues_share_fsyncs_no_lock_is_held_across_one(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 threads, each fsync made to take 50 ms: the others' records pile up behind it."""
    counted = Syncs(monkeypatch, delay_s=0.05)
    start = threading.Barrier(THREADS)

    def enqueue_some() -> None:
        start.wait()
        for i in range(4):
            queue.enqueue(FUNC, i, i)

    threads = [threading.Thread(target=enqueue_some) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A lock held across the fsync makes one fsync per enqueue (64); group commit makes a few.
    assert counted.syncs <= THREADS * 4 // 4, counted.syncs
