"""The forwarder's reopen after a full disk poisoned its key table (hybridq/forwarder/lifecycle.py).

docs/operations.md "Disk full": the run closes everything and opens again as a start does, the
lock kept. Here: it never writes into a directory swapped in at the journal's path; /metrics
never reads zeros while it builds the new parts, and reads the old parts' figures while the
reopen keeps failing; another forwarder is refused during the pause; an error other than a full
disk during a reopen stops the run and its close releases the lock; and jobs that finish while a
reopen is due are neither lost nor run twice (the review of dfull, items 1, 2, 5 and 8).
"""

from __future__ import annotations

import errno
import os
import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.errors import JournalIOError, JournalLocked, JournalPathError
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger import keytable, saved_index
from hybridq.producer.queue import _close_writers
from hybridq.testing.memory import MemoryTransport

from tests import tasks
from tests.unit.test_forwarder_key_table_errors import run_until_it_raises


def _refused(code: int) -> Any:
    """A ``KeyTable.in_journal`` that fails as a disk that is full (ENOSPC) or broken (EIO) does."""

    def in_journal(cls: type, journal: str) -> keytable.KeyTable:
        raise JournalIOError(keytable.KEYS_TABLE_FILE, "the key table", OSError(code, os.strerror(code)))

    return classmethod(in_journal)


