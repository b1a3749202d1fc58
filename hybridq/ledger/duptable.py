"""The pending duplicates: rows of the ledger tables' file, not entries on the heap (issue 29).

A job enqueued with the idempotency key of a pending job is recorded as a ``duplicate`` of it
and settled once that owner is terminal (:mod:`hybridq.forwarder.admission`). Kept as a dict of
entries, that was about 0.5 KB per pending duplicate, written whole into every saved index, and
the forwarder walked all of them after every batch. The forwarder keeps them in the
``duplicates`` table of ``<journal>/ledger-keys.sqlite`` (:mod:`hybridq.ledger.tablefile`: its
rows follow that file's rules, docs/reliability.md "The key table"); readers that replay the
ledger into an index of their own keep them in a table in memory.

Which jobs are pending duplicates is what :meth:`~hybridq.ledger.index.LedgerIndex.apply`
decides, in any order: a ``duplicate`` entry adds a row unless its job is terminal already; a
terminal outcome of the job (its settling ``done``, a cancel's) drops it. So that a ``done``
costs no statement of its own, a terminal outcome folded while any row exists is only noted
(:meth:`ended`), and the rows of the jobs noted are deleted in one batch before anything reads
or commits (:meth:`flush`); while no row exists a ``done`` costs one integer test. The table's
schema and statements are :mod:`hybridq.ledger.dup_sql`'s.

Each row also holds the position of the key's owner it waits for (indexed): the ``duplicate``
entry's ``ol``, the owner when the forwarder admitted it, so a rebuilt table has the same rows
as the one it replaces (docs/reliability.md, "Duplicates"). An entry written before ``ol``
existed gets it from the forwarder's first look (:meth:`resolve`: the key's owner then).
Settling is driven by owners turning terminal, one query for the owners noted since the last
settle (:meth:`of_owners`), not a walk of every pending duplicate per batch. Only endings that
may matter are noted: a job of a segment with rows, or with owners of rows (per segment, the
range of offsets). The owner of a row added since the last settle is looked at once
(:meth:`take_added`: it may have finished before). A start (new table object) looks once at
every distinct owner (:attr:`check_all`), since owners may have finished in entries the saved
index already covers.

This module must not import redis or rq.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from hybridq.journal.records import Loc
from hybridq.ledger.dup_sql import (
    CHUNK,
    EARLIER,
    OWNED,
    PAGE,
    ROW,
    SCHEMA,
    WHERE,
    Row,
    json_locs,
    order_of,
    row_of,
)
from hybridq.ledger.entries import Entry, Seg
from hybridq.ledger.tablefile import mapped

if TYPE_CHECKING:
    from hybridq.ledger.tablefile import TableFile

__all__ = ["ENDED_MOST", "SCHEMA", "DuplicateTable"]

#: Terminal outcomes noted at most before they are flushed and forgotten: past it, the owners
#: among them are found by a look at every distinct owner instead (:attr:`DuplicateTable.check_all`).
ENDED_MOST = 50_000


class DuplicateTable:
    """The pending duplicates of one :class:`~hybridq.ledger.tablefile.TableFile` (module docstring)."""

    def __init__(self, file: TableFile) -> None:
        self.file = file
        #: How many rows, less those of the positions noted and not flushed yet (an upper bound
        #: until :meth:`flush`; 0 exactly when there is none: the hot paths' test).
        self.pending = 0
        #: Per journal segment with rows: how many (as :attr:`pending`) and the largest offset
        #: any had (never lowered). A job of a segment without any, or past that offset (the
        #: records the forwarder reads next), is not one, without a statement: bytes per
        #: segment, not per job.
        self._segs: dict[Seg, list[int]] = {}
        #: Per journal segment holding owners of rows: the lowest and highest offset of one (never
        #: narrowed while rows exist): an ending outside is no owner's, and not noted.
        self._owner_segs: dict[Seg, list[int]] = {}
        #: Positions of jobs found terminal while rows existed, since the last :meth:`take_ended`.
        self._ended: list[Loc] = []
        #: (owner, key) of the rows added with an owner since the last :meth:`take_added`: that
        #: owner may have finished before (its ending then was not noted).
        self._added: list[tuple[Loc, str]] = []
        #: How many of :attr:`_ended` were flushed (their rows deleted).
        self._flushed = 0
        #: Whether rows without a resolved owner may exist (added since the last resolve).
        self.unresolved = False
        #: Whether every distinct owner must be looked at once (a start; too many noted).
        self.check_all = True

    @mapped
    def opened(self) -> None:
        """Count the rows per journal segment (one scan of the table's key: O(duplicates) in C)."""
        # Before the deferred check's verdict (confirmed=False): counts kept in memory, made again
        # with the table if it is damaged; every row acted on is read again after the verdict.
        rows = self.file.execute(
            "SELECT chain, seg, count(*), max(off) FROM duplicates GROUP BY chain, seg", confirmed=False
        )
        self._segs = {(str(c), int(s)): [int(n), int(o)] for c, s, n, o in rows}
        self.pending = sum(n for n, _ in self._segs.values())
        self.unresolved = self.pending > 0
        owners = self.file.execute(
            "SELECT owner_chain, owner_seg, min(owner_off), max(owner_off) FROM duplicates"
            " WHERE owner_chain IS NOT NULL GROUP BY owner_chain, owner_seg",
            confirmed=False,
        )
        self._owner_segs = {(str(c), int(s)): [int(lo), int(hi)] for c, s, lo, hi in owners}

    def cleared(self) -> None:
        """Every row was dropped."""
        self.pending, self._segs, self._ended, self._flushed, self.unresolved = 0, {}, [], 0, False
        self._owner_segs, self._added = {}, []

    # -- writing ------------------------------------------------------------------------------

    @mapped
    def add(self, entry: Entry, raw: bytes | None = None) -> bool:
        """Add ``entry``'s job (a ``duplicate`` entry) as pending; whether it was not already."""
        body = entry.to_bytes() if raw is None else raw
        owner, key = entry.owner_loc, entry.key or ""
        added = self.file.write(
            "INSERT OR IGNORE INTO duplicates VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (*entry.loc, key, *(owner or (None, None, None)), body),
        ).rowcount
        if added:
            known = self._segs.setdefault((entry.loc[0], entry.loc[1]), [0, entry.loc[2]])
            known[0] += 1
            known[1] = max(known[1], entry.loc[2])
            self.pending += 1
        elif not self.file.write(
            EARLIER, (key, *(owner or (None, None, None)), body, *entry.loc, *order_of(entry))
        ).rowcount:
            return False
        if owner is None:
            self.unresolved = True  # an entry written before ``ol``: the first look fills it
        else:
            self._owns(owner)
            if not self.check_all:
                self._added.append((owner, key))
                if len(self._added) > ENDED_MOST:  # a long replay: every owner looked at instead
                    self._added, self.check_all = [], True
        return bool(added)

    def _owns(self, owner: Loc) -> None:
        span = self._owner_segs.get((owner[0], owner[1]))
        if span is None:
            self._owner_segs[(owner[0], owner[1])] = [owner[2], owner[2]]
        else:
            span[0], span[1] = min(span[0], owner[2]), max(span[1], owner[2])

    def ended(self, loc: Loc) -> None:
        """The job at ``loc`` is terminal now (called only while :attr:`pending`): no statement.

        Noted only if it may be a row (its own settling) or a row's owner: the others (most
        of a step's endings) cost two dict lookups, and no JSON or SQL at the settle.
        """
        if not self._may_hold(loc):
            span = self._owner_segs.get((loc[0], loc[1]))
            if span is None or not span[0] <= loc[2] <= span[1]:
                return
        self._ended.append(loc)
        if len(self._ended) > ENDED_MOST:  # a long replay: its owners are looked at all at once
            self.flush()
            self._ended, self._flushed, self.check_all = [], 0, True

    @mapped
    def flush(self) -> None:
        """Delete the rows of the jobs noted terminal (a batch per segment with rows); exact after.

        The endings are taken as flushed before any write: a write past ``tablefile.COMMIT_ROWS`` commits
        first, and a commit flushes (:meth:`KeyTable._settle`), which then finds nothing to do
        (it recursed until RecursionError before).
        """
        start, self._flushed = self._flushed, len(self._ended)
        if start == self._flushed or not self.pending:
            return
        by_seg: dict[Seg, list[Loc]] = {}
        segs = self._segs
        for loc in self._ended[start : self._flushed]:
            if (seg := (loc[0], loc[1])) in segs:
                by_seg.setdefault(seg, []).append(loc)
        for seg, locs in by_seg.items():
            gone = self.file.write_many(f"DELETE FROM duplicates WHERE {WHERE}", locs).rowcount  # noqa: S608
            self._dropped(seg, max(0, gone))

    def take_ended(self) -> list[Loc]:
        """The positions noted terminal since the last call (flushed), forgotten here."""
        self.flush()
        ended, self._ended, self._flushed = self._ended, [], 0
        return ended

    def take_added(self) -> list[tuple[Loc, str]]:
        """(owner, key) of the rows added with an owner since the last call, forgotten here."""
        added, self._added = self._added, []
        return added

    def _dropped(self, seg: Seg, gone: int) -> None:
        known = self._segs.get(seg)
        if known is not None:
            known[0] -= gone
            if known[0] <= 0:
                del self._segs[seg]
        self.pending -= gone
        if self.pending <= 0:
            self._owner_segs = {}

    @mapped
    def resolve(self, key: str, owner: Loc) -> None:
        """Record ``owner`` as the job the unresolved duplicates of ``key`` wait for."""
        self.file.write(
            "UPDATE duplicates SET owner_chain = ?, owner_seg = ?, owner_off = ?"
            " WHERE key = ? AND owner_chain IS NULL",
            (*owner, key),
        )
        self._owns(owner)

    @mapped
    def drop_all(self) -> None:
        """Drop every row (an upgrade from a saved index that held them refills the table)."""
        self.file.write("DELETE FROM duplicates")
        self.cleared()

    @mapped
    def drop_segments(self, gone: Callable[[tuple[str, int]], bool]) -> None:
        """Drop the rows of journal segments ``gone`` says were compacted (a start: O(segments))."""
        self.flush()
        for seg in [seg for seg in self._segs if gone(seg)]:
            self._dropped(
                seg, self.file.write("DELETE FROM duplicates WHERE chain = ? AND seg = ?", seg).rowcount
            )

    # -- reading ------------------------------------------------------------------------------

    def unresolved_keys(self) -> Iterator[str]:
        """The keys of the pending duplicates with no owner yet (entries without ``ol``).

        A page of keys at a time, read after the caller's :meth:`resolve` of the previous
        ones: not every such row at once (after an upgrade from a saved index of format 2 or 3,
        every pending duplicate).
        """
        self.unresolved = False
        last = ""
        while page := self._unresolved_page(last):
            yield from page
            last = page[-1]

    @mapped
    def _unresolved_page(self, after: str) -> list[str]:
        self.flush()
        rows = self.file.execute(
            "SELECT DISTINCT key FROM duplicates WHERE owner_chain IS NULL AND key > ? ORDER BY key LIMIT ?",
            (after, PAGE),
        )
        return [str(k) for (k,) in rows]

    @mapped
    def unresolved_of(self, key: str) -> list[tuple[Loc, Entry]]:
        """The pending duplicates of ``key`` with no owner yet (the caller settles them all)."""
        self.flush()
        rows = self.file.execute(
            "SELECT chain, seg, off, body FROM duplicates WHERE key = ? AND owner_chain IS NULL", (key,)
        )
        return [((str(c), int(s), int(o)), Entry.from_bytes(b)) for c, s, o, b in rows]

    @mapped
    def owners(self) -> list[Loc]:
        """Every distinct owner (a start's look: O(owners), read from the owner index alone)."""
        self.flush()
        self.check_all, self._added = False, []
        rows = self.file.execute(
            "SELECT DISTINCT owner_chain, owner_seg, owner_off FROM duplicates WHERE owner_chain IS NOT NULL"
        ).fetchall()
        return [(str(c), int(s), int(o)) for c, s, o in rows]

    @mapped
    def key_of(self, owner: Loc) -> str | None:
        """The key of the duplicates waiting for ``owner`` (``None``: none waits for it)."""
        row = self.file.execute(
            "SELECT key FROM duplicates WHERE owner_chain = ? AND owner_seg = ? AND owner_off = ? LIMIT 1",
            owner,
        ).fetchone()
        return None if row is None else str(row[0])

    def of_owners(self, owners: Sequence[Loc]) -> Iterator[Row]:
        """The pending duplicates waiting for any of ``owners`` (one query per 3,000 of them).

        Each row's entry is decoded as it is yielded: a chunk's rows are held as bytes, not as
        entries (one owner may have many duplicates).
        """
        for lo in range(0, len(owners), CHUNK):
            for row in self._owned(owners[lo : lo + CHUNK]):
                yield row_of(row)

    @mapped
    def _owned(self, owners: Iterable[Loc]) -> list[tuple[object, ...]]:
        self.flush()
        return self.file.execute(OWNED, (json_locs(owners),)).fetchall()

    @mapped
    def get(self, loc: Loc) -> Entry | None:
        """The ``duplicate`` entry of the pending duplicate at ``loc`` (``None``: not one)."""
        if not self._may_hold(loc):
            return None
        self.flush()
        row = self.file.execute(f"SELECT body FROM duplicates WHERE {WHERE}", loc).fetchone()  # noqa: S608
        return None if row is None else Entry.from_bytes(row[0])

    def __contains__(self, loc: object) -> bool:
        # The forwarder's read path: the cheap tests first, outside the error mapping's wrapper.
        if not self.pending or not (isinstance(loc, tuple) and len(loc) == 3):
            return False
        if not self._may_hold(loc):
            return False  # most records of a step while duplicates are pending: no statement
        return self._holds(loc)

    @mapped
    def _holds(self, loc: Loc) -> bool:
        self.flush()
        return self.file.execute(f"SELECT 1 FROM duplicates WHERE {WHERE}", loc).fetchone() is not None  # noqa: S608

    def _may_hold(self, loc: Loc) -> bool:
        known = self._segs.get((loc[0], loc[1]))
        return known is not None and loc[2] <= known[1]

    def __len__(self) -> int:
        self.flush()
        return self.pending

    def __bool__(self) -> bool:
        return self.pending > 0

    @mapped
    def items(self) -> list[tuple[Loc, Entry]]:
        """Every pending duplicate (tests, readers that list them: O(duplicates))."""
        self.flush()
        rows = self.file.execute(f"SELECT {ROW} FROM duplicates ORDER BY chain, seg, off").fetchall()  # noqa: S608
        return [(loc, entry) for loc, entry, _ in map(row_of, rows)]

    def values(self) -> Iterator[Entry]:
        """Every pending duplicate's entry (see :meth:`items`)."""
        return (entry for _, entry in self.items())

    def __iter__(self) -> Iterator[Loc]:
        return (loc for loc, _ in self.items())

    def __eq__(self, other: object) -> bool:
        """The same pending duplicates (another table's, or a mapping's ``loc -> Entry``)."""
        if isinstance(other, DuplicateTable):
            return self.items() == other.items()
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
