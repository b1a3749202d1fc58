"""The key table's check beside the start, when it meets odd paths and errors (review of issue 29).

Its verdict is about the file at the journal's path, whatever characters the path holds; only
SQLite's "corrupt" and "not a database" count as damage (a sound table is never deleted); a
reopen after a damaged verdict that fails is an error as any other: a full disk pauses, anything
else stops (docs/reliability.md, the key table and rule 6).
"""

from __future__ import annotations

import errno
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import JournalIOError
from hybridq.ledger import filecheck, saved_index
from hybridq.ledger.keytable import KEYS_TABLE_FILE, KeyTable
from hybridq.lookup.check import IndexCheck
from hybridq.lookup.reads import index_path
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder
from tests.unit.test_key_table_check import damage_a_page, held, keyed_jobs_run  # noqa: F401
from tests.unit.test_lookup import add
from tests.unit.test_lookup_check import damage_a_page as damage_an_index_page

ODD_NAMES = ["q#1", "q?x", "a%20b"]


def read_every_key(table: KeyTable, n: int) -> None:
    for i in range(n):
        assert table.get(f"k{i}") is not None


def checked(check: filecheck.FileCheck) -> str | None:
    check.start()
    return check.wait(30)


@pytest.mark.parametrize("name", ODD_NAMES)
def test_the_check_reads_the_journals_own_files_whatever_its_path_holds(tmp_path: Path, name: str) -> None:
    # Fails before: the raw path went into a URI, "#" and "?" cut it (an empty file checked
    # beside the journal: "ok"), "%20" was decoded (cannot open: counted as damage).
    journal = tmp_path / name / "journal"
    journal.parent.mkdir()
    keyed_jobs_run(journal, 300)
    keys, index = str(journal / KEYS_TABLE_FILE), index_path(str(journal))
    sound = filecheck.FileCheck(keys)
    assert checked(sound) == ""
    assert sound.error is None
    assert checked(IndexCheck(index)) == ""
    damage_a_page(journal)
    damage_an_index_page(journal)
    assert checked(filecheck.FileCheck(keys))
    assert checked(IndexCheck(index))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing made beside it


@pytest.mark.parametrize("name", ODD_NAMES)
def test_a_damaged_key_table_under_an_odd_path_is_never_trusted(tmp_path: Path, name: str) -> None:
    journal = tmp_path / name / "journal"
    journal.parent.mkdir()
    keyed_jobs_run(journal, 300)
    damage_a_page(journal)
    table = KeyTable.in_journal(str(journal))  # found damaged at open, or by the first read
    try:
        with pytest.raises(JournalIOError, match="damaged"):
            read_every_key(table, 300)
        assert table.damaged
    finally:
        table.discard()


def test_a_check_that_cannot_run_is_no_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filecheck, "RETRY_PAUSE", 0.0)
    check = filecheck.FileCheck(str(tmp_path / "missing.sqlite"))  # cannot open: not damage
    assert checked(check) == ""
    assert isinstance(check.error, sqlite3.OperationalError)
    assert not (tmp_path / "missing.sqlite").exists()


def test_a_check_that_dies_leaves_no_reader_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fails before (second review, L1): anything but an SQLite error skipped the verdict, and
    # every read of the table waited for it forever.
    def dies(self: filecheck.FileCheck) -> str:
        raise MemoryError

    monkeypatch.setattr(filecheck.FileCheck, "_check", dies)
    check = filecheck.FileCheck(str(tmp_path / "any.sqlite"))
    check.start()
    assert check._finished.wait(5.0)
    assert isinstance(check.error, sqlite3.OperationalError)
    assert "MemoryError" in str(check.error)


