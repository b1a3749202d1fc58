"""Outcomes in: completion events into the ledger, and the retries the ledger schedules.

* **Harvest**: completion events from the owner's stream become ledger entries, appended with
  fsync *before* the events are deleted from Redis (docs/reliability.md rule 13).
* **Started events** (a worker claimed a run: ``protocol.StartedEvent``) go to the lookup index
  only (``job.status`` ``started``), never to the ledger. One a claim sent with a refusal (its
  limit key had no room: ``Event.refused``) puts the job back in the run table instead
  (:mod:`hybridq.forwarder.refusals`).
* **Retries**: a failed attempt with attempts left is a ``retry`` entry with its time; when it
  is due, the next attempt is delivered. The schedule lives in the ledger, not in Redis.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybridq.envelope.model import Envelope, idempotency_id
from hybridq.errors import TransportError
from hybridq.forwarder.records import envelope_at
from hybridq.forwarder.refusals import is_refusal, take_back
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import crashpoints
from hybridq.journal.reader import list_chains
from hybridq.ledger.entries import Entry, parse_event
from hybridq.protocol import Overwrite, StartedEvent
from hybridq.security.signing import Keyring, admit_event, keyring
from hybridq.transport.base import Delivery, Event, Finished, Loc, Transport

__all__ = ["HARVEST_BATCH", "Harvester"]

log = logging.getLogger("hybridq.forwarder")

#: Events harvested per round trip (and per ledger fsync).
HARVEST_BATCH = 1000


class Harvester:
    """Moves completion events into the ledger and delivers due retries (see module docstring).

    Args:
        state: the forwarder's state (owner, positions, ledger).
        transport: the backend.
    """

    def __init__(self, state: ForwarderState, transport: Transport) -> None:
        self.state = state
        self.transport = transport
        self.clock = state.config.clock
        self.journal = state.journal
        #: Counters since this forwarder started.
        #: Completion events dropped because they did not parse (garbled, forged, out of range).
        self.dropped_events = 0
        #: Events for jobs the ledger already held as terminal (a duplicate's report, a replay,
        #: or a finished job that ran again).
        self.late_events = 0
        #: The id of the newest completion event harvested (the event watcher waits for newer).
        self.last_event_id = "0-0"
        #: Retries pushed by this process (loc -> attempt), so a due retry is pushed once.
        self._pushed_retries: dict[Loc, int] = {}
        #: Where started events go (the forwarder's lookup index); ``None``: dropped.
        self.on_started: Callable[[list[StartedEvent]], None] | None = None
        #: Started events the last :meth:`harvest` took (the lookup index has news).
        self.started_harvested = 0
        #: Jobs a claim refused (their limit key had no room) put back in the run table, since start.
        self.refused_back = 0
        #: Whether refused jobs go back to the run table. Not while the key gate cannot read the
        #: keys' use (several Redis): it would push them again at once, to be refused again at
        #: every step; the reconcile pass delivers them, about two leases later.
        self.takes_back: Callable[[], bool] = lambda: True
        #: Whether the forwarder holds a live job back (the reconcile pass's ``holds``): a
        #: refusal takes no such job back.
        self.holds: Callable[[Loc, Envelope], bool] = lambda _loc, _env: False
        #: Whether finished jobs leave Redis once harvested (the forwarder decides).
        self.forgetting: Callable[[], bool] = lambda: False
        #: Successes of this batch dropped as late (their journal segment compacted) whose failure
        #: is listed: each is marked as outranking it (:meth:`_outrank_late`).
        self._late_successes: dict[Loc, Entry] = {}

    # -- harvest ------------------------------------------------------------------------------

    def harvest(self) -> int:
        """Move every waiting completion event into the ledger; returns how many.

        Started events are not counted there (they change no outcome: nothing to save or
        publish), but in :attr:`started_harvested`.
        """
        owner = self.state.checkpoint.owner
        total = 0
        self.started_harvested = 0
        while True:
            events = self.transport.harvest(owner, HARVEST_BATCH)
            if not events:
                return total
            ring = keyring()  # once per batch: it stats the key file
            started = [i for i, ev in enumerate(events) if StartedEvent.is_one(ev.body)]
            outcomes = [ev for ev in events if not StartedEvent.is_one(ev.body)] if started else events
            refused = [i for i in started if is_refusal(events[i], signed=ring is not None)]
            if refused:
                gone = set(refused)
                started = [i for i in started if i not in gone]
            entries = [
                e for e in (self._entry(ev.event_id, ev.body, ring) for ev in outcomes) if e is not None
            ]
            entries = self._drop_compacted(entries)
            self._outrank_late()
            for entry in self.state.append(entries):
                if entry.event_id is not None:
                    self._late(entry)
            for entry in entries:
                if entry.kind == "retry":
                    self._pushed_retries.pop(entry.loc, None)
            if started:
                admitted = self._admitted_started(events, started, ring)
                if admitted and self.on_started is not None:
                    self.on_started(admitted)
            if refused and self.takes_back():  # committed to the run table before the events go
                self.refused_back += take_back(
                    self.state, self._admitted_started(events, refused, ring), self.holds
                )
            crashpoints.reached("harvest_after_ledger")
            # Only now that the ledger has them (fsync'd) may Redis forget them.
            self.transport.ack(owner, [ev.event_id for ev in events])
            self.last_event_id = events[-1].event_id
            if self.forgetting():
                self._forget(entries)
            total += len(events) - len(started) - len(refused)
            self.started_harvested += len(started)
            if len(events) < HARVEST_BATCH:
                return total

    def _forget(self, entries: Sequence[Entry]) -> None:
        """Delete what Redis keeps of jobs now terminal in the ledger (docs/forwarder.md).

        The ledger has them (fsync'd), so Redis's copy is a cache nobody reads; left there it
        would hold about 7 KB a job for RQ's ``result_ttl``, more than a queued job. An implicit
        key's stored outcome (the key is the job id) is kept ``harvested_key_keep_s`` more.
        """
        done = [
            Finished(e.job_id, idempotency_id(e.job_id), e.queue, implicit_key=True)
            for e in entries
            if e.kind == "done" and e.queue is not None and self.state.index.is_terminal(e.loc)
        ]
        try:
            self.transport.drop_finished(done, result_ttl_s=self.state.config.harvested_key_keep_s)
        except TransportError as exc:  # left to their own TTLs: memory, not correctness
            log.debug("cannot delete %d finished jobs from Redis: %s", len(done), exc)

    def _entry(self, event_id: str, body: Mapping[str, Any] | None, ring: Keyring | None) -> Entry | None:
        checkpoint = self.state.checkpoint
        if body is not None and not admit_event(
            checkpoint.owner, event_id, body, checkpoint.positions, ring=ring
        ):
            self.dropped_events += 1  # forged or unauthenticated: admit_event logged why
            return None
        try:
            entry = parse_event(event_id, body, self.clock)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            # Dropped (and deleted from Redis with the batch): raising here would stop the
            # forwarder on every start, on one bad event (docs/security.md).
            self.dropped_events += 1
            log.error("dropping garbled completion event %s: %r", event_id, exc)
            return None
        loc = entry.loc
        if self.state.compacted.is_compacted((loc[0], loc[1])) or loc[0] not in checkpoint.positions:
            # A late duplicate of a job long gone (its segment, or its whole chain, compacted
            # and forgotten): its outcome is already counted.
            self._note_late(entry)
            return None
        if entry.outcome == "cancelled" and loc not in self.state.index.cancels:
            entry = self._unasked_cancel(entry)
        if entry.kind == "done" and entry.outcome == "failed" and not self.state.index.is_terminal(loc):
            env = envelope_at(self.journal, loc)  # so it can be requeued after its segment is gone
            if env is not None:
                entry = dataclasses.replace(entry, job=env.to_dict())
        return entry

    def _unasked_cancel(self, entry: Entry) -> Entry:
        """A ``cancelled`` outcome for a job this forwarder holds no cancel for: ``failed`` instead.

        Only :mod:`hybridq.forwarder.cancelling` marks a job cancelled in Redis, and only after the
        ``cancel`` entry is in the ledger (fsync'd): a mark without one was written by someone
        else (a Redis writer: ``HSET rq:job:ID hybridq_cancel 1``). Its worker stopped the task
        and reported ``cancelled`` truthfully (signed, too), but settling it would end a job
        nobody cancelled, for good and out of ``hybridq failed list``. It is recorded failed
        (final: the stored outcome in Redis suppresses another delivery), so it is listed, with
        why, and ``hybridq failed requeue`` runs it again. A job already terminal keeps its
        outcome (a late event: cancelled ranks below any other).
        """
        if self.state.index.is_terminal(entry.loc):
            return entry
        log.warning(
            "job %s: its worker stopped it for a forged cancel mark (no cancel was asked for): "
            "recorded failed; hybridq failed requeue %s runs it again",
            entry.job_id,
            entry.job_id,
        )
        why = (
            "stopped by a cancel mark in Redis, but no cancel was asked for (hybridq cancel): "
            "someone wrote the mark; requeue the job to run it again"
        )
        return dataclasses.replace(entry, outcome="failed", error=f"{why}\n{entry.error or ''}".rstrip())

    def _admitted_started(
        self, events: Sequence[Event], which: Sequence[int], ring: Keyring | None
    ) -> list[StartedEvent]:
        """The started events ``events[i]`` for ``i`` in ``which`` (for :attr:`on_started`, or refusals).

        The lookup index only, never the ledger: a started event changes no outcome and counts
        as none. One whose job has an outcome event later in ``events`` is moot (that is newer);
        one that does not parse, or that signing refuses, is dropped as a garbled event would be.
        """
        checkpoint = self.state.checkpoint
        last_outcome = {
            _loc_of(ev.body): i for i, ev in enumerate(events) if not StartedEvent.is_one(ev.body)
        }
        started: list[StartedEvent] = []
        for i in which:
            ev = events[i]
            if last_outcome.get(_loc_of(ev.body), -1) > i:
                continue
            if ev.body is None or not admit_event(
                checkpoint.owner, ev.event_id, ev.body, checkpoint.positions, ring=ring
            ):
                self.dropped_events += 1
                continue
            try:
                started.append(StartedEvent.from_json(ev.body))
            except (KeyError, TypeError, ValueError, OverflowError) as exc:
                self.dropped_events += 1
                log.error("dropping garbled started event %s: %r", ev.event_id, exc)
        return started

    def _drop_compacted(self, entries: list[Entry]) -> list[Entry]:
        """Drop late duplicates for segments below their chain's first present one.

        Such a segment was compacted (its outcomes counted in the compaction state) even when its
        chain was forgotten and then grew again, so ``is_compacted`` no longer says so.
        """
        if not entries:
            return entries
        first = {writer: indices[0] for writer, indices in list_chains(self.journal).items()}
        kept = [e for e in entries if e.loc[1] >= first.get(e.loc[0], sys.maxsize)]
        if len(kept) < len(entries):
            for e in entries:
                if e.loc[1] < first.get(e.loc[0], sys.maxsize):
                    self._note_late(e)
        return kept

    def _note_late(self, entry: Entry) -> None:
        """Keep a late success of a compacted job whose failure is listed (a lookup only for those)."""
        if (
            entry.kind == "done"
            and entry.outcome == "succeeded"
            and entry.loc not in self._late_successes  # one mark per job, however often reported
            and entry.loc in self.state.index.failed
        ):
            self._late_successes[entry.loc] = entry

    def _outrank_late(self) -> None:
        """Mark the late successes noted: their failures leave the list for good.

        The job's journal segment is compacted, so the success is not counted (its outcome was,
        as failed), but a requeue of its listed failure would run a job that succeeded. The mark
        (docs/reliability.md, "A success outranks a failure") is appended (fsync'd) before the
        table row changes and before the events are acknowledged: a crash between leaves the
        mark for the next start's replay, or the event for the next harvest.
        """
        if not self._late_successes:
            return
        marks = [dataclasses.replace(e, over="failed").as_mark() for e in self._late_successes.values()]
        self._late_successes = {}
        self.state.append(marks, apply=False)
        for mark in marks:
            self.state.index.failed.outrank(mark.loc)
            log.warning(
                "job %s: its run succeeded after it was recorded failed and compacted: no longer listed",
                mark.job_id,
            )

    def _late(self, entry: Entry) -> None:
        """Count (and log) an event that changed nothing: its job was terminal already."""
        self.late_events += 1
        if entry.dup:
            log.info("job %s: duplicate delivery reported after the job had finished", entry.job_id)
        else:
            log.warning(
                "job %s: an outcome (%s, attempt %d) arrived for a job the ledger holds as finished: "
                "a replay of an event, or the job ran again",
                entry.job_id,
                entry.outcome or entry.kind,
                entry.attempt,
            )

    # -- retries ------------------------------------------------------------------------------

    def due_retries(self) -> list[Delivery]:
        """Deliveries of the next attempt of every failed job whose retry time has come."""
        now = self.clock()
        out: list[Delivery] = []
        for loc, (run_at, attempt) in list(self.state.index.retries.items()):
            if run_at > now or self.retry_pushed(loc, attempt) or loc in self.state.index.cancels:
                continue  # not due, pushed already, or cancelled (hybridq.forwarder.cancelling settles it)
            env = envelope_at(self.journal, loc)
            if env is not None:
                out.append(self.state.delivery(env, loc, attempt + 1, overwrite=Overwrite.EARLIER))
        return out

    def pushed(self, deliveries: Sequence[Delivery]) -> None:
        """Note deliveries the transport accepted (so due retries are not pushed again)."""
        for d in deliveries:
            if d.loc in self.state.index.retries:
                self._pushed_retries[d.loc] = d.attempt

    def retry_pushed(self, loc: Loc, failed_attempt: int) -> bool:
        """Whether this process pushed the attempt after ``failed_attempt`` of the job at ``loc``."""
        return self._pushed_retries.get(loc, 0) > failed_attempt


def _loc_of(body: Mapping[str, Any] | None) -> object:
    """An event's ``loc`` as a hashable value (``None`` if it has none that is a list)."""
    loc = body.get("loc") if body is not None else None
    if not isinstance(loc, list) or not all(isinstance(x, str | int) for x in loc):
        return None  # garbled: the event's own checks drop it
    return tuple(loc)
