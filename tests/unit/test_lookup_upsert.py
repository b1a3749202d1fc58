"""The lookup index upserts job rows many per statement, with the rows one per statement made.

``_upsert_jobs`` runs ``_UPSERT_JOB`` with up to 64 rows in one ``VALUES`` list (docs/benchmarks.md,
"The lookup index's rows many per statement"). SQLite inserts them in their order, each meeting
the rows before it as a statement of its own would: a requeue (a higher count) takes its id over,
the first record under an id keeps it against a later one with the same count.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hybridq.lookup import store


def _db(path: Path) -> sqlite3.Connection:
    db = store._connect(str(path))
    db.executescript(store._SCHEMA)
    return db


def _rows(n: int) -> list[tuple[Any, ...]]:
    """``n`` rows, every third id seen before: requeued, read again, or an older record after a newer."""
    rows: list[tuple[Any, ...]] = []
    for i in range(n):
        job = f"j{i // 3 if i % 3 else i}"
        requeue = (i * 7) % 3
        rows.append((job, "w", 0, 64 + i, i + 1, requeue, float(i), f"f{i}" if i % 5 else None, "q", job))
    return rows


@pytest.mark.parametrize("n", [0, 1, 3, 63, 64, 65, 130, 200])
def test_the_rows_are_those_one_statement_per_row_made(tmp_path: Path, n: int) -> None:
    new, old = _db(tmp_path / "new.sqlite"), _db(tmp_path / "old.sqlite")
    try:
        with new:
            new.executemany(store._UPSERT_JOB, [("j0", "w", 0, 1, 1, 1, 0.0, "f", "q", None)])
            store._upsert_jobs(new, _rows(n))
        with old:
            old.executemany(store._UPSERT_JOB, [("j0", "w", 0, 1, 1, 1, 0.0, "f", "q", None)])
            old.executemany(store._UPSERT_JOB, _rows(n))
        query = "SELECT * FROM jobs ORDER BY id"
        assert new.execute(query).fetchall() == old.execute(query).fetchall()
    finally:
        new.close()
        old.close()


def test_a_requeue_in_the_same_statement_takes_the_id_over(tmp_path: Path) -> None:
    db = _db(tmp_path / "index.sqlite")
    try:
        rows = [
            ("a", "w", 0, 64, 1, 0, 1.0, "f", "q", "a"),
            ("a", "w", 0, 128, 2, 1, 2.0, "f", "q", "a"),  # requeued: takes over
            ("a", "w", 0, 192, 3, 1, 3.0, "f", "q", "a"),  # the same count: the first keeps it
            ("b", "w", 0, 256, 4, 2, 4.0, "f", "q", "b"),
            ("b", "w", 0, 320, 5, 1, 5.0, "f", "q", "b"),  # an older record after a newer
        ]
        store._upsert_jobs(db, rows)
        assert db.execute("SELECT id, off, requeue FROM jobs ORDER BY id").fetchall() == [
            ("a", 128, 1),
            ("b", 256, 2),
        ]
    finally:
        db.close()


def test_a_statement_binds_no_more_than_the_oldest_sqlite_allows(tmp_path: Path) -> None:
    """SQLite before 3.32 binds at most 999 values a statement (docs/deploy.md supports 3.24)."""
    db = _db(tmp_path / "index.sqlite")
    try:
        db.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        with db:
            store._upsert_jobs(db, _rows(200))
        assert db.execute("SELECT count(*) FROM jobs").fetchone()[0] > 0
    finally:
        db.close()
