"""The lookup index's catch-up, its fold of ledger entries into rows (:class:`EntryFold`).

:class:`~hybridq.lookup.index.LookupIndex` inherits :class:`EntryFold`: the catch-up applies an
entry whose journal record is read into the index, keeps one about a record not read yet (a
cancel of a job in a backlog the forwarder is still reading) in the ``ahead`` table until its row
is in, and saves the marks with what the forwarder noted. With the catch-up's helpers over the
marks (``_forward``, ``_kept_ids``, ``_read``). Apart from :mod:`hybridq.lookup.index` (house
style: small modules), which keeps the open, the notes, the catch-up's reads and the retention
sweep.

This module must not import redis or rq.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from typing import Any

from hybridq.journal.records import ChainPosition
from hybridq.ledger.entries import Entry
from hybridq.ledger.punched_ids import find_punched
from hybridq.lookup.store import _STARTED, _UPSERT_JOB, _apply, _moved, _save_marks, _stash, _stashed

__all__ = ["EntryFold"]


class EntryFold:
    """The fold of ledger entries into the index's rows (:class:`~hybridq.lookup.index.LookupIndex`'s base).

    The attributes are the index's (set by its ``__init__``): what the forwarder noted, whether
    its entries come noted, and whether the ``ahead`` table may hold entries.
    """

    _entries: list[Entry]
    _started: dict[tuple[str, int, int], tuple[Any, ...]]
    _fed: bool
    _ahead: bool

    def _note(
        self,
        db: sqlite3.Connection,
        marks: Mapping[str, tuple[int, int, int]],
        journal_to: Mapping[str, ChainPosition],
        ledger_to: Mapping[str, ChainPosition],
        *,
        jobs: list[tuple[Any, ...]] | None = None,
        moved: bool = False,
    ) -> int:
        """Upsert ``jobs``, fold the entries noted, then the started runs, save the marks; rows touched."""
        jobs = jobs or []
        entries, self._entries = self._entries, []
        started, self._started = list(self._started.values()), {}
        if moved or jobs or entries or started or _moved(marks, journal_to, ledger_to):
            with db:
                db.executemany(_UPSERT_JOB, jobs)
                self._fold(db, entries, journal_to)
                db.executemany(_STARTED, started)  # after the outcomes: a run's end wins
                _save_marks(db, journal_to, ledger_to)
        self._fed = True  # every entry of its chain so far is in: from now on they are noted
        return len(jobs) + len(entries)

    def _apply_ahead(self, db: sqlite3.Connection, journal_to: Mapping[str, tuple[int, int, int]]) -> int:
        """Apply the kept entries whose records are read now; how many (read only if it may hold any)."""
        if not self._ahead:
            return 0
        kept = _stashed(db)
        now = [(rowid, e) for rowid, e in kept if _read(journal_to, e.loc)]
        self._ahead = len(now) < len(kept)
        if now:
            with db:
                _apply(db, [e for _, e in now])
                db.executemany("DELETE FROM ahead WHERE rowid = ?", [(rowid,) for rowid, _ in now])
        return len(now)

    def _fold(
        self, db: sqlite3.Connection, entries: list[Entry], journal_to: Mapping[str, tuple[int, int, int]]
    ) -> None:
        """Apply ``entries``; keep those about records the forwarder has not read yet.

        Such an entry (a cancel of a job in a backlog the forwarder is still reading) would update
        no row: it is kept until the row is in (:meth:`_apply_ahead`).
        """
        now: list[Entry] = []
        later: list[Entry] = []
        for e in entries:
            (now if _read(journal_to, e.loc) else later).append(e)
        _apply(db, now)
        if later:
            _stash(db, later)
            self._ahead = True


def _forward(journal_to: dict[str, ChainPosition], read_to: Mapping[str, ChainPosition]) -> None:
    """Move the journal's marks to the forwarder's reader position where it is ahead (never back)."""
    for writer, pos in read_to.items():
        if (pos.segment, pos.offset) > tuple(journal_to.get(writer, (-1, -1, 0)))[:2]:
            journal_to[writer] = pos


def _kept_ids(ledger: str, marks: Mapping[str, tuple[int, int, int]]) -> Iterator[Entry]:
    """The ``done`` entries, rebuilt from their ids files, of the segments a read from ``marks`` reads."""

    def read_from_here(seg: tuple[str, int]) -> bool:
        mark = marks.get(seg[0])
        return mark is None or mark[0] <= seg[1]

    for _, p in find_punched(ledger, segments=read_from_here):
        yield p.entry()


def _read(marks: Mapping[str, tuple[int, int, int]], loc: tuple[str, int, int]) -> bool:
    """Whether the journal record at ``loc`` is before ``marks`` (read into the index)."""
    pos = marks.get(loc[0])
    return pos is not None and (loc[1], loc[2]) < (pos[0], pos[1])
