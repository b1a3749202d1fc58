"""The key table's integrity check runs beside the forwarder, not before its first push (issue 29).

A damaged table is still never trusted to say a key is not owned: every read of it waits for the
check's verdict (docs/reliability.md, "The key table"), and a damaged file is deleted and made
again from the ledger (the forwarder opens again, as a start does).
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import JournalIOError
from hybridq.ledger import filecheck
from hybridq.ledger.keytable import KEYS_TABLE_FILE, KeyTable
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder
from tests.unit.test_lookup_check import damage_a_page_of, finished_jobs


def keyed_jobs_run(journal: Path, n: int) -> list[str]:
    """``n`` keyed jobs run to their end, the forwarder closed (its table marked and saved)."""
    return finished_jobs(journal, n, keyed=True)


def damage_a_page(journal: Path) -> None:
    """Garbage over one page in the middle of the table: it still opens, a b-tree is broken."""
    damage_a_page_of(str(journal / KEYS_TABLE_FILE))


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> list[filecheck.FileCheck]:
    """The key table's checks, not started: each runs when the test says (``check._run()``)."""
    checks: list[filecheck.FileCheck] = []
    start = filecheck.FileCheck.start

    def held_back(self: filecheck.FileCheck) -> None:
        if self._thread.name == "hybridq-keys-check":
            checks.append(self)
        else:
            start(self)

    monkeypatch.setattr(filecheck.FileCheck, "start", held_back)
    return checks


def test_the_first_push_does_not_wait_for_the_check(
    journal_dir: Path, held: list[filecheck.FileCheck]
) -> None:
    # Fails before: the open ran PRAGMA quick_check itself (no check on a thread at all).
    keyed_jobs_run(journal_dir, 200)
    new = Queue(journal=journal_dir).enqueue(tasks.add, 7, 7)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    try:
        [check] = held
        assert forwarder.step() == 1  # pushed with no verdict on the table
        assert new.id in transport.deliveries
        assert check.verdict() is None
        assert forwarder.state.index.keys.checking
        check._run()
        forwarder.step()
        assert not forwarder.state.index.keys.checking  # the verdict taken: sound
    finally:
        forwarder.close()


def test_a_keyed_job_waits_for_the_verdict_and_its_duplicate_is_never_pushed(
    journal_dir: Path, held: list[filecheck.FileCheck]
) -> None:
    keyed_jobs_run(journal_dir, 200)
    dup = Queue(journal=journal_dir).enqueue(tasks.add, 0, 0, idempotency_key="k0")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    try:
        [check] = held
        timer = threading.Timer(0.2, check._run)  # the verdict comes while the step waits for it
        timer.start()
        assert forwarder.step() == 0
        timer.join()
        assert check.verdict() == ""
        assert dup.id not in transport.deliveries
        assert forwarder.admission.suppressed == 1  # recorded as k0's owner's duplicate
    finally:
        forwarder.close()


def test_a_damaged_table_found_after_the_start_is_made_again_from_the_ledger(
    journal_dir: Path, held: list[filecheck.FileCheck]
) -> None:
    keyed_jobs_run(journal_dir, 300)
    damage_a_page(journal_dir)
    queue = Queue(journal=journal_dir)
    new = queue.enqueue(tasks.add, 7, 7)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    try:
        [check] = held
        assert forwarder.step() == 1  # pushed before any verdict: it asked the table nothing
        assert new.id in transport.deliveries
        check._run()
        assert check.verdict()  # the damage
        dup = queue.enqueue(tasks.add, 1, 1, idempotency_key="k1")
        with pytest.raises(JournalIOError, match="damaged"):
            forwarder.step()  # the verdict taken at the step's start: nothing read from the table
        assert forwarder.state.index.keys.damaged
        with pytest.raises(JournalIOError, match="damaged"):
            forwarder.state.index.keys.get("k1")  # asked again (another thread): never answered
        assert not (journal_dir / KEYS_TABLE_FILE).exists()  # a crash now: the start makes it anew
        forwarder._reopen_due = True  # as run() sets it when the table is damaged
        forwarder._reopen()
        for _ in range(3):
            forwarder.step()
        assert dup.id not in transport.deliveries  # its owner found in the table made again
        assert len(forwarder.state.index.keys) == 300  # every owner, replayed from the ledger
    finally:
        forwarder.close()
    db = sqlite3.connect(str(journal_dir / KEYS_TABLE_FILE))
    assert db.execute("PRAGMA quick_check").fetchone() == ("ok",)
    db.close()


def test_the_loop_opens_again_when_the_check_finds_damage(
    journal_dir: Path, held: list[filecheck.FileCheck]
) -> None:
    keyed_jobs_run(journal_dir, 300)
    damage_a_page(journal_dir)
    dup = Queue(journal=journal_dir).enqueue(tasks.add, 2, 2, idempotency_key="k2")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    try:
        [check] = held
        check._run()
        runner = threading.Thread(target=forwarder.run)
        runner.start()
        threading.Timer(1.0, forwarder.stop).start()
        runner.join(30)
        assert not runner.is_alive()
        assert not forwarder.state.index.keys.damaged  # opened again: a new table
        assert dup.id not in transport.deliveries
        assert len(forwarder.state.index.keys) == 300
    finally:
        forwarder.close()


def test_no_mark_vouches_for_a_file_before_its_check_passed(
    tmp_path: Path, held: list[filecheck.FileCheck]
) -> None:
    path = str(tmp_path / KEYS_TABLE_FILE)
    KeyTable(path).close()
    table = KeyTable(path, deferred=True)
    [check] = held
    threading.Timer(0.1, check._run).start()
    table.mark()  # waits for the verdict
    assert not table.checking
    table.close()
