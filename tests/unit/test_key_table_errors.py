"""After a key-table error the table is poisoned: no saved index of that run vouches for it.

SQLite may roll the open transaction back on a failed statement (SQLITE_FULL, IOERR, NOMEM):
the owner rows of ledger entries already durable are then gone. Whichever call failed (a
``forget`` at a ledger compaction, a ``get`` in the admission, an ``own`` from the key store),
``close()`` must write no saved index, so the next start replays those entries into the table
(docs/reliability.md, "The key table"). A failing mark at close must not stop the rest of it.
(Adopted from the review of issue 29's branch; each failed before the fix.)
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import JournalIOError
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.ledger.entries import Entry
from hybridq.ledger.saved_index import SAVED_INDEX_NAME
from hybridq.protocol import EntryKind

from tests.unit import test_ledger_replay
from tests.unit.test_key_table import loaded_with_one_keyed_job


class _RolledBack:
    """The table's connection: a statement starting with ``verb`` fails and rolls back, as SQLite may."""

    def __init__(self, db: sqlite3.Connection, verb: str) -> None:
        self._db, self._verb = db, verb

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.lstrip().upper().startswith(self._verb):
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")
        return self._db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _forget(state: ForwarderState, writer: str) -> None:
    state.forget_keys()  # as each ledger compaction does


def _admit(state: ForwarderState, writer: str) -> None:
    Admission(state).admit(_env("late", "k9"), (writer, 2, 500))


def _store(state: ForwarderState, writer: str) -> None:
    entry = Entry(EntryKind.KEY, "old", (writer, 0, 900), key="k8", at=1.0, until=9e9)
    state.keys.store([entry], state.index)


def _env(job_id: str, key: str) -> Envelope:
    return Envelope(id=job_id, func="m.f", queue="q", idempotency_key=key, created_at=0.0)


@pytest.mark.parametrize(
    ("verb", "fail"),
    [("DELETE", _forget), ("SELECT", _admit), ("INSERT", _store)],
    ids=["forget", "get", "own"],
)
def test_close_after_a_rolled_back_key_table_error_saves_no_index(
    tmp_path: Path, verb: str, fail: Callable[[ForwarderState, str], None]
) -> None:
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    envs = [_env(f"j{i}", f"k{i}") for i in range(3)]
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    admission = Admission(state)
    for i, env in enumerate(envs):
        assert admission.admit(env, (writer, i, 32))
    admission.flush()  # the ledger append is fsync'd; the rows are in the open transaction
    real = state.index.keys._db
    state.index.keys._db = _RolledBack(real, verb)  # type: ignore[assignment]
    with pytest.raises(JournalIOError):
        fail(state, writer)
    state.index.keys._db = real
    assert state.index.keys.failed
    with pytest.raises(JournalIOError):
        state.index.keys.mark()
    state.close()  # as cli/forward.py's finally does
    assert not (Path(journal) / f"{SAVED_INDEX_NAME}.state").exists()

    fresh = ForwarderState(journal, ForwarderConfig())
    fresh.load()
    try:
        missing = [env.idempotency_key for env in envs if fresh.index.keys.get(env.key_id) is None]
        pushed = Admission(fresh).admit(_env("again", "k1"), (writer, 2, 999))
    finally:
        fresh.close()
    assert missing == [], f"owners missing after restart: {missing}"
    assert not pushed, "a second job with key k1 was admitted: it would run twice"


def test_a_failing_mark_at_close_leaves_nothing_open(tmp_path: Path) -> None:
    journal, state = loaded_with_one_keyed_job(tmp_path)

    def failing_mark(covers: str = "") -> tuple[str, int]:
        raise JournalIOError("ledger-keys.sqlite", "the key table", OSError(errno.EIO, "disk I/O error"))

    state.index.keys.mark = failing_mark  # type: ignore[method-assign]
    state.close()
    assert not state.runs.is_open
    assert state._writer is None
    assert not (Path(journal) / f"{SAVED_INDEX_NAME}.state").exists()