class _FullAt:
    """The key table's connection: its ``nth`` write meets SQLITE_FULL, rolled back as SQLite may."""

    def __init__(self, db: sqlite3.Connection, nth: int) -> None:
        self._db, self._writes, self._nth = db, 0, nth

    def _check(self, sql: str) -> None:
        if sql.lstrip().upper().startswith(("INSERT", "DELETE", "COMMIT", "UPDATE")):
            self._writes += 1
            if self._writes == self._nth:
                if self._db.in_transaction:
                    self._db.rollback()
                exc = sqlite3.OperationalError("database or disk is full")
                exc.sqlite_errorcode = 13  # type: ignore[attr-defined]
                raise exc

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self._db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self._db.executemany(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _opened(journal: Path, jobs: int = 20) -> tuple[Forwarder, MemoryTransport]:
    queue = Queue(journal=journal)
    for i in range(jobs):
        queue.enqueue(tasks.add, i, i, idempotency_key=f"k{i}")
    _close_writers()
    transport = MemoryTransport()
    forwarder = Forwarder(journal, transport, idle_timeout_s=0.05)
    forwarder.open()
    forwarder.step()
    return forwarder, transport


def test_a_reopen_never_writes_into_a_directory_swapped_in_at_the_journal_path(tmp_path: Path) -> None:
    journal, other = tmp_path / "journal", tmp_path / "other"
    forwarder, _ = _opened(journal, jobs=1)
    try:
        forwarder._reopen_due = True  # as run() sets it after a full disk poisoned the table
        other.mkdir(mode=0o700)
        journal.rename(tmp_path / "journal.old")
        other.rename(journal)  # the path now leads to another (empty) directory
        with pytest.raises(JournalPathError):
            forwarder._reopen()
        assert sorted(os.listdir(journal)) == []
    finally:
        forwarder.close()


def test_close_never_writes_into_a_directory_swapped_in_at_the_journal_path(tmp_path: Path) -> None:
    # A step stops on JournalPathError; the close after it must not write its caches (the saved
    # index, the pending count) by path into whatever directory is there now.
    journal, other = tmp_path / "journal", tmp_path / "other"
    forwarder, _ = _opened(journal, jobs=3)
    other.mkdir(mode=0o700)
    journal.rename(tmp_path / "journal.old")
    other.rename(journal)
    with pytest.raises(JournalPathError):
        forwarder.step()
    forwarder.close()
    assert sorted(os.listdir(journal)) == []
    forwarder.close()  # idempotent: a second close (after the lock's release) writes nothing either
    assert [str(p.relative_to(journal)) for p in journal.rglob("*")] == []


def test_a_scrape_during_reopens_never_reads_zeros(tmp_path: Path) -> None:
    forwarder, _ = _opened(tmp_path / "journal")
    forwarded = forwarder.checkpoint.forwarded
    assert forwarded == 20
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def scrape() -> None:  # what ForwarderMetrics.collect reads, from the HTTP thread
        while not done.is_set():
            seen.append((forwarder.checkpoint.forwarded, len(forwarder.backlog.figures()[0])))
            time.sleep(0)  # lets the reopen run (the scraper would hold the interpreter's lock)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        for _ in range(20):
            forwarder._reopen()
    finally:
        done.set()
        scraper.join(timeout=10)
        forwarder.close()
    assert seen
    assert [s for s in seen if s[0] != forwarded] == []


def test_while_the_reopen_fails_the_gauges_are_the_old_parts_and_a_second_forwarder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = tmp_path / "journal"
    forwarder, transport = _opened(journal)
    before = forwarder.backlog.figures()
    assert before[0], "no window figures to keep"
    try:
        with monkeypatch.context() as full:
            full.setattr(keytable.KeyTable, "in_journal", _refused(errno.ENOSPC))
            for _ in range(3):  # the pause's retries
                with pytest.raises(JournalIOError) as raised:
                    forwarder._reopen()
                assert raised.value.errno == errno.ENOSPC
            assert forwarder.backlog.figures() == before
            assert forwarder.checkpoint.forwarded == 20
            with pytest.raises(JournalLocked):
                Forwarder(journal, MemoryTransport()).open()
        forwarder._reopen()  # space is back
        forwarder.step()
    finally:
        forwarder.close()
    assert len(transport.queues["default"]) == 20
    with Forwarder(journal, MemoryTransport()):  # the lock was released
        pass


def test_an_io_error_during_a_reopen_stops_the_run_and_close_releases_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = tmp_path / "journal"
    forwarder, _ = _opened(journal, jobs=1)
    keys = forwarder.state.index.keys
    keys._db = _FullAt(keys._db, 1)  # type: ignore[assignment]
    monkeypatch.setattr(keytable.KeyTable, "in_journal", _refused(errno.EIO))
    Queue(journal=journal).enqueue(tasks.add, 2, 2, idempotency_key="new")
    _close_writers()
    raised, _ = run_until_it_raises(forwarder)  # a full disk pauses, the reopen meets EIO: it raises
    forwarder.close()
    assert len(raised) == 1, raised
    assert isinstance(raised[0], JournalIOError)
    assert raised[0].errno == errno.EIO
    assert forwarder.stats.disk_full_retries == 1
    monkeypatch.undo()
    with Forwarder(journal, MemoryTransport()):  # the lock was released
        pass


def _crossing(journal: Path, nth: int, seed: int) -> tuple[int, list[str], list[str]]:
    """Keyed jobs (duplicates among them) worked between steps while the key table's ``nth`` write fails."""
    rnd = random.Random(seed)
    queue = Queue(journal=journal)
    transport = MemoryTransport()
    forwarder = Forwarder(journal, transport, idle_timeout_s=0.01)
    forwarder.open()
    keys = forwarder.state.index.keys
    keys._db = _FullAt(keys._db, nth)  # type: ignore[assignment]
    owners: dict[str, str] = {}
    duplicates: list[str] = []
    reopened = 0
    try:
        for _ in range(8):
            for _ in range(rnd.randint(1, 4)):
                key = f"k{rnd.randint(0, 5)}"
                job = queue.enqueue(tasks.add, 1, 1, idempotency_key=key).id
                (duplicates.append(job) if key in owners else owners.setdefault(key, job))
            _close_writers()
            for _ in range(3):  # run()'s loop, its sleeps left out
                try:
                    if forwarder._reopen_due:
                        forwarder._reopen()
                        reopened += 1
                    forwarder.step()
                    break
                except JournalIOError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    forwarder._reopen_due = forwarder._reopen_due or forwarder.state.index.keys.failed
            if rnd.random() < 0.6:
                transport.work()  # finished jobs: their outcomes are harvested across the reopen
        for _ in range(3):
            forwarder.step()
            transport.work()
    finally:
        forwarder.close()
    ran = transport.executions
    return (
        reopened,
        [key for key, job in owners.items() if ran.get(job) != 1],
        [job for job in duplicates if ran.get(job)],
    )


@pytest.mark.parametrize("save_every", [1, 3])
def test_finished_jobs_crossing_a_reopen_run_once_and_a_duplicate_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save_every: int
) -> None:
    monkeypatch.setattr(saved_index, "SAVE_EVERY", save_every)
    reopens = 0
    for seed in range(2):
        for nth in (1, 2, 3, 5, 8):
            reopened, not_once, duplicates_ran = _crossing(tmp_path / f"j{seed}-{nth}", nth, seed)
            reopens += reopened
            assert not_once == [], (seed, nth)
            assert duplicates_ran == [], (seed, nth)
    assert reopens >= 8  # the faults did reach the table


