"""What the forwarder pushed and is not terminal yet: the refill and reconcile passes' list.

A table ``pushed`` in the run table's file (:mod:`hybridq.forwarder.runs`): one row per job
pushed into Redis whose outcome is not in the ledger, with the number of the interval (between
two writes of the list) in which it was pushed: a sequence, not a clock, that a clock stepping
back cannot reorder. A refill after
Redis lost its state, and a reconcile pass, read these rows' records and nothing else: O(jobs in
Redis), whatever waits in the journal (docs/forwarder.md, "The window").

The rules that keep it complete (docs/reliability.md, "The run table"):

* **Pushed, then written.** A row is written only after Redis accepted its job. A job pushed
  from the run table leaves its ``runs`` row and gets its ``pushed`` row in one commit. A job
  pushed as it was read is noted in memory and written at the next :meth:`PushedJobs.flush` (at
  most :data:`FLUSH_EVERY_S` later, one fsync), with the **mark**: the checkpoint positions the
  table covers (written once a second while the positions move, pushes or not). A crash before
  that leaves records between the mark and the checkpoint whose rows were not written; the next
  start reads them again (:meth:`PushedJobs.open`: O(one flush interval of reading)) and writes
  a row for each that is neither terminal nor waiting (a row a claim's refusal put back in the
  run table is not waiting: it was pushed). A job put back (:mod:`hybridq.forwarder.refusals`)
  gets its row in the put-back's commit.
* **Terminal, then marked.** A row is marked finished after its job's outcome is in the ledger
  (written at the next flush; a row a crash left unmarked is marked by the next pass that reads
  it: the ledger says it is terminal). The newest ``recent`` finished rows are kept: a refill
  purges the queued copies of those jobs a restored Redis brought back (older copies are
  refused by the generation at claim); older ones are deleted.
* **Never trusted when unknown.** A file without a mark (new, damaged and moved aside, written by
  an older version) gets a row for every record before the checkpoint that is neither terminal
  nor waiting nor a duplicate, read from the journal once (O(live journal), logged).

This module must not import redis or rq.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from collections.abc import Iterable

from hybridq.forwarder.runs import RunTable
from hybridq.journal import ChainPosition, JournalReader, Record, RecordType
from hybridq.journal.format import FILE_HEADER_SIZE
from hybridq.journal.reader import list_chains, read_record_at, seal_offset
from hybridq.ledger.index import LedgerIndex
from hybridq.transport.base import Loc

__all__ = ["FLUSH_EVERY_S", "PushedJobs", "read_pushed"]

log = logging.getLogger("hybridq.forwarder")

#: Jobs pushed as read are written to the table at most this long after (seconds).
FLUSH_EVERY_S = 1.0
#: ... or once this many changes wait in memory.
FLUSH_AT = 5000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pushed (
    chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL, at REAL NOT NULL,
    done REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (chain, seg, off)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pushed_done ON pushed(done) WHERE done > 0;
"""
_INSERT = "INSERT OR IGNORE INTO pushed VALUES (?, ?, ?, ?, 0)"
#: A job pushed and finished since the last flush: its row, finished (a row there is marked).
_INSERT_DONE = (
    "INSERT INTO pushed VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (chain, seg, off) DO UPDATE SET done = excluded.done"
)
#: Finished: marked (after the inserts of the same flush).
_FINISH = "UPDATE pushed SET done = ? WHERE chain = ? AND seg = ? AND off = ?"
_DELETE = "DELETE FROM pushed WHERE chain = ? AND seg = ? AND off = ?"
#: All but the newest ``?`` finished rows.
_TRIM = (
    "DELETE FROM pushed WHERE done > 0 AND done <= "
    "(SELECT done FROM pushed WHERE done > 0 ORDER BY done DESC LIMIT 1 OFFSET ?)"
)


