"""Cancellation, the forwarder side: cancel requests in, ``cancelled`` outcomes out.

Each step (before anything is pushed), :meth:`Canceller.step`:

1. takes in the request files :func:`hybridq.cancel` wrote (``<journal>/cancel/``): a ``cancel``
   entry per job in the ledger (one fsync), then the file is deleted;
2. settles every job with a cancel asked for that is not terminal yet: each is marked cancelled
   in the backend and taken off its queue (:meth:`Transport.cancel`); one never pushed (not
   read yet, held until its time, a duplicate waiting for its key's owner, in the run table)
   is then ``cancelled`` at once, a pushed one as soon as no worker holds its lease. A mark the
   backend refused (down, or OOM) settles nothing: it is asked again.
   While one does, the job is asked again every :data:`RECHECK_S`: the worker stops it
   (docs/worker.md) and reports ``cancelled``, or it ends on its own first (its outcome stands).

Jobs with a cancel asked for are never delivered again: the retry, reconcile and refill paths
skip them (:attr:`LedgerIndex.cancels`), so neither a lost worker nor Redis losing its state
brings one back; the ledger's ``cancel`` entry outlives both.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import logging
import math
import os
import time

from hybridq.cancels import read_requests
from hybridq.errors import TransportError
from hybridq.forwarder.records import envelope_at
from hybridq.forwarder.state import ForwarderState
from hybridq.ledger.entries import Entry
from hybridq.protocol import EntryKind, Outcome
from hybridq.transport.base import Loc, Probe, Transport

__all__ = ["RECHECK_S", "Canceller"]

log = logging.getLogger("hybridq.forwarder")

#: How often a cancelled job that a worker still runs is looked at again (seconds).
RECHECK_S = 1.0


class Canceller:
    """Takes cancel requests in and settles them (see the module docstring).

    Args:
        state: the forwarder's state (ledger, checkpoint).
        transport: the backend, which marks pushed jobs cancelled.
    """

    def __init__(self, state: ForwarderState, transport: Transport) -> None:
        self.state = state
        self.transport = transport
        #: Jobs settled ``cancelled`` by this process.
        self.cancelled = 0
        #: How often a job a worker still runs is looked at again (tests shorten it).
        self.recheck_s = RECHECK_S
        #: When each job a worker still ran was last asked about (monotonic).
        self._asked: dict[Loc, float] = {}
        self._down = False

    def step(self) -> None:
        """Take requests in, then settle what can be settled now."""
        self.intake()
        if self.state.index.cancels:
            self.settle()

    def intake(self) -> None:
        """Move request files into the ledger (durably), then delete them."""
        for path, jobs in read_requests(self.state.journal):
            if not jobs:
                log.error("cancel request %s is damaged or empty: deleted, nothing cancelled", path)
            at = self.state.config.clock()
            compacted = self.state.compacted
            entries = [
                Entry(EntryKind.CANCEL, job_id, loc, at=at)
                for job_id, loc in jobs
                if not compacted.is_compacted((loc[0], loc[1]))
            ]
            self.state.append(entries)
            for entry in entries:
                log.info("job %s: cancel requested", entry.job_id)
            os.unlink(path)  # a crash before this takes the same request in again: no change

    def settle(self) -> None:
        """Settle each cancelled job no worker holds; mark the pushed ones in the backend first."""
        index = self.state.index
        now = time.monotonic()
        settled: list[Entry] = []
        ask: list[tuple[Entry, Probe, bool]] = []
        for loc, entry in list(index.cancels.items()):
            if now < self._asked.get(loc, -math.inf) + self.recheck_s:
                continue
            env = envelope_at(self.state.journal, loc)
            if env is None:
                settled.append(entry)  # its record is gone (repair): nothing can run it
                continue
            # Marked in the backend even if never pushed, and settled only once marked: a push
            # cut short (a restart, an OOM reply) may have left a copy there, and no claim must
            # run it.
            limited = env.limit_key if self.state.config.key_limits.of(env.limit_key) else ""
            ask.append((entry, Probe(env.id, env.key_id, env.queue, limited or ""), self._pushed(loc)))
        if ask:
            try:
                running = self.transport.cancel([p for _, p, _ in ask], key_ttl_s=self.state.config.key_ttl_s)
            except TransportError as exc:
                if not self._down:
                    log.warning("cannot mark %d cancelled job(s) in the backend yet: %s", len(ask), exc)
                self._down = True
                for entry, _, _ in ask:
                    self._asked[entry.loc] = now
            else:
                self._down = False
                for (entry, _, pushed), busy in zip(ask, running, strict=True):
                    if busy and pushed:  # (a never-pushed job's key may be its owner's lease)
                        self._asked[entry.loc] = now
                    else:
                        settled.append(entry)
        self._settle(settled)

    def _settle(self, entries: list[Entry]) -> None:
        if not entries:
            return
        at = self.state.config.clock()
        done = [
            Entry(EntryKind.DONE, e.job_id, e.loc, outcome=Outcome.CANCELLED.value, at=at, queue=e.queue)
            for e in entries
        ]
        self.state.append(done)
        gone = {e.loc for e in entries}
        held = self.state.checkpoint.held
        held[:] = [h for h in held if (h.writer_id, h.segment, h.offset) not in gone]
        for e in entries:
            self._asked.pop(e.loc, None)
            log.info("job %s: cancelled", e.job_id)
        self.cancelled += len(entries)

    def _pushed(self, loc: Loc) -> bool:
        """Whether the job at ``loc`` may be in the backend (else it was never pushed)."""
        if loc in self.state.runs.backs:
            return True  # put back by a claim's refusal: a copy may still be queued, or run
        if loc in self.state.index.duplicates or self.state.runs.contains(loc):
            return False  # waits for its key's owner, or in the run table: never pushed
        if any((h.writer_id, h.segment, h.offset) == loc for h in self.state.checkpoint.held):
            return False
        pos = self.state.checkpoint.positions.get(loc[0])
        return pos is not None and (loc[1], loc[2]) < (pos.segment, pos.offset)
