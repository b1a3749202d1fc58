"""The lookup index's catch-up, its fold of ledger entries into rows (:class:`EntryFold`).

:class:`~hybridq.lookup.index.LookupIndex` inherits :class:`EntryFold`: the catch-up applies an
entry whose journal record is read into the index, keeps one about a record not read yet (a
cancel of a job in a backlog the forwarder is still reading) in the ``ahead`` table until its row
is in, and saves the marks with what the forwarder noted. With the catch-up's helpers over the
marks (``_forward``, ``_read``) and the ``done`` entries rebuilt from the ledger's ids files
(:class:`KeptIds`, each file decoded once while it stays the same). Apart from
:mod:`hybridq.lookup.index` (house style: small modules), which keeps the open, the notes, the
catch-up's reads and the retention sweep.

This module must not import redis or rq.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from typing import Any

from hybridq.journal.records import ChainPosition
from hybridq.ledger.entries import Entry, Seg
from hybridq.ledger.punched_ids import decode_payload, ids_files, read_payload
from hybridq.lookup.store import _STARTED, _apply, _moved, _save_marks, _stash, _stashed, _upsert_jobs

__all__ = ["KEPT_ENTRIES", "KEPT_FILES", "EntryFold", "KeptIds"]

#: At most this many ids files stay decoded (one per pinned ledger segment is read; a cap anyway),
#: holding at most this many entries in all: about 443 bytes an entry stay alive (tracemalloc, a
#: file of 20,000 ids: 8.5 MiB), and a 4 MiB ledger segment's ids file names up to about 22,000
#: jobs (a ``done`` entry is about 190 bytes). A file past either is decoded at each read, as before.
KEPT_FILES = 64
KEPT_ENTRIES = 25_000


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
                _upsert_jobs(db, jobs)
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


class KeptIds:
    """The ``done`` entries of the ledger's ids files, each file decoded once while its bytes stay the same.

    A catch-up that reads the ledger from a mark in a punched segment (another writer's, or a
    rebuild's) reads that segment's ids file (docs/journal.md, "Entries punched out of pinned
    ledger segments"), and the forwarder catches up every step: decoded each time, a file of
    2,000 ids cost 10.5 ms of CPU a catch-up, kept 0.07-0.10 ms (``time.process_time`` over 200
    reads; 22,000 ids 1.05 ms). Each read still reads the file and checks its checksum
    (``read_state``); only the decoding is skipped, and only when the bytes are the ones decoded
    last time. So a file replaced, even by one whose size, time and inode match the
    old one's, is decoded again, and a damaged one raises
    :class:`~hybridq.errors.StateFileCorrupt` on each read as before (nothing kept). A file gone
    (or no longer read from) is dropped.
    """

    def __init__(self, ledger: str, cap: int = KEPT_FILES, entries_cap: int = KEPT_ENTRIES) -> None:
        self.ledger = ledger
        self.cap = cap
        self.entries_cap = entries_cap
        #: Per file: its payload as decoded, and the entries made from it.
        self._files: dict[str, tuple[bytes, list[Entry]]] = {}
        self._held = 0  # entries in ``_files``
        #: How many files were decoded (the tests count them).
        self.decoded = 0

    def entries(self, marks: Mapping[str, tuple[int, int, int]]) -> Iterator[Entry]:
        """The ``done`` entries, rebuilt from their ids files, of the segments a read from ``marks`` reads."""
        read = [(name, seg) for name, seg in ids_files(self.ledger) if _reads(marks, seg)]
        wanted = {name for name, _ in read}
        for name in [n for n in self._files if n not in wanted]:
            self._drop(name)  # gone, or read past (marks only move on)
        for name, seg in read:
            yield from self._entries_of(name, seg)

    def _drop(self, name: str) -> None:
        gone = self._files.pop(name, None)
        if gone is not None:
            self._held -= len(gone[1])

    def _entries_of(self, name: str, seg: Seg) -> list[Entry]:
        payload = read_payload(self.ledger, *seg)  # damaged: raises, nothing kept
        if payload is None:
            self._drop(name)
            return []  # removed since the listing (its segment went)
        hit = self._files.get(name)
        if hit is not None and hit[0] == payload:
            return hit[1]
        self._drop(name)
        ids = [p.entry() for p in decode_payload(self.ledger, *seg, payload)]
        self.decoded += 1
        if len(self._files) < self.cap and self._held + len(ids) <= self.entries_cap:
            self._files[name] = (payload, ids)
            self._held += len(ids)
        return ids


def _reads(marks: Mapping[str, tuple[int, int, int]], seg: Seg) -> bool:
    """Whether a read of the ledger from ``marks`` reads segment ``seg`` (its chain's mark is not past it)."""
    mark = marks.get(seg[0])
    return mark is None or mark[0] <= seg[1]


def _read(marks: Mapping[str, tuple[int, int, int]], loc: tuple[str, int, int]) -> bool:
    """Whether the journal record at ``loc`` is before ``marks`` (read into the index)."""
    pos = marks.get(loc[0])
    return pos is not None and (loc[1], loc[2]) < (pos[0], pos[1])