class PushedJobs:
    """The jobs in Redis (pushed, not terminal) of one forwarder (see module docstring).

    Args:
        runs: the run table, whose file and transaction it shares.
        recent: how many finished rows are kept (of all queues together), for a refill to purge
            their jobs' queued copies a restored Redis brought back (older ones are fenced by the
            generation alone).
    """

    def __init__(self, runs: RunTable, recent: int) -> None:
        self.runs = runs
        #: Pushed as read, not written yet: loc -> the interval it was pushed in.
        self._adds: dict[Loc, int] = {}
        #: Terminal, not marked yet: loc -> when.
        self._done: dict[Loc, float] = {}
        #: Gone (their records compacted or cut), not deleted yet.
        self._dels: set[Loc] = set()
        self._next_flush = 0.0
        #: The positions the mark on disk holds (what :meth:`flush` last wrote).
        self._marked: dict[str, ChainPosition] = {}
        self.recent = recent
        #: Whether :meth:`open` caught up (before, a mark written would cover rows never written).
        self._ready = False
        #: The interval jobs pushed now belong to (a row's ``at``): one more at each write and at
        #: each :meth:`cut`; kept in the file, so it only grows.
        self.seq = 1
        #: (monotonic time, first interval after it): the first entry stands for "before this
        #: process started" (rows of an earlier run are old enough for any pass).
        self._starts: collections.deque[tuple[float, int]] = collections.deque([(-math.inf, 1)])

    def open(self, journal: str, positions: dict[str, ChainPosition], index: LedgerIndex) -> None:
        """Create the table; write the rows a crash (or a file without a mark) left unwritten."""
        with self.runs.errors():
            self.runs.db.executescript(_SCHEMA)
            row = self.runs.db.execute("SELECT value FROM meta WHERE name = 'pushed_mark'").fetchone()
            seq = self.runs.db.execute("SELECT value FROM meta WHERE name = 'pushed_seq'").fetchone()
            if seq is None:  # rows a version that wrote wall times left: old enough for any pass
                self.runs.db.execute("UPDATE pushed SET at = 0")
        self.seq = 1 if seq is None else int(seq[0]) + 1
        self._starts = collections.deque([(-math.inf, self.seq)])
        mark = None if row is None else {c: ChainPosition(*p) for c, p in json.loads(row[0]).items()}
        found = self._catch_up(journal, positions, {} if mark is None else mark, index)
        if mark is None and positions:
            log.warning(
                "the run table had no list of the jobs pushed (new, damaged, or written by an "
                "older version): rebuilt from the journal and the ledger (%d jobs)",
                found,
            )
        self._ready = True
        self.flush(positions)

    def _catch_up(
        self,
        journal: str,
        positions: dict[str, ChainPosition],
        mark: dict[str, ChainPosition],
        index: LedgerIndex,
    ) -> int:
        """Note every record between ``mark`` and ``positions`` pushed and not terminal."""
        found = 0
        chains = list_chains(journal)
        # Every other chain past its end: one chain read at a time, from its mark to its position.
        skip = {other: ChainPosition(segs[-1] + 1, FILE_HEADER_SIZE, 0) for other, segs in chains.items()}
        for chain, indices in chains.items():
            end = positions.get(chain)
            start = mark.get(chain)
            if end is None or (start is not None and start[:2] >= end[:2]):
                continue  # nothing of it read yet, or all of it written
            since = {other: at for other, at in skip.items() if other != chain}
            if start is not None and start.segment >= indices[0]:
                since[chain] = start  # (a mark in a compacted segment: from the first one left)
            for record in JournalReader(journal).records(since):
                if not record.consumed_by(positions):
                    break
                if _pushed_candidate(record, index, self.runs):
                    self._adds[(chain, record.segment_index, record.offset)] = 0  # reconciled at once
                    found += 1
        return found

    def add(self, locs: Iterable[Loc]) -> None:
        """Note jobs just pushed as read (written at the next :meth:`flush`)."""
        for loc in locs:
            self._adds[loc] = self.seq
            self._dels.discard(loc)

    def insert(self, locs: Iterable[Loc]) -> None:
        """Write rows for jobs just pushed from the run table, in its open transaction."""
        seq = self.seq
        with self.runs.errors():
            self.runs.db.executemany(_INSERT, ((*loc, seq) for loc in locs))

    def listed(self, loc: Loc) -> bool:
        """Whether the job at ``loc`` is on the list (noted in memory, or written and not finished)."""
        if loc in self._adds:
            return True
        if loc in self._dels or loc in self._done:
            return False
        with self.runs.errors():
            row = self.runs.db.execute(
                "SELECT 1 FROM pushed WHERE chain = ? AND seg = ? AND off = ? AND done = 0", loc
            ).fetchone()
        return row is not None

    def done(self, loc: Loc) -> None:
        """The job at ``loc`` is durably terminal: its row is marked finished (at the next flush)."""
        self._done[loc] = time.time()

    def drop(self, loc: Loc) -> None:
        """Forget the job at ``loc`` (its record is gone)."""
        self._adds.pop(loc, None)
        self._done.pop(loc, None)
        self._dels.add(loc)

    def due(self, positions: dict[str, ChainPosition]) -> bool:
        """Whether changes, or a mark behind ``positions``, wait long enough (or many enough).

        The mark moves once a second with the positions even when nothing was pushed (a backlog
        indexed into the run table): a start after a crash reads O(a second) of records again.
        """
        changes = len(self._adds) + len(self._done) + len(self._dels)
        if changes >= FLUSH_AT:
            return True
        return (bool(changes) or positions != self._marked) and time.monotonic() >= self._next_flush

    def flush(self, positions: dict[str, ChainPosition]) -> None:
        """Write what waits in memory and the mark (``positions``: the checkpoint's), and commit.

        Called where the run table may be committed (nothing pushed and not yet accepted).
        """
        if not self._ready:
            return
        with self.runs.errors():
            db = self.runs.db
            adds, done = self._adds, self._done
            # A job pushed and finished within one interval (most, in a burn): its row written
            # once, finished, instead of an insert and an update (docs/benchmarks.md, "Fewer
            # writes per job"); the same rows as the two statements, in the same commit.
            both = adds.keys() & done.keys() if adds and done else set()
            db.executemany(_INSERT, ((*loc, at) for loc, at in adds.items() if loc not in both))
            db.executemany(_INSERT_DONE, ((*loc, adds[loc], done[loc]) for loc in both))
            db.executemany(_FINISH, ((at, *loc) for loc, at in done.items() if loc not in both))
            db.executemany(_DELETE, self._dels)
            if self._done:
                db.execute(_TRIM, (self.recent,))
            mark = json.dumps({c: list(p) for c, p in positions.items()}, separators=(",", ":"))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('pushed_mark', ?)", (mark,))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('pushed_seq', ?)", (str(self.seq),))
        self.runs.commit()
        self._adds, self._done, self._dels = {}, {}, set()
        self._marked = dict(positions)
        self._next_flush = time.monotonic() + FLUSH_EVERY_S
        self.cut()

    def cut(self) -> int:
        """Begin the next interval; return its number (every job pushed before has a lower one)."""
        self.seq += 1
        self._starts.append((time.monotonic(), self.seq))
        return self.seq

    def pushed_before(self, age_s: float) -> int:
        """An interval number below which every row's job was pushed at least ``age_s`` ago."""
        when = time.monotonic() - age_s
        while len(self._starts) > 1 and self._starts[1][0] <= when:
            self._starts.popleft()  # the newest start old enough is kept, and all after it
        return self._starts[0][1]

    def after(self, cursor: Loc | None, pushed_before: int, n: int, *, finished: bool) -> list[Loc]:
        """Up to ``n`` rows after ``cursor`` (loc order) of jobs pushed in intervals below ``pushed_before``.

        ``finished``: the kept finished rows too (a refill purges their copies). Rows noted in
        memory are not seen: the caller flushes first (a pass, as it starts).
        """
        live = "" if finished else "AND done = 0 "
        with self.runs.errors():
            rows = self.runs.db.execute(
                f"SELECT chain, seg, off FROM pushed WHERE (chain, seg, off) > (?, ?, ?) AND at < ? {live}"  # noqa: S608 - no input
                "ORDER BY chain, seg, off LIMIT ?",
                (*(cursor or ("", -1, -1)), pushed_before, n),
            ).fetchall()
        return [(chain, seg, off) for chain, seg, off in rows]

    def count(self) -> int:
        """Jobs pushed and not terminal as far as written, plus those noted since (tests, doctor)."""
        with self.runs.errors():
            row = self.runs.db.execute("SELECT count(*) FROM pushed WHERE done = 0").fetchone()
        return int(row[0]) + len(self._adds)


def _pushed_candidate(record: Record, index: LedgerIndex, runs: RunTable) -> bool:
    """Whether a record read before the checkpoint may be a job in Redis (a superset: passes filter)."""
    if record.rtype != RecordType.DATA:
        return False
    loc = (record.writer_id, record.segment_index, record.offset)
    if index.is_terminal(loc) or loc in index.duplicates:
        return False
    # A row a claim's refusal put back is a pushed job (its copy may run): listed all the same.
    return loc in runs.backs or not runs.contains(loc)


def read_pushed(journal: str, loc: Loc) -> Record | None:
    """The record of a pushed job; ``None`` if it is gone (compacted, or cut by recovery or repair).

    Damage is :class:`~hybridq.errors.JournalCorruption` (loud), as every re-read.
    """
    seal_at = seal_offset(journal, loc[0], loc[1])
    if seal_at is not None and loc[2] >= seal_at:
        return None
    try:
        return read_record_at(journal, *loc)
    except FileNotFoundError:
        return None
