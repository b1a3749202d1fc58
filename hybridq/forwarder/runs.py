"""The run table: jobs the forwarder has read and indexed but not pushed, waiting on disk.

A forwarder-private SQLite file, ``<journal>/runs/runs.sqlite`` (its open, schema, migration and
errors: :mod:`hybridq.forwarder.run_file`, which :class:`RunTable` inherits). One row per job
read while its queue's window in Redis was full (docs/forwarder.md, "The window"): where its
record is (the journal stays the only copy of the job), its queue, the order it runs in (when it
was accepted, or came due), its priority, its limit key ('' for none), its lane (the fair key it
is taken round robin under, '' for none: :mod:`hybridq.forwarder.selector` picks the rows) and,
for a row a claim's refusal put back (:mod:`hybridq.forwarder.refusals`), the refused attempt (0
for none). Nothing about it is kept in memory but a count per queue (and the rare rows put back):
the backlog costs about 100 bytes of disk per job and no RAM.

The rules that keep a job from being lost or pushed twice:

* **Indexed, then read past.** Rows are committed before the checkpoint's positions move past
  their records (:meth:`commit` is called before the checkpoint is saved). The positions now
  mean "pushed, or waiting here"; a crash in between reads the records again, and
  ``INSERT OR IGNORE`` keeps one row each.
* **Pushed, then deleted.** A row goes only after the transport accepted its job; a crash in
  between pushes it again, and the job id absorbs the copy (invariant 5, per row). Its job's
  row in the list of pushed jobs (:mod:`hybridq.forwarder.pushed`, a table of this file) is
  written in the same commit.
* A row whose job became terminal, or was cancelled, is deleted without a push by the refill.

A lost or damaged file loses no job: every record before the positions without a row is taken
for pushed, and the reconcile pass delivers what Redis does not have, as the windows and the
memory gate have room (``Reconciler.admit``): slower, not a loss and not a flood.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from hybridq.forwarder.run_file import RUNS_DIR, RUNS_FILE, RunFile
from hybridq.transport.base import Loc

if TYPE_CHECKING:
    from hybridq.envelope.model import Envelope

__all__ = ["RUNS_DIR", "RUNS_FILE", "Row", "RunTable", "row_of"]


_INSERT = (
    "INSERT OR IGNORE INTO runs (chain, seg, off, queue, ord, prio, lkey, lane, back)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_DELETE = "DELETE FROM runs WHERE chain = ? AND seg = ? AND off = ?"
_PRIO = "SELECT prio FROM runs WHERE chain = ? AND seg = ? AND off = ?"

#: One row as :meth:`RunTable.add` takes it: location, queue, order, priority, limit key ('' none).
Row = tuple[Loc, str, float, int, str]


class RunTable(RunFile):
    """The waiting jobs of one journal (see the module docstring). Open it under the forwarder's lock."""

    def __init__(self, journal: str) -> None:
        self.path = os.path.join(journal, RUNS_DIR, RUNS_FILE)
        self._db: sqlite3.Connection | None = None
        #: Waiting jobs per queue (rows), kept with every change.
        self.counts: dict[str, int] = {}
        #: Waiting jobs per queue and priority (what stats show; a dozen numbers per queue).
        self.prios: dict[str, dict[int, int]] = {}
        #: The lane of a limit key (the selector sets it: '' unless the key is a fair key).
        self.lane_of: Callable[[str], str] = _no_lane
        #: Whether the counts changed since the last commit (written with it).
        self._counted = False
        #: The rows a claim's refusal put back (:mod:`hybridq.forwarder.refusals`): the refused
        #: attempt of each (column ``back``; 0, and not here: never pushed). Rare: kept in memory.
        self.backs: dict[Loc, int] = {}

    @property
    def total(self) -> int:
        """Waiting jobs, all queues."""
        return sum(self.counts.values())

    def waiting(self, queue: str) -> int:
        """Waiting jobs of ``queue``."""
        return self.counts.get(queue, 0)

    def add(self, rows: Iterable[Row], back: Sequence[int] = ()) -> None:
        """Insert rows (:data:`Row`; an existing row is kept): durable at :meth:`commit`.

        ``back``: per row, the attempt a claim refused (rows a refusal put back; see :attr:`backs`).
        The rows go in one ``executemany`` (a statement per row cost about 4k instructions more
        in Python, docs/benchmarks.md "Fewer writes per job"); when some were there already (a
        batch read again after a crash or a failed step), that is undone and they go row by row,
        as each row's insert says whether it was new.
        """
        lane_of = self.lane_of
        params = [
            (chain, seg, off, queue, order, prio, key, lane_of(key) if key else "", back[i] if back else 0)
            for i, ((chain, seg, off), queue, order, prio, key) in enumerate(rows)
        ]
        if not params:
            return
        with self.errors():
            db = self.db
            if len(params) == 1:  # its insert says whether it was new: no savepoint (a held job come due)
                self._count_in(params if db.execute(_INSERT, params[0]).rowcount else [])
                return
            db.execute("SAVEPOINT hq_add")
            inserted = params
            try:
                if db.executemany(_INSERT, params).rowcount != len(params):
                    db.execute("ROLLBACK TO hq_add")
                    inserted = [p for p in params if db.execute(_INSERT, p).rowcount]
            except BaseException:
                # None of these rows: the counts stay true. A full disk may have rolled back the
                # whole transaction, the savepoint with it: the error raised is the first one.
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK TO hq_add")
                        db.execute("RELEASE hq_add")
                raise
            db.execute("RELEASE hq_add")
            self._count_in(inserted)

    def _count_in(self, inserted: list[tuple[str, int, int, str, float, int, str, str, int]]) -> None:
        """Count rows just inserted (their ``_INSERT`` parameters) in :attr:`counts` and :attr:`prios`."""
        if not inserted:
            return
        self._counted = True
        counts, prios, backs = self.counts, self.prios, self.backs
        for chain, seg, off, queue, _order, prio, _key, _lane, refused in inserted:
            counts[queue] = counts.get(queue, 0) + 1
            by = prios.setdefault(queue, {})
            by[prio] = by.get(prio, 0) + 1
            if refused:
                backs[chain, seg, off] = refused

    def select(self, sql: str, params: Sequence[object]) -> list[tuple[Loc, float, str, int]]:
        """``(loc, ord, lkey, prio)`` of the rows a selector's query finds (those columns, in order)."""
        with self.errors():
            rows = self.db.execute(sql, params)
            # SQLite gives these columns' types back as they were stored (INTEGER, REAL, TEXT).
            return [((chain, seg, off), order, key, prio) for chain, seg, off, order, key, prio in rows]

    def lanes(self, lane_of: Callable[[str], str], signature: str) -> None:
        """Use ``lane_of`` for new rows, and relane the rows if the fair keys changed since.

        ``signature`` names the fair keys; a file whose rows were laned under others is laned
        again once (O(rows), at start only), so that every row's lane matches ``lane_of``.
        """
        self.lane_of = lane_of
        with self.errors():
            db = self.db
            row = db.execute("SELECT value FROM meta WHERE name = 'lanes'").fetchone()
            if (row[0] if row else "") == signature:
                return
            db.create_function("hq_lane", 1, lambda key: lane_of(key) if key else "", deterministic=True)
            db.execute("UPDATE runs SET lane = hq_lane(lkey) WHERE lane != hq_lane(lkey)")
            db.execute("INSERT OR REPLACE INTO meta VALUES ('lanes', ?)", (signature,))
        self.commit()

    def oldest(self, queue: str) -> float | None:
        """The order (a Unix time) of ``queue``'s first waiting job, if any."""
        with self.errors():
            row = self.db.execute("SELECT min(ord) FROM runs WHERE queue = ?", (queue,)).fetchone()
            return None if row is None or row[0] is None else float(row[0])

    def remove(self, queue: str, locs: Sequence[Loc], prios: Sequence[int] | None = None) -> None:
        """Delete rows of ``queue`` (pushed, or terminal): durable at :meth:`commit`.

        ``prios``: the rows' priorities, when the caller read them (else each delete returns it).
        """
        with self.errors():
            db = self.db
            self._counted = self._counted or bool(locs)
            by = self.prios.setdefault(queue, {})
            if self.backs:
                for loc in locs:
                    self.backs.pop(loc, None)
            if prios is not None:
                if db.executemany(_DELETE, locs).rowcount == len(locs):
                    for gone in prios:  # all were there (what a refill deletes): counted at once
                        by[gone] -= 1
                    self.counts[queue] = self.counts.get(queue, 0) - len(locs)
                else:  # some were not (never seen): count the queue's rows again
                    by.clear()
                    by.update(
                        db.execute("SELECT prio, count(*) FROM runs WHERE queue = ? GROUP BY prio", (queue,))
                    )
                    self.counts[queue] = sum(by.values())
                for empty in [p for p, n in by.items() if not n]:
                    del by[empty]
            else:
                for chain, seg, off in locs:  # (no RETURNING: SQLite before 3.35, as RHEL 9's, has none)
                    row = db.execute(_PRIO, (chain, seg, off)).fetchone()
                    if row is None:
                        continue
                    prio = int(row[0])
                    db.execute(_DELETE, (chain, seg, off))
                    self.counts[queue] = self.counts.get(queue, 0) - 1
                    by[prio] = by.get(prio, 0) - 1
                    if not by[prio]:
                        del by[prio]
            if self.counts.get(queue) == 0:
                del self.counts[queue]
            if not by:
                del self.prios[queue]

    def contains(self, loc: Loc) -> bool:
        """Whether the job at ``loc`` waits here: never pushed, or put back by a claim's refusal.

        A row put back (:attr:`backs`) may still have a copy in Redis.
        """
        with self.errors():
            if not self.counts:
                return False
            row = self.db.execute(
                "SELECT 1 FROM runs WHERE chain = ? AND seg = ? AND off = ?", (loc[0], loc[1], loc[2])
            ).fetchone()
            return row is not None

    def rollback(self) -> None:
        """Drop every change since the last commit (a step that failed part-way reads again)."""
        with self.errors():
            self._reset()

    def _reset(self) -> None:
        db = self.db
        if db.in_transaction:
            db.execute("ROLLBACK")
        db.execute("BEGIN")
        self.counts, self.prios, self._counted = {}, {}, False
        self.backs = {
            (c, sg, o): int(b)
            for c, sg, o, b in db.execute("SELECT chain, seg, off, back FROM runs WHERE back > 0")
        }
        for q, prio, n in db.execute("SELECT queue, prio, n FROM counts WHERE n > 0"):
            self.counts[q] = self.counts.get(q, 0) + int(n)
            self.prios.setdefault(q, {})[int(prio)] = int(n)

    def commit(self) -> None:
        """Make every change since the last commit durable (fsync), and begin the next."""
        with self.errors():
            db = self.db
            if self._counted:
                db.execute("DELETE FROM counts")
                db.executemany(
                    "INSERT INTO counts VALUES (?, ?, ?)",
                    ((q, p, n) for q, by in self.prios.items() for p, n in by.items() if n),
                )
                self._counted = False
            if db.in_transaction:
                db.execute("COMMIT")
            db.execute("BEGIN")


def row_of(loc: Loc, env: Envelope, order: float | None = None) -> Row:
    """The row of the job ``env`` read at ``loc`` (its order: acceptance, or ``order``: its ``run_at``)."""
    return (loc, env.queue, env.created_at if order is None else order, env.priority, env.limit_key or "")


def _no_lane(key: str) -> str:  # noqa: ARG001 - a lane function's signature
    return ""
