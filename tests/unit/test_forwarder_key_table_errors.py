"""A key-table error reaches the loop wherever it is caught: a full disk pauses, anything else stops.

docs/reliability.md "The key table", rule 6: a full disk pauses and opens again
(tests/crash/test_s7_key_table_full_disk.py; here one at the mark), anything else stops the
loop with one ``JournalIOError`` (EIO), even when a save of the index caught the error of its
mark: that run goes on no further with a table that may have lost rows. (The "mark" case of
the first test failed on main: the failed mark was logged and the forwarder went on.)
"""

from __future__ import annotations

import errno
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.errors import JournalIOError
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger import saved_index
from hybridq.producer.queue import _close_writers
from hybridq.testing.memory import MemoryTransport

from tests import tasks

IOERR_WRITE = 10 | (3 << 8)


class _Failing:
    """The table's connection: a statement starting with ``starts`` fails (an I/O error, or ``code``)."""

    def __init__(self, db: sqlite3.Connection, starts: str, code: int = IOERR_WRITE) -> None:
        self._db, self._starts, self._code = db, starts, code

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.lstrip().upper().startswith(self._starts):
            exc = sqlite3.OperationalError(
                "disk I/O error" if self._code != 13 else "database or disk is full"
            )
            exc.sqlite_errorcode = self._code  # type: ignore[attr-defined]
            raise exc
        return self._db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return (
            self.execute(sql)
            if sql.lstrip().upper().startswith(self._starts)
            else self._db.executemany(sql, *args)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def run_until_it_raises(forwarder: Forwarder, timeout: float = 10.0) -> tuple[list[BaseException], bool]:
    """``forwarder.run()`` on a thread until it raises; what it raised, and whether it had to be
    stopped instead (still running after ``timeout`` s)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            forwarder.run()  # returns only by an error until stop() is called
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=timeout)
    stopped = runner.is_alive()
    if stopped:
        forwarder.stop()
        runner.join(timeout=timeout)
    return raised, stopped


@pytest.mark.parametrize("starts", ["INSERT INTO KEYS", "INSERT OR REPLACE INTO META"], ids=["own", "mark"])
def test_an_io_error_of_the_key_table_stops_the_run_with_eio(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, starts: str
) -> None:
    monkeypatch.setattr(saved_index, "SAVE_EVERY", 1)  # each step saves the index: marks the table
    queue = Queue(journal=journal_dir)
    forwarder = Forwarder(journal_dir, MemoryTransport(), idle_timeout_s=0.05)
    forwarder.open()
    try:
        keys = forwarder.state.index.keys
        keys._db = _Failing(keys._db, starts)  # type: ignore[assignment]
        queue.enqueue(tasks.add, 1, 1, idempotency_key="k1")
        _close_writers()
        raised, stopped = run_until_it_raises(forwarder)
        if stopped:
            pytest.fail("the forwarder went on after an I/O error of its key table")
        assert len(raised) == 1
        assert isinstance(raised[0], JournalIOError)
        assert raised[0].errno == errno.EIO
        assert forwarder.stats.disk_full_retries == 0
        assert keys.failed
    finally:
        forwarder.close()


def test_a_full_disk_at_the_mark_pauses_and_opens_again(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLITE_FULL at the mark, caught by the save of the index: a pause, then a reopen."""
    monkeypatch.setattr(saved_index, "SAVE_EVERY", 1)
    queue = Queue(journal=journal_dir)
    transport = MemoryTransport()
    forwarder = Forwarder(journal_dir, transport, idle_timeout_s=0.05)
    forwarder.open()
    keys = forwarder.state.index.keys
    keys._db = _Failing(keys._db, "INSERT OR REPLACE INTO META", code=13)  # type: ignore[assignment]
    jobs = [queue.enqueue(tasks.add, i, i, idempotency_key=f"k{i}").id for i in range(3)]
    _close_writers()
    runner = threading.Thread(target=forwarder.run, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while not any("again after a full disk" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "never opened again"
            time.sleep(0.01)
        assert forwarder.stats.disk_full_retries >= 1
        assert forwarder.state.index.keys is not keys  # a new table, the ledger replayed into it
        assert not forwarder.state.index.keys.failed
    finally:
        forwarder.stop()
        runner.join(timeout=10)
        forwarder.close()
    assert not runner.is_alive()
    assert transport.queues["default"] == jobs
