"""The duplicates table's statements: what SQLite they need, and which ones a settle sends.

The tables need SQLite 3.24 (docs/deploy.md, "Install"): a statement using a newer syntax (the
``->>`` operator is 3.38) is a syntax error on the system SQLite of Debian 11 or Ubuntu 22.04,
which poisons the table and stops the forwarder with EIO at every settle.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.ledger import dup_sql, duptable
from hybridq.ledger.entries import Entry

from tests.unit import test_ledger_replay
from tests.unit.test_duplicate_table import _env, _state_with_duplicates, statements

#: Syntax newer than SQLite 3.24 that a statement could slip in.
_NEWER = re.compile(r"->|\bRETURNING\b|\bSTRICT\b|\biif\s*\(|\bunixepoch\s*\(", re.IGNORECASE)


def test_a_settle_uses_no_syntax_newer_than_sqlite_3_24(tmp_path: Path) -> None:
    """Fails before: the owners' query used ``->>``."""
    _, writer, state, admission = _state_with_duplicates(tmp_path, 5)
    try:
        with statements(state.index.keys) as seen:
            admission.settle()
            state.append([Entry("done", "owner", (writer, 0, 32), outcome="succeeded", at=1.0)])
            admission.settle()
        assert len(state.index.duplicates) == 0
        assert [s for s in seen if _NEWER.search(s)] == []
    finally:
        state.close()


def test_the_owners_query_finds_each_owner_in_its_index() -> None:
    db = sqlite3.connect(":memory:")
    db.executescript(duptable.SCHEMA)
    plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + dup_sql.OWNED, ('[["a",1,2]]',))]
    assert any(
        "USING INDEX duplicates_owner (owner_chain=? AND owner_seg=? AND owner_off=?)" in p for p in plan
    )


def test_every_statement_of_the_table_is_old_enough_and_finds_its_rows_by_an_index(tmp_path: Path) -> None:
    """Not the settle's statements alone: a start's counts (``opened``), the first look at rows
    without an owner (its pages of keys, ``resolve``), a second entry of one job (the earlier
    kept), membership. Each is traced, then its plan read: none scans the table but the start's
    counts (documented: one scan of the table's key)."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        admission = Admission(state)
        for i in range(3):
            assert admission.admit(_env(f"owner-{i}", f"k{i}"), (writer, 0, 32 + i))
        admission.flush()
        unresolved = [
            Entry(
                "duplicate", f"d{i}", (writer, 1, 32 + i), key=_env("x", f"k{i}").key_id, dup_of=f"owner-{i}"
            )
            for i in range(2)
        ]
        state.append(unresolved)  # entries without ``ol`` (an older release's)
        assert not admission.admit(_env("d2", "k2"), (writer, 1, 40))
        later = Entry(
            "duplicate",
            "d2",
            (writer, 1, 40),
            key=_env("x", "k2").key_id,
            dup_of="x",
            owner_loc=(writer, 2, 1),
            at=1e12,  # after the admission's clock: not kept
        )
        dups = state.index.duplicates
        with statements(state.index.keys) as seen:
            admission.flush()
            state.index.apply(later)  # a second entry of d2: the earlier is kept
            dups.opened()
            dups.check_all = True
            admission.settle()  # the start's look, the unresolved keys' pages, resolve
            assert (writer, 1, 40) in dups
            assert dups.get((writer, 1, 40)) is not None
            state.append(
                [Entry("done", f"owner-{i}", (writer, 0, 32 + i), outcome="failed", at=1.0) for i in range(3)]
            )
            admission.settle()
        assert len(dups) == 0
        ours = [s for s in seen if "duplicates" in s]
        for marker in (
            "GROUP BY chain, seg",
            "AND key >",
            "UPDATE duplicates SET owner_chain",
            "UPDATE duplicates SET key",
        ):
            assert any(marker in s for s in ours), marker
        assert [s for s in ours if _NEWER.search(s)] == []
        db = state.index.keys._db
        planned = [
            s for s in ours if "GROUP BY" not in s and s.lstrip().startswith(("SELECT", "UPDATE", "DELETE"))
        ]
        assert len(planned) >= 8
        for sql in planned:
            plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql)]
            assert not any(p.startswith("SCAN d") for p in plan), (sql, plan)
    finally:
        state.close()
