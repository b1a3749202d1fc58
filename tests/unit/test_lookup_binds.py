"""The lookup index binds a done row's values as plain str, int and float, and no None.

sqlite3 binds exact str, int, float and bytearray directly; anything else (None, a str subclass
such as an ``Outcome``) goes through its adapter lookup, which fails with an exception formatted
and cleared: about 3k instructions a value, three Nones a succeeded job (its error, its result's
size, the original of a duplicate: docs/benchmarks.md, "Fewer writes per job"). The NULLs are
written in the statement instead; the rows are the same (fails before: 3 lookups, 4 with an
``Outcome``). So are an outcome of the protocol's, a result ``null`` and ``rkept`` (a text bound
is copied: docs/benchmarks.md, "The lookup index's rows many per statement"); any other outcome
is bound (one with a quote in the cases below).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hybridq.envelope.codec import dumps_ascii
from hybridq.ledger.entries import Entry
from hybridq.lookup import store
from hybridq.lookup.reads import sql_text
from hybridq.protocol import Outcome

LOC = ("w", 0, 64)


def _db(path: Path) -> sqlite3.Connection:
    db = store._connect(str(path))
    db.executescript(store._SCHEMA)
    db.execute(store._UPSERT_JOB, ("j1", *LOC, 1, 0, 1.0, "f", "q", None))
    return db


def test_a_succeeded_entry_binds_no_none_and_no_outcome_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = _db(tmp_path / "index.sqlite")  # (its job row binds a None: the key it has not)
    looked: list[object] = []
    for kind in (Outcome, type(None)):
        monkeypatch.setitem(
            sqlite3.adapters, (kind, sqlite3.PrepareProtocol), lambda o: looked.append(o) or o
        )
    try:
        done = Entry("done", "j1", LOC, outcome=Outcome.SUCCEEDED, at=2.0, started=1.5, result_kept=True)
        store._apply(db, [done])
        assert db.execute("SELECT state, outcome, result, rkept FROM jobs").fetchall() == [
            ("done", "succeeded", "null", 1)
        ]
        assert looked == []
    finally:
        db.close()


#: The done statement as it was: every value bound, None included, and the outcome and its
#: result's ``rkept`` bound again for the conditions (not named by number: ``?1``).
_OLD_DONE = """
UPDATE jobs SET state = 'done', outcome = ?, attempt = max(attempt, ?),
    started = coalesce(?, started), ended = ?, result = ?, rkept = ?,
    rbytes = ?, error = ?, dup_of = coalesce(?, dup_of)
WHERE id = ? AND writer = ? AND seg = ? AND off = ? AND (state IS NOT 'done'
    OR (outcome = 'failed' AND ? = 'succeeded')
    OR (outcome = 'cancelled' AND ? IN ('succeeded', 'failed'))
    OR (outcome = 'succeeded' AND rkept = 0 AND rbytes IS NULL AND ? = 'succeeded' AND ? = 1))
"""


def _old_apply(db: sqlite3.Connection, entries: list[Entry]) -> None:
    """The done statement as it was: every value bound, None included."""
    sql = _OLD_DONE
    for e in entries:
        outcome = e.outcome or "failed"
        result = dumps_ascii(e.result) if e.result_kept else None
        row: tuple[Any, ...] = (
            outcome, max(0, e.attempt - e.later), e.started, e.at, result, int(e.result_kept),
            e.result_bytes, sql_text(e.error), e.dup_of, e.job_id, *e.loc,
            outcome, outcome, outcome, int(e.result_kept),
        )  # fmt: skip
        db.execute(sql, row)


@pytest.mark.parametrize(
    "entries",
    [
        [Entry("done", "j1", LOC, outcome="succeeded", at=2.0, started=1.0, result_kept=True, result=[1])],
        [Entry("done", "j1", LOC, outcome="failed", at=2.0, error="boom"),
         Entry("done", "j1", LOC, outcome="succeeded", at=3.0, result_bytes=99)],
        [Entry("done", "j1", LOC, outcome="failed", at=2.0, error="first"),
         Entry("done", "j1", LOC, outcome="failed", at=3.0, started=2.5)],
        [Entry("done", "j1", LOC, outcome="succeeded", at=2.0, dup_of="j0"),
         Entry("done", "j1", LOC, outcome="succeeded", at=3.0, result_kept=True, result="r")],
        [Entry("done", "j1", LOC, outcome="cancelled", at=2.0),
         Entry("done", "j1", LOC, outcome="failed", at=3.0, started=2.0, error="late")],
        [Entry("done", "j1", LOC, outcome="failed", at=2.0, started=1.0, error="boom"),
         Entry("done", "j1", LOC, outcome="succeeded", at=3.0, started=2.5, result_kept=True),
         Entry("done", "j1", LOC, outcome="succeeded", at=4.0, started=3.5, result_kept=True, result=1),
         Entry("done", "j1", LOC, outcome="failed", at=5.0, started=4.5, result_kept=True, error="late")],
        [Entry("done", "j1", LOC, outcome="it's odd", at=2.0, started=1.0, error="null"),
         Entry("done", "j1", LOC, outcome="succeeded", at=3.0, result_kept=True, result="null"),
         Entry("done", "j1", LOC, outcome="succeeded", at=4.0, result_kept=True, result=None)],
        # the common success's shortcut: each of its checks decides one of these (review of look50)
        [Entry("done", "j1", LOC, outcome="succeeded", at=2.0, started=1.0)],
        [Entry("done", "j1", LOC, outcome="succeeded", at=2.0, started=1.0, result_kept=True, dup_of="j0")],
        [Entry("done", "j1", LOC, outcome="succeeded", at=2.0, started=1.0, result_kept=True, result_bytes=5)],
        [Entry("done", "j1", LOC, outcome="succeeded", at=2.0, started=1.0, result_kept=True, error="x")],
        [Entry("done", "j1", LOC, outcome="failed", at=2.0, started=1.0, result_kept=True)],
        # an outcome outside the protocol's, bound, on a later entry than the first
        [Entry("done", "j1", LOC, outcome="failed", at=2.0, started=1.0, error="boom"),
         Entry("done", "j1", LOC, outcome="it's odd", at=3.0, started=2.5)],
    ],
)  # fmt: skip
def test_the_rows_are_those_every_value_bound_made(tmp_path: Path, entries: list[Entry]) -> None:
    new, old = _db(tmp_path / "new.sqlite"), _db(tmp_path / "old.sqlite")
    try:
        store._apply(new, entries)
        _old_apply(old, entries)
        assert new.execute("SELECT * FROM jobs").fetchall() == old.execute("SELECT * FROM jobs").fetchall()
    finally:
        new.close()
        old.close()
