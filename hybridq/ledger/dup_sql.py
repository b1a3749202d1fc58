"""The pending duplicates' table in SQL: its schema, its statements, and its rows read back.

:class:`hybridq.ledger.duptable.DuplicateTable` keeps the bookkeeping that spares most endings
a statement (which segments have rows or owners, what was noted since the last settle); this
module owns only what the ``duplicates`` table of ``<journal>/ledger-keys.sqlite`` is and how it
is queried, so a change of the table is one module's change.

This module must not import redis or rq.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from hybridq.journal.records import Loc
from hybridq.ledger.entries import Entry

__all__ = [
    "CHUNK",
    "EARLIER",
    "OWNED",
    "PAGE",
    "ROW",
    "SCHEMA",
    "WHERE",
    "Row",
    "json_locs",
    "order_of",
    "row_of",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS duplicates (
    chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL, key TEXT NOT NULL,
    owner_chain TEXT, owner_seg INTEGER, owner_off INTEGER, body BLOB NOT NULL,
    PRIMARY KEY (chain, seg, off)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS duplicates_owner ON duplicates (owner_chain, owner_seg, owner_off)
    WHERE owner_chain IS NOT NULL;
CREATE INDEX IF NOT EXISTS duplicates_unresolved ON duplicates (key) WHERE owner_chain IS NULL;
"""
WHERE = "chain = ? AND seg = ? AND off = ?"
#: Owner positions per query (one JSON parameter).
CHUNK = 3_000
#: Keys without an owner per page (:meth:`DuplicateTable.unresolved_keys`).
PAGE = 500
ROW = "chain, seg, off, body, owner_chain, owner_seg, owner_off"
# The owners' positions first, each found in the owner index (a row-value IN over them used
# only its first column: every row of one chain, 70 ms a settle at 100,000 duplicates).
# json_extract, not ``->>`` (SQLite 3.38): the tables need SQLite 3.24 (docs/deploy.md).
OWNED = (
    "SELECT d.chain, d.seg, d.off, d.body, d.owner_chain, d.owner_seg, d.owner_off"
    " FROM json_each(?) AS j CROSS JOIN duplicates AS d"
    " WHERE d.owner_chain = json_extract(j.value, '$[0]') AND d.owner_seg = json_extract(j.value, '$[1]')"
    " AND d.owner_off = json_extract(j.value, '$[2]')"
)

# A second ``duplicate`` entry of a pending job (a ledger append that failed after its bytes
# reached the disk, then the step retried) replaces the row only if it is the earlier one, by
# (at, ol): the row is the same whatever order the ledger is replayed in (docs/reliability.md,
# "Duplicates").
EARLIER = (
    "UPDATE duplicates SET key = ?, owner_chain = ?, owner_seg = ?, owner_off = ?, body = ?"
    " WHERE chain = ? AND seg = ? AND off = ?"
    " AND (?, ?, ?, ?) < (coalesce(json_extract(CAST(body AS TEXT), '$.at'), 0.0),"
    " coalesce(owner_chain, ''), coalesce(owner_seg, -1), coalesce(owner_off, -1))"
)

#: A pending duplicate as read: its position, its ``duplicate`` entry, its owner's position (if
#: resolved).
Row = tuple[Loc, Entry, Loc | None]


def json_locs(locs: Iterable[Loc]) -> str:
    """Positions as a JSON array of ``[chain, seg, off]`` (one query parameter)."""
    return json.dumps([list(loc) for loc in locs], separators=(",", ":"))


def row_of(row: tuple[object, ...]) -> Row:
    """A row as :data:`ROW` selects it: its position, its entry, its owner's position."""
    c, s, o, body, oc, os_, oo = row
    owner = None if oc is None else (str(oc), int(os_), int(oo))  # type: ignore[call-overload]
    return (str(c), int(s), int(o)), Entry.from_bytes(body), owner  # type: ignore[call-overload, arg-type]


def order_of(entry: Entry) -> tuple[float, str, int, int]:
    """Which of two ``duplicate`` entries of one job the row keeps: the smaller (``EARLIER``)."""
    owner = entry.owner_loc or ("", -1, -1)
    return (entry.at, *owner)
