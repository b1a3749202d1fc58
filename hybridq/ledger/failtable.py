"""The failures listed for requeue: rows of the ledger tables' file, not entries on the heap.

Every job that failed for good (its ``done`` entry, with the envelope ``hybridq failed requeue``
needs) was kept in :attr:`LedgerIndex.failed` as a dict until it was requeued: about 0.9 KB a
failure, forever, and written whole into every saved index (issue 29). The forwarder keeps them
in the ``failures`` table of ``<journal>/ledger-keys.sqlite`` (:mod:`hybridq.ledger.tablefile`:
its rows follow that file's rules, docs/reliability.md "The key table"); readers that replay
the ledger into an index of their own keep them in a table in memory (the dashboard's long-lived
view: in a private temporary database, SQLite's cache then a temporary file).

A row is a job's listed failure, or its **requeue mark** (``requeued`` set, no entry): a
requeue read before the failure it cancels (replay order across ledger chains is not global)
still keeps that failure off the list, as the in-memory ``requeued`` set did; or its
**outranked mark** (``requeued`` 2, no entry): a success that outranked the failure, read in the
replay of a compacted journal segment, where no outcome is kept to rank them (docs/reliability.md,
"A success outranks a failure"), keeps it off the list the same way. Which failures
are listed is what :meth:`~hybridq.ledger.index.LedgerIndex.apply` decides (a success beats a
failure; a requeue mark delists it whatever the order); this class is a mapping of the listed
ones, ``loc -> Entry``, with :meth:`requeue` for the marks.

This module must not import redis or rq.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from hybridq.journal.records import Loc
from hybridq.ledger.entries import Entry
from hybridq.ledger.tablefile import mapped

if TYPE_CHECKING:
    from hybridq.ledger.tablefile import TableFile

__all__ = ["SCHEMA", "FailureTable"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS failures (
    chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL,
    requeued INTEGER NOT NULL, body BLOB, PRIMARY KEY (chain, seg, off)
) WITHOUT ROWID;
"""
_WHERE = "chain = ? AND seg = ? AND off = ?"
#: The count of listed failures in the file's ``meta`` table.
_LISTED = "failures_listed"
_ADD = "INSERT OR IGNORE INTO failures VALUES (?, ?, ?, 0, ?)"
_MARK = "INSERT OR IGNORE INTO failures VALUES (?, ?, ?, ?, NULL)"
#: The ``requeued`` column: 0 listed, else a mark (what keeps the failure off the list).
_REQUEUED, _OUTRANKED = 1, 2


