"""Forking (gunicorn/uwsgi preforking) while another thread holds a producer lock (issue 12.7)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.journal import JournalReader
from hybridq.producer import writers as producer
from hybridq.security import signing

from tests import tasks

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def fork_while_held(lock_of: object, queue: Queue, timeout: float = 5.0) -> int:
    """Fork while a parent thread holds ``lock_of()``; the child enqueues. Its exit code, or -1."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock_of():  # type: ignore[operator]
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        pid = os.fork()
        if pid == 0:  # child: only this thread exists; the holder's lock must not bind it
            code = 1
            try:
                queue.enqueue(tasks.add, 1, 2)
                code = 0
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -1  # hung


def test_a_child_forked_while_a_thread_recounts_capacity_can_enqueue(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir, capacity=100)
    queue.enqueue(tasks.add, 0, 0)
    assert queue._appender is not None
    pending = queue._appender.pending
    assert pending is not None
    assert fork_while_held(lambda: pending._lock, queue) == 0  # -1 (hung) before the fix
    assert len(list(JournalReader(journal_dir).records())) == 2


def test_a_child_forked_while_a_thread_makes_the_shared_writer_can_enqueue(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    assert fork_while_held(lambda: producer._writers_lock, queue) == 0  # -1 (hung) before the fix
    assert len(list(JournalReader(journal_dir).records())) == 1


def test_a_child_forked_while_a_thread_appends_can_enqueue(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 0, 0)
    writer = producer.shared_writer(str(journal_dir))
    for lock in (lambda: writer._lock, lambda: writer._sync_lock):
        assert fork_while_held(lock, queue) == 0
    assert len(list(JournalReader(journal_dir).records())) == 3


def test_a_child_forked_while_a_thread_reads_the_signing_keys_can_enqueue(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(signing.ENV_KEY, "k" * 32)
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 0, 0)  # signed
    assert fork_while_held(lambda: signing._cache_lock, queue) == 0  # -1 (hung) before the fix
    assert len(list(JournalReader(journal_dir).records())) == 2
