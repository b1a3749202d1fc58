"""The run table's insert of a batch: one statement for the batch, row by row when some were there.

``RunTable.add`` keeps the per-queue and per-priority counts (what a start reads instead of the
rows) and the rows a refusal put back true in each case: a batch all new, a batch read again
after a crash (some rows there already), and a batch whose insert fails part-way (docs/forwarder.md,
"The window"; docs/reliability.md, "The run table").
"""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest
from hybridq.errors import JournalIOError
from hybridq.forwarder.runs import Row, RunTable


def _rows(first: int, n: int, prio: int = 0) -> list[Row]:
    return [(("w", 0, 64 + 100 * i), "default", 1.0 + i, prio, "") for i in range(first, first + n)]


def _stored(runs: RunTable) -> dict[tuple[str, int], int]:
    got = runs.db.execute("SELECT queue, prio, count(*) FROM runs GROUP BY queue, prio").fetchall()
    return {(q, p): n for q, p, n in got}


def test_a_new_batch_is_counted_once_per_row(tmp_path: Path) -> None:
    runs = RunTable(str(tmp_path))
    runs.open()
    try:
        runs.add(_rows(0, 5) + _rows(5, 3, prio=2))
        assert runs.counts == {"default": 8}
        assert runs.prios == {"default": {0: 5, 2: 3}}
        assert _stored(runs) == {("default", 0): 5, ("default", 2): 3}
    finally:
        runs.close()


def test_a_batch_read_again_counts_only_its_new_rows_and_keeps_the_rows_put_back(tmp_path: Path) -> None:
    runs = RunTable(str(tmp_path))
    runs.open()
    try:
        runs.add(_rows(0, 4))
        runs.commit()
        # Rows 2..5: two there already (kept as they were), two new, one of them put back.
        again = _rows(2, 4)
        runs.add(again, [0, 0, 0, 3])
        assert runs.counts == {"default": 6}
        assert runs.prios == {"default": {0: 6}}
        assert runs.backs == {("w", 0, 64 + 100 * 5): 3}
        assert _stored(runs) == {("default", 0): 6}
        runs.commit()
        runs.rollback()  # the counts read back from the file: the same
        assert runs.counts == {"default": 6}
        assert runs.backs == {("w", 0, 64 + 100 * 5): 3}
    finally:
        runs.close()


def test_a_batch_that_fails_part_way_adds_none_of_its_rows(tmp_path: Path) -> None:
    runs = RunTable(str(tmp_path))
    runs.open()
    try:
        runs.add(_rows(0, 2))
        bad: list[Row] = [*_rows(2, 3), (("w", 0, 9999), "default", 1.0, 0, object())]  # type: ignore[list-item]
        with pytest.raises(JournalIOError):
            runs.add(bad)
        assert runs.counts == {"default": 2}
        assert _stored(runs) == {("default", 0): 2}
        runs.commit()  # what the failed call began is not committed with the rest
        runs.rollback()
        assert runs.counts == {"default": 2}
    finally:
        runs.close()


def _sqlite_full() -> sqlite3.OperationalError:
    """A real SQLITE_FULL error object (a page limit reached in a scratch database)."""
    scratch = sqlite3.connect(":memory:")
    scratch.execute("CREATE TABLE t (a)")
    scratch.execute("PRAGMA max_page_count = 2")
    try:
        scratch.executemany("INSERT INTO t VALUES (?)", [("a" * 4000,)] * 10)
    except sqlite3.OperationalError as full:
        return full
    raise AssertionError("no SQLITE_FULL")


class _Spilling:
    """A connection whose inserts meet a full disk that rolls back the whole transaction."""

    def __init__(self, real: sqlite3.Connection) -> None:
        self.real, self.full = real, _sqlite_full()

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def _full(self, *args: object) -> object:
        self.real.execute("ROLLBACK")  # what SQLite does when it must cancel the whole transaction
        raise self.full

    def execute(self, sql: str, *args: object) -> object:
        return self._full() if sql.startswith("INSERT") else self.real.execute(sql, *args)

    executemany = _full


@pytest.mark.parametrize("n", [1, 3])
def test_a_full_disk_that_rolls_back_the_whole_transaction_is_a_pause_not_a_stop(
    tmp_path: Path, n: int
) -> None:
    """SQLite may roll back the whole transaction on SQLITE_FULL (a failed spill of its cache):
    the batch's savepoint is gone with it, and the error must still read as a full disk (the
    forwarder pauses, docs/forwarder.md), not as "no such savepoint" (an I/O error: a stop)."""
    runs = RunTable(str(tmp_path))
    runs.open()
    real = runs.db
    runs._db = _Spilling(real)  # type: ignore[assignment]
    try:
        with pytest.raises(JournalIOError) as got:
            runs.add(_rows(0, n))
        assert got.value.errno == errno.ENOSPC, got.value
        assert runs.counts == {}
    finally:
        runs._db = real
        runs.close()


def test_after_a_full_disk_rolled_the_transaction_back_nothing_commits_without_its_counts(
    tmp_path: Path,
) -> None:
    """The forwarder pauses on a full disk and steps again without a rollback of its own (a
    refusal's rows put back, say): the run table must be inside a transaction again, with the
    counts the file has, or each later insert commits alone and a crash leaves rows no count
    names (never pushed: a start walks the counts)."""
    runs = RunTable(str(tmp_path))
    runs.open()
    real = runs.db
    try:
        runs._db = _Spilling(real)  # type: ignore[assignment]
        with pytest.raises(JournalIOError):
            runs.add(_rows(0, 2), [1, 1])
        runs._db = real
        assert real.in_transaction
        runs.add(_rows(10, 3))
        other = sqlite3.connect(str(tmp_path / "runs" / "runs.sqlite"))
        try:
            assert other.execute("SELECT count(*) FROM runs").fetchone() == (0,)  # not committed alone
            runs.commit()
            assert other.execute("SELECT count(*) FROM runs").fetchone() == (3,)
            assert other.execute("SELECT sum(n) FROM counts").fetchone() == (3,)
        finally:
            other.close()
    finally:
        runs._db = real
        runs.close()