def test_a_key_table_whose_check_cannot_run_is_kept_and_refuses_reads(
    journal_dir: Path,
    held: list[filecheck.FileCheck],  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fails before: any error of the check (here "database is locked" each try) counted as
    # damage: the sound table was deleted and the whole ledger replayed at every start.
    keyed_jobs_run(journal_dir, 200)
    monkeypatch.setattr(filecheck, "RETRY_PAUSE", 0.0)
    tries = []

    def locked(self: filecheck.FileCheck) -> str:
        tries.append(1)
        raise sqlite3.OperationalError("database is locked")

    table = KeyTable.in_journal(str(journal_dir))
    try:
        [check] = held
        monkeypatch.setattr(filecheck.FileCheck, "_check", locked)
        check._run()
        assert len(tries) == filecheck.TRIES  # tried again before giving up
        with pytest.raises(JournalIOError, match="not checked") as caught:
            table.get("k1")
        assert caught.value.errno == errno.EIO  # an error of the table: the forwarder stops
        assert not table.damaged
        assert table.failed
        with pytest.raises(JournalIOError, match="not checked"):
            table.get("k1")  # every later read too
        assert (journal_dir / KEYS_TABLE_FILE).exists()  # never deleted
    finally:
        table.discard()


def _run_with_failing_reopen(journal_dir: Path, code: int, monkeypatch: pytest.MonkeyPatch):
    keyed_jobs_run(journal_dir, 300)
    damage_a_page(journal_dir)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    forwarder.state.index.keys._check.wait(30)
    tries: list[int] = []
    pauses: list[float] = []

    def failing(self: object) -> None:
        tries.append(1)
        raise OSError(code, "the reopen fails")

    monkeypatch.setattr(type(forwarder), "_open_parts", failing)

    def pause(self: object, seconds: float) -> None:
        pauses.append(seconds)
        time.sleep(0.01)  # the backoff recorded, not waited for

    monkeypatch.setattr(type(forwarder), "_sleep", pause)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            forwarder.run()
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    runner.join(1.0)
    forwarder.stop()
    runner.join(30)
    assert not runner.is_alive()
    monkeypatch.undo()
    forwarder.close()
    return tries, pauses, raised


def test_a_reopen_after_damage_that_fails_with_eio_stops(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails before: the damaged table sent every error back to the reopen, at once (~700 a second).
    tries, _, raised = _run_with_failing_reopen(journal_dir, errno.EIO, monkeypatch)
    assert len(tries) == 1
    [error] = raised
    assert getattr(error, "errno", None) == errno.EIO


def test_a_reopen_after_damage_that_fails_on_a_full_disk_pauses(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries, pauses, raised = _run_with_failing_reopen(journal_dir, errno.ENOSPC, monkeypatch)
    assert not raised
    assert pauses
    assert len(tries) <= len(pauses) + 1  # each failed try waits first
    assert pauses[-1] > pauses[0]  # the disk-full backoff


def test_damage_met_by_the_starts_replay_rebuilds_the_table(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails before: the replay after the saved index wrote into the damaged table, its verdict
    # deleted it and the start failed (EIO); main replayed the whole ledger into a new one.
    keyed_jobs_run(journal_dir, 300)
    with monkeypatch.context() as m:  # 300 more finish, no index saved (as a crash leaves it)
        m.setattr(saved_index.IndexSaver, "save", lambda self, index, compacted: None)
        queue = Queue(journal=journal_dir)
        for i in range(300, 600):
            queue.enqueue(tasks.add, i, i, idempotency_key=f"k{i}")
        transport = MemoryTransport()
        forwarder = make_forwarder(journal_dir, transport)
        forwarder.step()
        transport.work(func=add)
        for _ in range(3):
            forwarder.step()
        forwarder.close()
    damage_a_page(journal_dir)
    dup = Queue(journal=journal_dir).enqueue(tasks.add, 0, 0, idempotency_key="k5")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    try:
        for _ in range(3):
            forwarder.step()
        assert not forwarder.state.index.keys.damaged
        assert len(forwarder.state.index.keys) == 600
        assert dup.id not in transport.deliveries
    finally:
        forwarder.close()


def test_the_check_wakes_the_forwarder_with_its_verdict(
    journal_dir: Path,
    held: list[filecheck.FileCheck],  # noqa: F811 - the fixture
) -> None:
    # Fails before: the key table's check had no wake-up; an idle forwarder took a damaged
    # verdict only at its next step (a nudge or its poll).
    keyed_jobs_run(journal_dir, 200)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    try:
        [check] = held
        assert forwarder.state.index.keys.on_checked == forwarder.waits.wake
        woken = threading.Event()
        forwarder.state.index.keys.on_checked = woken.set
        check._run()
        assert woken.is_set()
    finally:
        forwarder.close()


def _run_keyed(journal: Path, queue: Queue, lo: int, hi: int) -> None:
    """Jobs ``lo..hi`` with keys through a forwarder, 4 KiB segments (job 0: delayed, it pins them)."""
    from hybridq.forwarder.loop import Forwarder
    from hybridq.journal import JournalWriter

    with JournalWriter(str(journal), max_segment_bytes=4096) as writer:
        if lo == 0:
            writer.append_many(
                [queue.prepare(tasks.add, (0, 0), delay=600, idempotency_key="pin").to_bytes()]
            )
            lo = 1
        for s in range(lo, hi, 10):
            writer.append_many(
                queue.prepare(tasks.add, (i, i), idempotency_key=f"k{i}").to_bytes()
                for i in range(s, min(s + 10, hi))
            )
    transport = MemoryTransport()
    forwarder = Forwarder(str(journal), transport, reconcile_interval_s=0.0, lease_s=0.0, max_lost=100)
    forwarder.open()
    forwarder.step()
    for _ in range(40):
        transport.work(limit=10)
        forwarder.completions.hurry()
        forwarder.completions.compactor.hurry()
        forwarder.step()
    forwarder.close()


def test_the_starts_rebuild_after_damage_applies_the_punched_ranges_to_the_index_it_keeps(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The review of the merged stop (L1): the start's retry after damage met by its replay
    # (forwarder/state.py) and the punched ranges applied after it, together: the index kept
    # is the full replay's with the hole maps applied, and nothing finished is pushed again.
    from hybridq.forwarder.loop import Forwarder
    from hybridq.journal.holes import HOLES_SUFFIX
    from hybridq.ledger.compacted import load_compacted
    from hybridq.ledger.punched_maps import collapse_punched
    from hybridq.ledger.store import load_index

    monkeypatch.setattr(saved_index, "SAVE_EVERY", 7)
    queue = Queue(journal=str(journal_dir))
    _run_keyed(journal_dir, queue, 0, 300)
    monkeypatch.setattr(saved_index.IndexSaver, "save", lambda self, index, compacted: None)
    _run_keyed(journal_dir, queue, 300, 600)  # finished after the last save: replayed at the start
    monkeypatch.undo()
    assert any(HOLES_SUFFIX in p.name for p in journal_dir.iterdir())  # segments were punched
    damage_a_page(journal_dir)
    compacted = load_compacted(str(journal_dir))
    replayed = load_index(str(journal_dir), compacted)
    collapse_punched(str(journal_dir), replayed, compacted)
    transport = MemoryTransport()
    forwarder = Forwarder(str(journal_dir), transport, reconcile_interval_s=0.0, lease_s=0.0, max_lost=100)
    forwarder.open()
    try:
        index = forwarder.state.index
        assert sum(bool(d.punched()) for d in index.terminal.values()) > 0
        assert {s: d.punched() for s, d in index.terminal.items()} == {
            s: d.punched() for s, d in replayed.terminal.items()
        }
        assert index.terminal_count == replayed.terminal_count
        assert dict(index.totals) == dict(replayed.totals)
        forwarder.step()
        assert len(transport.deliveries) == 0  # every job but the delayed one finished: none again
        assert not index.keys.damaged
    finally:
        forwarder.close()
