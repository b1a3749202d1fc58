"""Workflows and ``depends_on``, driven from the ledger (docs/workflows.md).

The forwarder holds one :class:`Flows`. While reading the journal it hands it each job
(:meth:`Flows.intercept`); two kinds never reach the transport:

* a workflow's **anchor** (one record with the whole graph, :mod:`hybridq.workflows.canvas`):
  recorded in the workflows' file (:mod:`hybridq.workflows.store`) with its steps ``waiting``;
* a job with **depends_on**: recorded in ``waits``.

Both are in :attr:`Flows.held` (in memory, O(live ones)), which the reconcile pass skips, so a
Redis wipe never pushes them. :meth:`Flows.step` (once per forwarder step, after the lookup
index caught up with the ledger) moves them on with what the ledger holds:

* a step whose dependencies all succeeded is **released**: its job is appended to the journal
  (its own chain, fsync'd) with a deterministic id and the idempotency key ``wf:<id>:<n>``, its
  arguments led by the results it takes; then the step is marked ``released`` (committed). A
  crash in between appends it again on restart: the key makes that copy a ``duplicate``, never
  a second run (as the scheduler's ticks, docs/schedules.md). From then on it is an ordinary
  job (window, retries, cancel, ledger);
* a dependent job whose dependencies all succeeded is put in the run table (its existing
  insert path) and the refill pushes it;
* outcomes and results are read from the lookup index, which the forwarder fills from the
  ledger after its fsync (never from Redis): a callback's release needs every member's success
  durably recorded, and a repeated release is a duplicate, so it runs once;
* a step that failed for good fails its workflow: steps not released are ``cancelled``, released
  ones not started get a cancel, ``on_error`` is released once, and the anchor gets its ``done``
  entry in the ledger (``failed``); a success gets ``done succeeded`` with the final result.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.forwarder.flow_drive import FlowDriver
from hybridq.forwarder.flow_file import load_held, open_flows_file
from hybridq.forwarder.flow_steps import deps_verdict, graph_problem
from hybridq.forwarder.flow_waits import release_waiters
from hybridq.forwarder.runs import RunTable
from hybridq.forwarder.state import ForwarderState
from hybridq.ledger.entries import Entry
from hybridq.transport.base import Loc
from hybridq.workflows.canvas import ANCHOR_FUNC, STEP_SEP, step_prefix

__all__ = ["Flows"]

log = logging.getLogger("hybridq.forwarder")

#: How often held workflows are looked at with no news (an outcome the index had not yet).
LOOK_EVERY_S = 5.0
_LIVE_FLOWS = "SELECT id, chain, seg, off, queue, graph FROM flows WHERE state = 'running'"


class Flows(FlowDriver):
    """The forwarder's workflows and dependent jobs (see the module docstring).

    What moves one workflow on (its steps released, its end) is :class:`FlowDriver`'s.
    """

    def __init__(
        self,
        state: ForwarderState,
        runs: Callable[[], RunTable],
        envelope_of: Callable[[Loc], Envelope | None],
    ) -> None:
        super().__init__(state)
        #: A job's envelope by its loc (``records.envelope_at``: a released job's priority and key).
        self._envelope_of = envelope_of
        self._runs = runs
        #: Something may have moved (new records, new outcomes): :meth:`step` looks again.
        self.dirty = True
        self._unknown_since: dict[str, float] = {}
        #: Set before each :meth:`step`: the reader stopped short of a chain's end. No unknown
        #: dependency's clock starts then: it may be in a chain not read yet (docs/journal.md);
        #: clocks started before run on.
        self.behind = False
        self._next_look = 0.0
        #: Ids of jobs with outcomes since the last pass (:meth:`noted`).
        self._news: set[str] = set()
        #: Whether the open transaction holds writes :meth:`commit` must make durable.
        self._recorded = False
        #: Jobs released since start.
        self.released = 0

    # -- life cycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Open (or create) the workflows' file and load what is held."""
        db = open_flows_file(self.journal)
        db.execute("BEGIN")
        self._db = db
        self._load_held()
        self.dirty = True

    def close(self) -> None:
        """Commit and close the file, seal the steps' chain. Idempotent."""
        db, self._db = self._db, None
        if db is not None:
            with contextlib.closing(db):
                if db.in_transaction:
                    db.execute("COMMIT")
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def commit(self) -> None:
        """Make what :meth:`intercept` recorded durable (before the checkpoint moves past it).

        Free when nothing was recorded: the forwarder calls it with every batch.
        """
        if self._recorded:
            self._end_transaction("COMMIT")
            self._recorded = False

    def rollback(self) -> None:
        """Drop what was recorded since the last commit (the step is read again)."""
        self._end_transaction("ROLLBACK")
        self._recorded = False
        self._load_held()

    def _end_transaction(self, how: str) -> None:
        db = self.db
        if db.in_transaction:
            db.execute(how)
        db.execute("BEGIN")

    def _load_held(self) -> None:
        """Reload :attr:`held` from the file."""
        self.held, self._hashed = load_held(self.db)

    # -- reading the journal ------------------------------------------------------------------

    def intercept(self, env: Envelope, loc: Loc) -> bool:
        """Whether the job read at ``loc`` is held here (an anchor, or it waits for others)."""
        hq = env.meta.get("hybridq") if env.meta else None
        if not isinstance(hq, Mapping):
            return False
        self._recorded = True
        if env.func == ANCHOR_FUNC and isinstance(hq.get("wf"), Mapping):
            self._accept_flow(env, loc, hq["wf"])
            return True
        deps = hq.get("deps")
        if isinstance(deps, list) and deps:
            self.db.execute(
                "INSERT OR IGNORE INTO waits VALUES (?, ?, ?, ?, ?, ?)",
                (*loc, env.id, env.queue, json.dumps([str(d) for d in deps])),
            )
            self.held.add(loc)
            self._news.add(env.id)  # its dependencies may have ended already
            return True
        return False

    def holds(self, env: Envelope, loc: Loc) -> bool:
        """Whether a job about to be pushed again (a refill or reconcile pass) must stay here.

        Decided from its record, not only from :attr:`held`: with the workflows' file lost or
        restored from an older copy, :attr:`held` misses them. An anchor is never pushed; a job
        with ``depends_on`` only once the ledger holds every dependency succeeded. Either is
        recorded again (:meth:`intercept`) and moved on by :meth:`step` as if just read.
        """
        if loc in self.held:
            return True
        hq = env.meta.get("hybridq") if env.meta else None
        deps = hq.get("deps") if isinstance(hq, Mapping) else None
        if env.func != ANCHOR_FUNC:
            if not isinstance(deps, list) or not deps:
                return False
            now, dep_ids = time.monotonic(), [str(d) for d in deps]
            # Mid-read: no unknown dependency's clock starts here (docs/journal.md, "Chains").
            verdict = deps_verdict(self.journal, dep_ids, now, self._unknown_since, start=False)
            if verdict == "":
                return False  # released before (the run table pushed it): an ordinary job now
        if not self.intercept(env, loc):
            self.state.record_invalid(loc, env.id)  # an anchor without a graph: never a job
            log.error("job %s: a workflow's record without its graph: recorded invalid", env.id)
        self.dirty = True
        return True

    def _accept_flow(self, env: Envelope, loc: Loc, graph: Mapping[str, Any]) -> None:
        why = graph_problem(graph)
        if why is not None:
            # One bad record must not stop forwarding (docs/security.md): terminal, and said.
            log.error("workflow %s: not a graph this version can run (%s): recorded invalid", env.id, why)
            self.state.record_invalid(loc, env.id)
            return
        steps = graph.get("steps")
        cur = self.db.execute(
            "INSERT OR IGNORE INTO flows VALUES (?, ?, ?, ?, ?, ?, 'running', NULL)",
            (env.id, *loc, env.queue, json.dumps(graph)),
        )
        if cur.rowcount and isinstance(steps, list):
            self.db.executemany(
                "INSERT OR IGNORE INTO steps VALUES (?, ?, 'waiting')",
                [(env.id, n) for n in range(len(steps))],
            )
            self.held.add(loc)
            if step_prefix(env.id) != env.id:
                self._hashed[step_prefix(env.id)] = env.id
        elif self.db.execute(
            "SELECT 1 FROM flows WHERE id = ? AND (chain, seg, off) != (?, ?, ?)", (env.id, *loc)
        ).fetchone():
            # Its id is another workflow's (enqueued again under it, or requeued): its steps'
            # ids and keys would be that one's. Terminal, never pushed, and said.
            log.error("workflow %s: a workflow with this id exists already: recorded invalid", env.id)
            self.state.record_invalid(loc, env.id)
        self._news.add(env.id)  # its first steps are released at the next pass

    # -- moving them on -----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether outcomes came that :meth:`step` has not looked at (the loop must not idle)."""
        return bool(self._news) and bool(self.held)

    def noted(self, entries: Sequence[Entry]) -> None:
        """Outcomes just appended to the ledger (its ``on_append``): their workflows are looked at."""
        if self.held:
            self._news.update(e.job_id for e in entries if e.kind in ("done", "cancel"))

    def step(self) -> int:
        """Release what became ready, end what ended; return how many jobs were released.

        Only the workflows and waiting jobs an outcome concerns are looked at, so a pass costs
        in proportion to the news (outcomes, and workflows and waiting jobs just read), not to
        every live workflow; all of them are looked at when the forwarder starts and every
        :data:`LOOK_EVERY_S` (an outcome the lookup index did not have yet when its news came is
        found then).
        """
        news, self._news = self._news, set()
        everything = self.dirty or time.monotonic() >= self._next_look
        if not self.held or not (everything or news):
            return 0
        if everything:
            self.dirty = False
            self._next_look = time.monotonic() + LOOK_EVERY_S
            flows = self.db.execute(_LIVE_FLOWS).fetchall()
        else:
            prefixes = {i.rsplit(STEP_SEP, 1)[0] for i in news}  # an anchor's id, or a step's workflow
            ids = news | {self._hashed.get(p, p) for p in prefixes}
            flows = [row for fid in ids for row in self.db.execute(_LIVE_FLOWS + " AND id = ?", (fid,))]
        released = 0
        for fid, chain, seg, off, queue, graph in flows:
            anchor = (chain, int(seg), int(off))
            parsed = self._graphs.get(fid) or self._graphs.setdefault(fid, json.loads(graph))
            released += self._advance(fid, anchor, queue, parsed, None if everything else news)
        waiters = release_waiters(
            self.state,
            self.db,
            self._runs,
            self.held,
            self._unknown_since,
            not self.behind,  # a clock starts only after every chain was read to its end
            None if everything else news,
            self._envelope_of,
        )
        released += waiters[0]
        self.ended += waiters[1]
        self._recorded = True
        self.commit()
        self.released += released
        return released