class FailureTable:
    """The listed failures of one :class:`~hybridq.ledger.tablefile.TableFile` (module docstring)."""

    def __init__(self, file: TableFile) -> None:
        self.file = file
        #: How many are listed, once known (kept by every write after that: no count per read).
        self._listed: int | None = None

    def opened(self) -> None:
        """Take the count the file was committed with (``None``: counted when first asked).

        A count is O(failures) pages read: at a million failures, seconds at each start. So
        :meth:`committing` writes it into the file with the rows it counts (one transaction:
        it always matches them), and an open reads it back.
        """
        listed = self.file.meta.get(_LISTED)
        self._listed = None if listed is None else int(listed)

    def cleared(self) -> None:
        """Every row was dropped."""
        self._listed = 0

    def committing(self) -> None:
        """Write the count into the transaction about to commit (with the rows it counts)."""
        if self._listed is not None and self.file.path is not None:
            self.file.execute(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", (_LISTED, str(self._listed)), confirmed=False
            )

    @mapped
    def _state(self, loc: Loc) -> int | None:
        """1: a requeue mark, 2: an outranked mark, 0: listed, ``None``: no row."""
        row = self.file.execute(f"SELECT requeued FROM failures WHERE {_WHERE}", loc).fetchone()  # noqa: S608
        return None if row is None else int(row[0])

    # -- writing ------------------------------------------------------------------------------

    def __setitem__(self, loc: Loc, entry: Entry) -> None:
        self.put(loc, entry)

    @mapped
    def put(self, loc: Loc, entry: Entry, raw: bytes | None = None) -> None:
        """List ``entry``'s failure, unless ``loc`` was requeued (a listed one is replaced).

        One insert for a new failure (the forward path's case), an update after it otherwise.
        ``raw``: the entry's JSON if the caller has it (the ledger append encoded it already:
        encoding an envelope again cost more than the insert).
        """
        body = entry.to_bytes() if raw is None else raw
        if self.file.write(_ADD, (*loc, body)).rowcount:
            if self._listed is not None:
                self._listed += 1
            return
        self.file.write(f"UPDATE failures SET body = ? WHERE {_WHERE} AND requeued = 0", (body, *loc), 0)  # noqa: S608

    @mapped
    def setdefault(self, loc: Loc, entry: Entry) -> None:
        """List ``entry``'s failure unless ``loc`` has a row (listed, or requeued)."""
        added = self.file.write(_ADD, (*loc, entry.to_bytes())).rowcount
        if self._listed is not None:
            self._listed += added

    @mapped
    def delist(self, loc: Loc) -> bool:
        """Delist ``loc``'s failure (a success outranked it); a requeue mark stays.

        Whether one was listed: the ``DELETE``'s row count, nothing read or decoded.
        """
        gone = self.file.write(f"DELETE FROM failures WHERE {_WHERE} AND requeued = 0", loc).rowcount  # noqa: S608
        if gone and self._listed is not None:
            self._listed -= 1
        return bool(gone)

    @mapped
    def outrank(self, loc: Loc) -> None:
        """A success outranked ``loc``'s failure: delisted now, and never listed again.

        For the replay of a compacted journal segment only (a live one ranks the outcomes
        themselves); a requeue mark stays one.
        """
        self.delist(loc)
        self.file.write(_MARK, (*loc, _OUTRANKED), 0)

    @mapped
    def drop_all(self) -> None:
        """Drop every row, listed failures and requeue marks (an upgrade from format 2 refills them).

        Rows an earlier upgrade committed without a saved index of format 3 vouching for them
        may be stale: the previous release, trusting the file, never deleted the failures it
        saw outranked since (docs/reliability.md, the key table).
        """
        self.file.write("DELETE FROM failures")
        self._listed = 0

    @mapped
    def requeue(self, loc: Loc) -> None:
        """Mark ``loc`` requeued: delisted now, and never listed again whatever comes later.

        An outranked mark becomes a requeue mark, as :meth:`outrank` leaves one: the job reads
        ``failed`` as a key owner (:meth:`failed_at`) in whichever order the two were read.
        """
        state = self._state(loc)
        if state == _REQUEUED:
            return
        if state is None:
            self.file.write(_MARK, (*loc, _REQUEUED), 0)
            return
        self.file.write(f"UPDATE failures SET requeued = 1, body = NULL WHERE {_WHERE}", loc)  # noqa: S608
        if state == 0 and self._listed is not None:
            self._listed -= 1

    # -- reading ------------------------------------------------------------------------------

    @mapped
    def get(self, loc: Loc) -> Entry | None:
        """The listed failure at ``loc`` (``None``: none, or requeued)."""
        row = self.file.execute(
            f"SELECT body FROM failures WHERE {_WHERE} AND requeued = 0",  # noqa: S608
            loc,
        ).fetchone()
        return None if row is None else Entry.from_bytes(row[0])

    def __contains__(self, loc: object) -> bool:
        return isinstance(loc, tuple) and len(loc) == 3 and self._state(loc) == 0

    def failed_at(self, loc: Loc) -> bool:
        """Whether the job at ``loc`` failed for good: listed, or requeued since (its mark).

        Not if a success outranked the failure (its mark): the job succeeded.
        """
        return self._state(loc) in (0, _REQUEUED)

    @mapped
    def __len__(self) -> int:
        if self._listed is None:
            self._listed = int(
                self.file.execute("SELECT count(*) FROM failures WHERE requeued = 0").fetchone()[0]
            )
        return self._listed

    @mapped
    def items(self) -> list[tuple[Loc, Entry]]:
        """Every listed failure (readers that list them all: O(failures) time and memory)."""
        rows = self.file.execute(
            "SELECT chain, seg, off, body FROM failures WHERE requeued = 0 ORDER BY chain, seg, off"
        ).fetchall()
        return [((str(c), int(s), int(o)), Entry.from_bytes(body)) for c, s, o, body in rows]

    @mapped
    def each(self, visit: Callable[[Entry], None]) -> None:
        """``visit`` every listed failure's entry, one row at a time (O(1) memory here)."""
        for _, _, _, body in self.file.execute(
            "SELECT chain, seg, off, body FROM failures WHERE requeued = 0 ORDER BY chain, seg, off"
        ):
            visit(Entry.from_bytes(body))

    @mapped
    def job_ids(self) -> set[str]:
        """The job ids of every listed failure (one query, O(failures): look many ids up in it)."""
        rows = self.file.execute("SELECT body FROM failures WHERE requeued = 0")
        return {str(json.loads(body)["id"]) for (body,) in rows}

    def values(self) -> Iterator[Entry]:
        """Every listed failure's entry (see :meth:`items`)."""
        return (entry for _, entry in self.items())

    def __iter__(self) -> Iterator[Loc]:
        return (loc for loc, _ in self.items())

    @mapped
    def requeued(self) -> list[Loc]:
        """Every requeue mark (tests, and the saved index's upgrade: O(marks))."""
        rows = self.file.execute(
            "SELECT chain, seg, off FROM failures WHERE requeued = 1 ORDER BY chain, seg, off"
        )
        return [(str(c), int(s), int(o)) for c, s, o in rows]

    def __eq__(self, other: object) -> bool:
        """The same failures listed and requeue marks (another table's), or listed (a mapping's)."""
        if isinstance(other, FailureTable):
            return dict(self.items()) == dict(other.items()) and self.requeued() == other.requeued()
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
