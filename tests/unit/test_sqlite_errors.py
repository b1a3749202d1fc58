"""Which errno a key-table error is reported with: ENOSPC for a full disk (a pause), else EIO.

(docs/operations.md "Disk full"; hybridq/ledger/sqlite_errors.py.)
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest
from hybridq.errors import JournalIOError
from hybridq.ledger import keytable, sqlite_errors
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.sqlite_errors import full_disk_errno, sqlite_errno


def _error(code: int) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError("an error")
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


def test_sqlite_full_is_enospc_and_damage_or_a_lock_is_eio(tmp_path: Path) -> None:
    assert sqlite_errno(_error(13), str(tmp_path)) == errno.ENOSPC  # SQLITE_FULL
    assert sqlite_errno(_error(13), None) == errno.ENOSPC
    assert sqlite_errno(_error(11), str(tmp_path)) == errno.EIO  # SQLITE_CORRUPT
    assert sqlite_errno(_error(5), str(tmp_path)) == errno.EIO  # SQLITE_BUSY
    assert sqlite_errno(sqlite3.OperationalError("no code"), str(tmp_path)) == errno.EIO


def test_an_io_error_is_what_the_probe_finds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ioerr_write = 10 | (3 << 8)
    assert sqlite_errno(_error(ioerr_write), str(tmp_path)) == errno.EIO  # space left
    assert sqlite_errno(_error(ioerr_write), None) == errno.EIO
    monkeypatch.setattr(sqlite_errors, "full_disk_errno", lambda directory: errno.EDQUOT)
    assert sqlite_errno(_error(ioerr_write), str(tmp_path)) == errno.EDQUOT


def test_the_probe_leaves_nothing_and_maps_only_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert full_disk_errno(str(tmp_path)) is None
    assert os.listdir(tmp_path) == []
    for code, expected in [(errno.EDQUOT, errno.EDQUOT), (errno.ENOSPC, errno.ENOSPC), (errno.EIO, None)]:

        def failing(fd: int, offset: int, length: int, code: int = code) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "posix_fallocate", failing)
        assert full_disk_errno(str(tmp_path)) == expected
        assert os.listdir(tmp_path) == []


class _Full:
    """The table's connection: every statement fails as SQLite does on a full disk."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        raise _error(13)

    def __getattr__(self, name: str) -> object:
        return getattr(self._db, name)


def test_a_full_disk_poisons_the_table_as_enospc_and_close_writes_nothing(tmp_path: Path) -> None:
    table = KeyTable.in_journal(str(tmp_path))
    real = table._db
    table._db = _Full(real)  # type: ignore[assignment]
    with pytest.raises(JournalIOError) as raised:
        len(table)
    assert raised.value.errno == errno.ENOSPC
    assert table.failed
    assert table.error is raised.value
    table._db = real
    table.close()  # no commit: a poisoned table's rows come back from the ledger


def test_a_full_disk_at_open_is_enospc_and_the_file_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    KeyTable.in_journal(str(tmp_path)).close()

    def full(self: KeyTable) -> sqlite3.Connection:
        raise _error(13)

    monkeypatch.setattr(KeyTable, "_connect", full)
    with pytest.raises(JournalIOError) as raised:
        KeyTable.in_journal(str(tmp_path))
    assert raised.value.errno == errno.ENOSPC
    assert (tmp_path / keytable.KEYS_TABLE_FILE).exists()  # not taken for damage


def test_a_damaged_table_made_again_on_a_full_disk_is_enospc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries = iter([sqlite3.DatabaseError("file is not a database"), _error(13)])

    def damaged_then_full(self: KeyTable) -> sqlite3.Connection:
        raise next(tries)

    monkeypatch.setattr(KeyTable, "_connect", damaged_then_full)
    with pytest.raises(JournalIOError) as raised:
        KeyTable.in_journal(str(tmp_path))
    assert raised.value.errno == errno.ENOSPC


def test_a_probe_that_cannot_be_removed_keeps_the_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review of dfull, item 6: a failing unlink must not replace the table's error."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def refused(path: str) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(os, "unlink", refused)
    assert full_disk_errno(str(tmp_path)) == errno.ENOSPC
    monkeypatch.undo()
    assert [name.startswith(".space-probe-") for name in os.listdir(tmp_path)] == [True]
    sqlite_errors.remove_probes(str(tmp_path))  # what the forwarder's open does
    assert os.listdir(tmp_path) == []
