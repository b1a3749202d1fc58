"""The lookup index's writer: the forwarder keeps ``<journal>/lookup/index.sqlite`` up to date.

See :mod:`hybridq.lookup.reads` for what the index holds and who reads it. The forwarder notes the
jobs it decoded (:meth:`LookupIndex.note_job`) and the ledger entries it appended
(:meth:`LookupIndex.note_entries`) and the started events it harvested
(:meth:`LookupIndex.note_started`), and :meth:`LookupIndex.catch_up` writes them after each step
that moved something, with what the files gained that was not noted: the whole journal past the
index's marks when the forwarder starts (a first build, or a rebuild), and the ledger chains of
other writers. Rows past their retention are swept out a chunk at a time.
The fold of the ledger's entries into rows (and of those kept ahead of their records) is
:mod:`hybridq.lookup.fold`, which :class:`LookupIndex` inherits (house style: small modules).
The index file itself (its schema and statements, the marks, reading the files past them) is
:mod:`hybridq.lookup.store`; its integrity check at open runs on a thread
(:mod:`hybridq.lookup.check`), so the first push does not wait for a read of the whole file.

This module must not import redis or rq.
"""

from __future__ import annotations

import itertools
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import JournalCorruption
from hybridq.journal import Record, RecordType
from hybridq.journal.paths import ensure_journal_dir
from hybridq.journal.reader import list_chains
from hybridq.journal.records import ChainPosition
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import ledger_dir
from hybridq.lookup.check import IndexCheck
from hybridq.lookup.fold import EntryFold, KeptIds, _forward, _read
from hybridq.lookup.reads import RETENTION_S, index_path, job_row, sql_text
from hybridq.lookup.store import (
    _SCHEMA,
    CHUNK,
    _bare_rows,
    _chunks,
    _connect,
    _entries,
    _load_marks,
    _read_all,
    _save_marks,
    _stashed,
    _Tail,
    _upsert_jobs,
)
from hybridq.protocol import EntryKind, StartedEvent

__all__ = ["BUILD_STEP", "CHUNK", "PRUNE_CHUNK", "PRUNE_EVERY_S", "LookupIndex"]

log = logging.getLogger("hybridq.forwarder")
#: ``EntryKind.KEY``, read once: a member read from its Enum class goes through
#: ``EnumType.__getattr__``'s hook on Python 3.11 (about 900 instructions a read, once per job
#: here: docs/benchmarks.md, "The forwarder's writes per job, again").
_KEY = EntryKind.KEY

#: How often the forwarder sweeps the index for rows past their retention (seconds), and how
#: many rows it looks at per step of a sweep, a step at most every PRUNE_STEP_S.
PRUNE_EVERY_S = 600.0
PRUNE_CHUNK = 2000
PRUNE_STEP_S = 1.0
#: Journal records the index reads per forwarder step while it builds.
BUILD_STEP = 20000


