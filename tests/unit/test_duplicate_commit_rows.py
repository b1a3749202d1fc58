"""The duplicates table past :data:`~hybridq.ledger.tablefile.COMMIT_ROWS` rows in one transaction.

A flush of the endings noted while duplicates are pending writes through the file's open
transaction; past COMMIT_ROWS rows that commits first, and a commit flushes the endings again:
before the fix, ``flush -> commit -> flush`` recursed until RecursionError, at 20,000 rows,
which a forwarder's full replay or any reader's ``load_index`` reaches with one pending
duplicate and 20,000 listed failures (docs/reliability.md, "Duplicates").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq.journal import JournalWriter
from hybridq.journal.reader import list_chains
from hybridq.ledger import keytable, tablefile
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KEYS_TABLE_FILE, KeyTable
from hybridq.ledger.saved_index import resume
from hybridq.ledger.store import load_index, open_ledger_writer

#: COMMIT_ROWS in these tests, and the rows written past it.
SMALL = 10
ROWS = 5 * SMALL


@pytest.fixture
def small_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tablefile, "COMMIT_ROWS", SMALL)
    monkeypatch.setattr(keytable, "COMMIT_ROWS", SMALL)


@pytest.mark.usefixtures("small_commits")
def test_a_flush_past_commit_rows_commits_once_and_does_not_recurse(tmp_path: Path) -> None:
    index = LedgerIndex(keys=KeyTable(str(tmp_path / KEYS_TABLE_FILE)))
    try:
        index.apply(Entry("duplicate", "d", ("w", 0, 32), key="k", dup_of="o", at=1.0))
        index.apply(Entry("done", "x", ("w", 0, 40), outcome="succeeded", at=1.5))  # noted
        for i in range(ROWS):  # listed failures: rows of the same transaction
            index.apply(Entry("done", f"f{i}", ("w", 1, 32 + i), outcome="failed", at=2.0))
        index.apply(Entry("done", "d", ("w", 0, 32), outcome="succeeded", dup=True, dup_of="o", at=3.0))
        assert len(index.duplicates) == 0
        assert len(index.failed) == ROWS
        index.keys.commit()
    finally:
        index.keys.close()


def _ledger(tmp_path: Path, failures: int, duplicates: int) -> str:
    """A journal whose ledger holds a pending owner's key, duplicates of it (one settled) and failures."""
    journal = str(tmp_path / "journal")
    with JournalWriter(journal) as jw:
        jw.append_many([b'{"x": 1}'])
    [writer] = list_chains(journal)
    entries = [Entry("key", "o", (writer, 0, 1), key="k", at=0.5, queue="q")]
    entries += [
        Entry("duplicate", f"d{i}", (writer, 0, 100 + i), key="k", dup_of="o", at=1.0, queue="q")
        for i in range(duplicates)
    ]
    entries.append(Entry("done", "d0", (writer, 0, 100), outcome="succeeded", dup=True, dup_of="o", at=2.0))
    entries += [
        Entry("done", f"f{i}", (writer, 1, 32 + i), outcome="failed", at=2.0, queue="q")
        for i in range(failures)
    ]
    ledger = open_ledger_writer(journal)
    ledger.append_many(e.to_bytes() for e in entries)
    ledger.close()
    return journal


@pytest.mark.usefixtures("small_commits")
@pytest.mark.parametrize(("failures", "duplicates"), [(ROWS, 2), (0, ROWS)])
def test_readers_and_a_full_replay_past_commit_rows(tmp_path: Path, failures: int, duplicates: int) -> None:
    """Fails before (RecursionError): every reader (``load_index``) and the forwarder's start."""
    journal = _ledger(tmp_path, failures, duplicates)
    for keys in (False, True):
        index = load_index(journal, Compacted(), keys=keys)
        assert (len(index.duplicates), len(index.failed)) == (duplicates - 1, failures)
    index, _, replayed = resume(journal, Compacted(), KeyTable.in_journal(journal))
    try:
        assert replayed == 0  # no saved index: the whole ledger replayed into the table on disk
        assert (len(index.duplicates), len(index.failed)) == (duplicates - 1, failures)
    finally:
        index.keys.close()
