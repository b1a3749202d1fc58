"""The lookup index's integrity check runs beside the forwarder, not before its first push (issue 29).

A damaged index is still never trusted: the forwarder concludes nothing from it until the check's
verdict, and a damaged file is replaced and rebuilt from the journal and the ledger.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from hybridq import Queue, fetch_job
from hybridq.lookup import check as check_module
from hybridq.lookup import index as index_module
from hybridq.lookup.reads import index_path
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder
from tests.unit.test_lookup import add


def finished_jobs(journal: Path, n: int, *, keyed: bool = False) -> list[str]:
    """``n`` jobs run to their end, their index written and the forwarder closed.

    ``keyed``: each with the idempotency key ``k<i>`` (the key table's tests).
    """
    queue = Queue(journal=journal)
    ids = [queue.enqueue(tasks.add, i, i, idempotency_key=f"k{i}" if keyed else None).id for i in range(n)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal, transport)
    forwarder.step()
    transport.work(func=add)
    for _ in range(3):
        forwarder.step()
    forwarder.close()
    return ids


def damage_a_page(journal: Path) -> None:
    """Garbage over one page in the middle of the index: it still opens, its b-tree is broken."""
    damage_a_page_of(index_path(str(journal)))


def damage_a_page_of(path: str) -> None:
    """Garbage over one page in the middle of the SQLite file at ``path`` (it still opens)."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size, pages = (
        db.execute("PRAGMA page_size").fetchone()[0],
        db.execute("PRAGMA page_count").fetchone()[0],
    )
    db.close()
    assert pages > 4
    with open(path, "r+b") as f:
        f.seek(page_size * (pages // 2))
        f.write(b"\xa5" * page_size)


def test_open_runs_no_integrity_check_on_the_forwarders_thread(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails before: LookupIndex.open ran PRAGMA quick_check (a read of the whole file) itself.
    finished_jobs(journal_dir, 5)
    seen: list[tuple[int, str]] = []
    connect = index_module._connect

    def traced(path: str) -> sqlite3.Connection:
        db = connect(path)
        db.set_trace_callback(lambda sql: seen.append((threading.get_ident(), sql)))
        return db

    monkeypatch.setattr(index_module, "_connect", traced)
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    assert forwarder.step() == 1
    forwarder.close()
    me = threading.get_ident()
    assert not [sql for thread, sql in seen if thread == me and "quick_check" in sql.lower()]


def test_a_damaged_index_found_after_the_first_push_is_rebuilt_and_never_trusted_before(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = finished_jobs(journal_dir, 300)
    damage_a_page(journal_dir)
    checks: list[check_module.IndexCheck] = []

    def held_back(self: check_module.IndexCheck) -> None:
        checks.append(self)

    monkeypatch.setattr(check_module.IndexCheck, "start", held_back)
    new = Queue(journal=journal_dir).enqueue(tasks.add, 7, 7)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    assert forwarder.step() == 1  # pushed before any verdict on the index
    assert new.id in transport.deliveries
    for _ in range(3):
        forwarder.step()
    assert forwarder.lookup.building  # no verdict yet: nothing concluded from the index
    [check] = checks
    check._run()  # the check, now: it reports the damage
    assert check.verdict()
    forwarder.step()  # the verdict taken: the file replaced, then read from the files again
    for _ in range(5):
        forwarder.step()
    assert not forwarder.lookup.building
    transport.work(func=add)
    for _ in range(3):
        forwarder.step()
    forwarder.close()
    db = sqlite3.connect(index_path(str(journal_dir)))
    assert db.execute("PRAGMA quick_check").fetchone() == ("ok",)
    assert db.execute("SELECT count(*) FROM jobs").fetchone() == (301,)
    db.close()
    for job_id, result in [(ids[0], 0), (ids[-1], 2 * 299), (new.id, 14)]:
        found = fetch_job(job_id, journal=journal_dir)
        assert found is not None
        assert (found.status, found.result) == ("finished", result)


def test_a_sound_index_is_trusted_once_its_check_passes(journal_dir: Path) -> None:
    finished_jobs(journal_dir, 5)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    check = forwarder.lookup._check
    assert check is not None
    assert check.wait(10.0) == ""
    for _ in range(3):
        forwarder.step()
    assert not forwarder.lookup.building
    forwarder.close()


def test_closing_stops_a_check_in_flight(journal_dir: Path) -> None:
    finished_jobs(journal_dir, 5)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    check = forwarder.lookup._check
    forwarder.close()
    assert check is not None
    assert check.wait(10.0) is not None  # its thread ended with the close


def test_a_replacement_that_fails_is_tried_again(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = finished_jobs(journal_dir, 300)
    damage_a_page(journal_dir)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    check = forwarder.lookup._check
    assert check is not None
    assert check.wait(10.0)  # the damage found
    connect = index_module._connect
    calls: list[str] = []

    def full_disk(path: str) -> sqlite3.Connection:
        calls.append(path)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return connect(path)

    monkeypatch.setattr(index_module, "_connect", full_disk)
    assert forwarder.lookup.catch_up() == 0  # the replacement fails: logged, not raised
    assert forwarder.lookup.building  # nothing trusted meanwhile
    for _ in range(5):
        forwarder.step()  # tried again, then read from the files
    assert len(calls) == 2
    assert not forwarder.lookup.building
    forwarder.close()
    found = fetch_job(ids[5], journal=journal_dir)
    assert found is not None
    assert (found.status, found.result) == ("finished", 10)
