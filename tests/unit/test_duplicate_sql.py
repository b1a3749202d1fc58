"""The duplicates table's statements: what SQLite they need, and which ones a settle sends.

The tables need SQLite 3.24 (docs/deploy.md, "Install"): a statement using a newer syntax (the
``->>`` operator is 3.38) is a syntax error on the system SQLite of Debian 11 or Ubuntu 22.04,
which poisons the table and stops the forwarder with EIO at every settle.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from hybridq.ledger import duptable
from hybridq.ledger.entries import Entry

from tests.unit.test_duplicate_table import _state_with_duplicates, statements

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
    plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + duptable._OWNED, ('[["a",1,2]]',))]
    assert any(
        "USING INDEX duplicates_owner (owner_chain=? AND owner_seg=? AND owner_off=?)" in p for p in plan
    )