class LookupIndex(EntryFold):
    """Keeps a journal's lookup index up to date (the forwarder owns the only one).

    Args:
        journal: the journal directory.
        clock: wall clock (retention).
    """

    def __init__(self, journal: str, clock: Callable[[], float] = time.time) -> None:
        self.journal = journal
        self.clock = clock
        self._db: sqlite3.Connection | None = None
        self._next_prune = clock() + PRUNE_STEP_S
        self._prune_from = ""  # where the retention sweep goes on (ids in order)
        #: What the forwarder read and wrote since the last flush (no file read, no parse).
        self._jobs: list[tuple[Any, ...]] = []
        self._entries: list[Entry] = []
        #: Started events harvested since the last flush, by job record (state ``started``:
        #: derived from no file, so a rebuild loses it until the job's next event).
        self._started: dict[tuple[str, int, int], tuple[Any, ...]] = {}
        #: Reading the journal itself (from the start, and after a failure), BUILD_STEP records
        #: per :meth:`catch_up`, until the index has read it all.
        self._building = True
        #: Where that read stops (``None``: at the journal's end): the forwarder's reader
        #: position when the read began. Every record past it is noted as the forwarder reads it,
        #: so the two never decode one record twice (docs/benchmarks.md, "The push path").
        self._build_to: dict[str, ChainPosition] | None = None
        #: Whether the forwarder's own ledger entries come through :meth:`note_entries`, and
        #: where its chain ends (its entries are not read back from the file): once the files
        #: were read to their end.
        self._fed = False
        self._own: dict[str, ChainPosition] = {}
        #: The integrity check of the file opened, while it runs (:meth:`open`), and what it
        #: found wrong until the file is replaced.
        self._check: IndexCheck | None = None
        self._damage: str | None = None
        #: Whether the ``ahead`` table may hold entries (not known at open: looked at once).
        self._ahead = True
        #: Called from the check's thread once its verdict is in (the forwarder's wake-up).
        self.on_checked: Callable[[], None] | None = None
        #: The ledger's ids files, decoded once while each stays the same.
        self._kept = KeptIds(ledger_dir(journal))

    def open(self, read_from: Mapping[str, ChainPosition] | None = None) -> None:
        """Open (or create) the index; a damaged file is replaced and rebuilt.

        One that SQLite cannot open is replaced at once; the rest of the file is checked on a
        thread (:class:`~hybridq.lookup.check.IndexCheck`): the first push does not wait for a
        read of the whole file, and the index counts as :attr:`building` until the verdict.

        Args:
            read_from: where the forwarder's reader starts; every record it reads from there on
                is noted (:meth:`note_job`, :meth:`note_record`), so the index reads the journal
                up to there only. ``None``: to the journal's end.
        """
        path = index_path(self.journal)
        ensure_journal_dir(os.path.dirname(path))
        self._damage = None
        try:
            self._db = _connect(path)
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            self._replace(path, exc)
        else:
            self._check = IndexCheck(path, done=self._wake)
            self._check.start()
        self._building, self._fed = True, False
        self._build_to = None if read_from is None else dict(read_from)

    def _replace(
        self, path: str, problem: object, read_to: Mapping[str, ChainPosition] | None = None
    ) -> None:
        """Delete the index file and start an empty one (read from the files again, to ``read_to``)."""
        log.warning("lookup index %s unusable (%s): rebuilding it", path, problem)
        self.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.unlink(path + suffix)
        self._db = _connect(path)
        self._db.executescript(_SCHEMA)
        self._building, self._fed = True, False
        self._build_to = None if read_to is None else dict(read_to)  # what was noted before is gone
        self._jobs, self._entries, self._own, self._started = [], [], {}, {}

    def _checked(self, read_to: Mapping[str, ChainPosition] | None) -> None:
        """Take the background check's verdict, once in: a damaged file is replaced.

        A replacement that fails (a full disk) is tried again at the next call; the index is
        not trusted meanwhile.
        """
        if self._check is not None:
            problem = self._check.verdict()
            if problem is None:
                return  # still reading: nothing is concluded from the index meanwhile
            if not problem and self._check.error is not None:
                # Not checked (busy, cannot open: tried again already): rebuilt, as it is only
                # a cache of the journal and cannot be trusted unchecked.
                problem = f"not checked: {self._check.error}"
            self._check, self._damage = None, problem or None
        if self._damage is None:
            return
        path = index_path(self.journal)
        try:
            self._replace(path, self._damage, read_to)
        except (sqlite3.Error, OSError) as exc:
            log.warning("lookup index %s not replaced yet (%s): lookups by id lag until it is", path, exc)
            self.close()
            return
        self._damage = None

    def _wake(self) -> None:
        if self.on_checked is not None:
            self.on_checked()

    def close(self) -> None:
        """Close the index file (a check still running is stopped first)."""
        if self._check is not None:
            self._check.stop()
            self._check = None
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def building(self) -> bool:
        """Whether the index is not to be trusted yet: not checked, or not read the whole journal.

        True at start (until the background check's verdict and a read of the files past the
        marks), and after a failure or a rebuild.
        """
        return self._building or self._check is not None or self._damage is not None

    def note_job(self, record: Record, env: Envelope) -> None:
        """The forwarder read ``env`` at ``record`` (indexed at the next :meth:`catch_up`)."""
        self._jobs.append(
            (
                env.id,
                record.writer_id,
                record.segment_index,
                record.offset,
                record.seq,
                env.requeue,
                env.created_at,
                env.func,
                env.queue,
                sql_text(env.idempotency_key),
            )
        )

    def note_record(self, record: Record) -> None:
        """The forwarder read ``record`` and decoded no job from it (finished already, or invalid).

        Its row, if it names a job id, as a read of the file would make it (the index reads
        no record the forwarder reads: :meth:`open`).
        """
        if record.rtype == RecordType.DATA and (row := job_row(record)) is not None:
            self._jobs.append(row)

    def note_entries(self, entries: Iterable[Entry], chain: str, end: ChainPosition) -> None:
        """The forwarder appended ``entries`` to its ledger chain ``chain``, which ends at ``end``.

        Indexed at the next :meth:`catch_up`, which reads that chain from ``end`` on only.
        """
        if self._fed:
            key = _KEY
            for e in entries:
                if e.kind != key:
                    self._entries.append(e)
                    self._started.pop(e.loc, None)  # the run's outcome (or a later one) is newer
            self._own[chain] = end

    def note_started(self, events: Iterable[StartedEvent]) -> None:
        """Workers claimed these runs (indexed at the next :meth:`catch_up`, after the entries).

        Each must be newer than every entry noted for its job (the harvester drops one whose
        outcome came in the same batch); one noted while the index reads the files is dropped.
        """
        if self._fed:
            for e in events:
                self._started[e.loc] = (e.job_attempt, e.at, e.id, *e.loc)

    def catch_up(self, read_to: Mapping[str, ChainPosition] | None = None) -> int:
        """Index what was noted, and what the files gained that was not; rows touched.

        Args:
            read_to: the forwarder's reader position: every job before it was noted (or indexed).

        The journal before the ledger: every ledger entry is about a record the forwarder read
        before it, so its row exists by then. Never raises for the index's own trouble (logged):
        lookups lag, forwarding goes on, and the next call reads the files again.
        """
        self._checked(read_to)
        if self._db is None:
            return 0
        try:
            done = self._catch_up(self._db, read_to or {})
            now = self.clock()
            if now >= self._next_prune:
                n, more = self._prune_some(now)
                done += n
                self._next_prune = now + (PRUNE_STEP_S if more else PRUNE_EVERY_S)
        except (sqlite3.Error, OSError, JournalCorruption) as exc:
            log.warning("lookup index not updated (%s): lookups by id lag until it is", exc)
            self._building, self._fed = True, False  # what was noted is lost: read the files
            self._build_to = None if read_to is None else dict(read_to)
            self._jobs, self._entries, self._own, self._started = [], [], {}, {}
            return 0
        return done

    def _catch_up(self, db: sqlite3.Connection, read_to: Mapping[str, ChainPosition]) -> int:
        marks = _load_marks(db)
        journal_to = {w[2:]: ChainPosition(*p) for w, p in marks.items() if w[:2] == "j:"}
        ledger_marks: dict[str, tuple[int, int, int]] = {w[2:]: p for w, p in marks.items() if w[:2] == "l:"}
        if self._fed and not self._building and not self._ahead:
            ledger_marks.update(self._own)  # its entries were noted: not read back
            ends = _read_all(ledger_dir(self.journal), ledger_marks, self._own)
            if ends is not None:
                # A forwarder's step (nothing of the files to read, no entry kept ahead): what
                # it noted goes in one transaction, rows before the entries about them, no
                # reader built (docs/benchmarks.md, "Fewer writes per job").
                _forward(journal_to, read_to)
                jobs, self._jobs = self._jobs, []
                return self._note(db, marks, journal_to, ends, jobs=jobs)
        touched = 0
        for rows in _chunks(self._jobs):
            with db:
                _upsert_jobs(db, rows)
            touched += len(rows)
        self._jobs = []
        if self._building:
            # The journal past the marks, BUILD_STEP records per step: a first build over a
            # large journal does not hold forwarding up. The ledger waits for its end (its
            # entries are about these jobs); lookups meanwhile read the journal past the marks.
            # Up to the forwarder's reader position at the open only: the records past it were
            # noted as the forwarder read them (upserted above), and are not decoded again.
            tail = _Tail(self.journal, journal_to, self._build_to)
            rows = [r for r in map(job_row, itertools.islice(tail, BUILD_STEP)) if r is not None]
            with db:
                _upsert_jobs(db, rows)
                _save_marks(db, tail.end(), ledger_marks)
            touched += len(rows)
            journal_to = tail.end()
            if tail.count == BUILD_STEP:
                return touched
            bounded, self._building = self._build_to is not None, False
        else:
            bounded = False
        _forward(journal_to, read_to)
        touched += self._apply_ahead(db, journal_to)
        if self._fed:
            ledger_marks.update(self._own)  # its entries were noted: not read back
        ledger = _Tail(ledger_dir(self.journal), ledger_marks)
        # In chunks, each its own transaction (the first read of a long ledger holds one chunk in
        # memory); the marks move last: a crash in between reads again (entries are idempotent).
        # The successes punched out of the ledger segments read from here on, from the ids kept
        # for them (docs/journal.md, "Entries punched out of pinned ledger segments").
        kept = self._kept.entries(ledger_marks)
        for entries in _chunks(itertools.chain(kept, _entries(ledger))):
            if bounded and not all(_read(journal_to, e.loc) for e in entries):
                # The ledger names a record the forwarder has not read yet (its checkpoint is
                # older than the ledger): its row would be missing. Read the journal to its end
                # first, as a build without a bound does, and the ledger again after.
                self._building, self._build_to = True, None
                return touched
            with db:
                _bare_rows(db, self.journal, entries)  # the ledger read whole: a build
                self._fold(db, entries, journal_to)
            touched += len(entries)
        return touched + self._note(db, marks, journal_to, ledger.end(), moved=bool(touched))

    def prune(self, now: float) -> int:
        """Drop every row past its retention (:data:`RETENTION_S`); how many."""
        self._prune_from = ""
        dropped, more = 0, True
        while more:
            n, more = self._prune_some(now)
            dropped += n
        return dropped

    def _prune_some(self, now: float) -> tuple[int, bool]:
        """Drop rows past their retention among the next :data:`PRUNE_CHUNK` ids of the sweep.

        A sweep goes through the ids in order, a chunk per call, so no call holds the forwarder
        for a full table scan. Returns how many went, and whether the sweep goes on.
        """
        if self._db is None:
            return 0, False
        first = {w: i[0] for w, i in list_chains(self.journal).items() if i}
        cutoff = now - RETENTION_S
        rows = self._db.execute(
            "SELECT id, writer, seg, coalesce(ended, enq, 0) FROM jobs WHERE id > ? ORDER BY id LIMIT ?",
            (self._prune_from, PRUNE_CHUNK),
        ).fetchall()
        # Gone: its segment is compacted (below its chain's first one, or its chain is gone).
        gone = [(i,) for i, w, seg, at in rows if at < cutoff and seg < first.get(w, sys.maxsize)]
        with self._db as db:
            db.executemany("DELETE FROM jobs WHERE id = ?", gone)
            if len(rows) < PRUNE_CHUNK:  # the sweep ends: chains gone whole lose their marks
                stale = [(f"j:{w}",) for w in _load_marks(db) if w[:2] == "j:" and w[2:] not in first]
                db.executemany("DELETE FROM marks WHERE chain = ?", stale)
                # Kept entries whose records were compacted away unread: never applied.
                never = [(i,) for i, e in _stashed(db) if e.loc[1] < first.get(e.loc[0], sys.maxsize)]
                db.executemany("DELETE FROM ahead WHERE rowid = ?", never)
        self._prune_from = rows[-1][0] if len(rows) == PRUNE_CHUNK else ""
        return len(gone), len(rows) == PRUNE_CHUNK