def test_a_probe_left_by_a_kill_is_removed_at_open(tmp_path: Path) -> None:
    """A SIGKILL between the probe's create and its unlink leaves 64 KB (the review of dfull, item 6)."""
    journal = tmp_path / "journal"
    journal.mkdir(mode=0o700)
    (journal / ".space-probe-0123abcd").write_bytes(b"\0" * 65536)
    (journal / "space-probe-not-ours").write_bytes(b"")
    with Forwarder(journal, MemoryTransport()):
        assert not (journal / ".space-probe-0123abcd").exists()
    assert (journal / "space-probe-not-ours").exists()


def test_a_full_disk_at_the_start_pauses_and_opens_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``hybridq forward``'s start (the review of dfull, item 4): it exited 1 for its supervisor."""
    journal = tmp_path / "journal"
    _opened(journal)[0].close()
    real = keytable.KeyTable.in_journal
    tries: list[int] = []

    def full_twice(cls: type, journal: str) -> keytable.KeyTable:
        tries.append(1)
        if len(tries) <= 2:
            raise JournalIOError(keytable.KEYS_TABLE_FILE, "the key table", OSError(errno.ENOSPC, "full"))
        return real(journal)

    monkeypatch.setattr(keytable.KeyTable, "in_journal", classmethod(full_twice))
    slept: list[float] = []
    transport = MemoryTransport()
    forwarder = Forwarder(journal, transport)
    timed: list[float] = []
    forwarder.on_durable_write = timed.append  # kept by each try's new parts
    forwarder.open_waiting_for_space(sleep=slept.append)
    assert forwarder.on_durable_write == timed.append
    try:
        forwarder.step()
    finally:
        forwarder.close()
    assert (len(tries), len(slept), forwarder.stats.disk_full_retries) == (3, 2, 2)
    assert caplog.text.count("forwarding paused") == 1
    monkeypatch.setattr(keytable.KeyTable, "in_journal", _refused(errno.EIO))
    with pytest.raises(JournalIOError) as raised:  # anything else: at once, the lock released
        Forwarder(journal, MemoryTransport()).open_waiting_for_space(sleep=slept.append)
    assert raised.value.errno == errno.EIO
    assert len(slept) == 2
    monkeypatch.undo()
    with Forwarder(journal, MemoryTransport()):
        pass


def test_stop_ends_the_wait_of_a_full_disk_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stop()`` from another thread ends ``open_waiting_for_space`` (the review of its fix: a
    library caller's stop was ignored, the retries went on)."""
    journal = tmp_path / "journal"
    _opened(journal)[0].close()
    monkeypatch.setattr(keytable.KeyTable, "in_journal", _refused(errno.ENOSPC))
    forwarder = Forwarder(journal, MemoryTransport())
    threading.Timer(0.3, forwarder.stop).start()
    started = time.monotonic()
    with pytest.raises(JournalIOError) as raised:
        forwarder.open_waiting_for_space()
    assert raised.value.errno == errno.ENOSPC
    assert time.monotonic() - started < 5.0
    monkeypatch.undo()
    with Forwarder(journal, MemoryTransport()):  # the lock was let go
        pass
