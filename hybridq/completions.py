"""The forwarder's second half: outcomes in, redeliveries out, dead segments deleted.

* **Harvest**: completion events from the owner's stream become ledger entries, appended with
  fsync *before* the events are deleted from Redis (docs/reliability.md rule 13).
* **Retries**: a failed attempt with attempts left is a ``retry`` entry with its time; when it
  is due, the next attempt is delivered. The schedule lives in the ledger, not in Redis.
* **Epoch**: Redis losing the owner's epoch key, or restarting, re-forwards every forwarded job
  that is not durably terminal (rule 15; pushes are idempotent per job id, so only what Redis
  lost is queued again).
* **Reconcile**: a pass over the forwarded, non-terminal jobs asks Redis about each (a pipelined
  probe): missing -> deliver again; orphaned (its worker's lease expired) -> a ``lost`` entry,
  then deliver the next attempt (rule 14: never wait for RQ's abandoned-job handling).
* **Compaction** (:mod:`hybridq.compaction`): dead journal segments, then ledger segments.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from hybridq.compaction import Compactor
from hybridq.completion_event import parse_event
from hybridq.envelope import Envelope
from hybridq.errors import ConfigError, EnvelopeError, JournalError
from hybridq.journal import ChainPosition, JournalReader, JournalWriter, Record, RecordType, crashpoints
from hybridq.journal.reader import list_chains, read_record_at
from hybridq.journal.recovery import recover
from hybridq.ledger import (
    Compacted,
    Entry,
    LedgerIndex,
    ledger_dir,
    load_compacted,
    load_index,
    open_ledger_writer,
)
from hybridq.state import Checkpoint
from hybridq.transport.base import Delivery, Loc, Probe, Transport

__all__ = ["Completions", "check_key_ttl"]

log = logging.getLogger("hybridq.forwarder")

#: Events harvested per round trip (and per ledger fsync).
HARVEST_BATCH = 1000
#: Jobs probed per round trip during a reconcile pass.
PROBE_BATCH = 1000
#: How often the forwarder notes how far forwarding had got (seconds).
SNAPSHOT_EVERY_S = 1.0
#: How long a job may stay "done" (outcome stored in Redis, no completion event harvested) before
#: it is delivered again, in leases (at least a minute): the event may have been evicted. The
#: delivery finds the stored outcome and reports it without running the task.
DONE_GRACE_LEASES = 6


def check_key_ttl(lease_s: float, key_ttl_s: float) -> None:
    """Refuse a key lifetime too short for the "done" grace period (see :data:`DONE_GRACE_LEASES`).

    A job whose completion event was lost stays "done" in Redis (its outcome stored) for up to
    the grace period before it is delivered again, to report that outcome without running. If the
    stored outcome expires first, the job reads as "orphaned" instead, and runs again. Twice the
    grace leaves room for the reconcile passes on either side and a short queue wait.
    """
    least = 2 * max(60.0, DONE_GRACE_LEASES * lease_s)
    if key_ttl_s < least:
        raise ConfigError(
            f"key TTL {key_ttl_s:g} s is too short for a {lease_s:g} s lease: it must be at least "
            f"{least:g} s (twice max(60 s, {DONE_GRACE_LEASES} leases)), or finished jobs whose "
            "completion event was lost would run again"
        )


class Completions:
    """Harvest, retries, reconciliation and compaction for one forwarder (see module docstring).

    Args:
        journal: the journal directory (its lock is held by the forwarder).
        transport: the backend.
        checkpoint: the forwarder's checkpoint (owner, epoch, positions; shared, not copied).
        lease_s: how long a worker's lease lasts; a job whose lease lapsed is delivered again.
        key_ttl_s: how long outcomes stay stored under idempotency keys in Redis.
        max_lost: a job whose worker vanished this many times fails for good (a task that kills
            its worker every time must not loop forever).
        reconcile_interval_s: the least time between the starts of two reconcile passes.
        clock: wall-clock time.
        on_durable_write: called with the seconds each ledger append took (it ends in an fsync).
    """

    def __init__(
        self,
        journal: str,
        transport: Transport,
        checkpoint: Checkpoint,
        *,
        lease_s: float,
        key_ttl_s: float,
        max_lost: int,
        reconcile_interval_s: float,
        clock: Callable[[], float],
        on_durable_write: Callable[[float], None] | None = None,
    ) -> None:
        self.journal = journal
        self.transport = transport
        self.checkpoint = checkpoint
        self.lease_s = lease_s
        self.key_ttl_s = key_ttl_s
        self.max_lost = max_lost
        self.reconcile_interval_s = reconcile_interval_s
        self.clock = clock
        self.on_durable_write = on_durable_write
        self.compacted = Compacted()
        self.index = LedgerIndex()
        #: Counters since this forwarder started.
        self.harvested = self.redelivered = self.refilled = self.segments_deleted = 0
        #: Completion events dropped because they did not parse (garbled, forged, out of range).
        self.dropped_events = 0
        self._writer: JournalWriter | None = None
        #: Retries pushed by this process (loc -> attempt), so a due retry is pushed once.
        self._pushed_retries: dict[Loc, int] = {}
        self._pass: Iterator[Record] | None = None
        self._pass_refill = False
        self._pass_started = 0.0
        self._next_pass = 0.0
        self._pass_limit: dict[str, ChainPosition] = {}
        #: (monotonic time, checkpoint positions then); the first entry stands for "before this
        #: process started", so jobs forwarded by an earlier run are reconciled at once.
        self._snapshots: collections.deque[tuple[float, dict[str, ChainPosition]]] = collections.deque()
        self._compactor: Compactor | None = None
        #: How long a job may stay "done" or "stranded" in Redis before it is delivered again.
        self.done_grace_s = max(60.0, DONE_GRACE_LEASES * lease_s)
        self.stranded_grace_s = lease_s
        #: Jobs seen "done" or "stranded" by a probe: loc -> (verdict, when first seen).
        self._suspects: dict[Loc, tuple[str, float]] = {}
        #: Jobs whose worker this process found vanished (it wrote, or confirmed, their newest
        #: ``lost`` entry and pushed the next attempt): a later vanish of theirs is a new one.
        self._lost_here: set[Loc] = set()

    # -- life cycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Finish interrupted deletions, recover the ledger, rebuild the index."""
        self._snapshots.append((-math.inf, dict(self.checkpoint.positions)))
        self.compacted = load_compacted(self.journal)
        if os.path.isdir(ledger_dir(self.journal)):
            recover(ledger_dir(self.journal))
        self.index = load_index(self.journal, self.compacted)
        self._compactor = Compactor(
            self.journal,
            self.checkpoint,
            self.index,
            self.compacted,
            append=lambda entries: self._append(entries, apply=False),
            own_chain=lambda: self._writer.writer_id if self._writer is not None else None,
        )
        self._compactor.finish_deletions()

    def close(self) -> None:
        """Close the ledger writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _append(self, entries: Sequence[Entry], *, apply: bool = True) -> None:
        """Append entries to the ledger with one fsync, then (``apply``) fold them into the index."""
        if not entries:
            return
        if self._writer is None:
            self._writer = open_ledger_writer(self.journal)
        started = time.perf_counter()
        self._writer.append_many(e.to_bytes() for e in entries)
        if self.on_durable_write is not None:
            self.on_durable_write(time.perf_counter() - started)
        if apply:
            for entry in entries:
                self.index.apply(entry)

    def record_invalid(self, record: Record) -> None:
        """Make a record that is not a job terminal (``invalid``), so its segment can go."""
        self.record_invalid_at((record.writer_id, record.segment_index, record.offset))

    def record_invalid_at(self, loc: Loc) -> None:
        """Make the record at ``loc`` terminal as ``invalid`` (not a job, or not one Redis can hold)."""
        self._append([Entry("done", "", loc, outcome="invalid", at=self.clock())])

    @property
    def terminal_total(self) -> int:
        """Jobs durably terminal: in compacted segments plus in the ledger's index."""
        return self.compacted.terminal + self.index.terminal_count

    # -- harvest ------------------------------------------------------------------------------

    def harvest(self) -> int:
        """Move every waiting completion event into the ledger; returns how many."""
        total = 0
        while True:
            events = self.transport.harvest(self.checkpoint.owner, HARVEST_BATCH)
            if not events:
                return total
            entries = [e for e in (self._entry(ev.event_id, ev.body) for ev in events) if e is not None]
            entries = self._drop_compacted(entries)
            self._append(entries)
            for entry in entries:
                if entry.kind == "retry":
                    self._pushed_retries.pop(entry.loc, None)
            crashpoints.reached("harvest_after_ledger")
            # Only now that the ledger has them (fsync'd) may Redis forget them.
            self.transport.ack(self.checkpoint.owner, [ev.event_id for ev in events])
            total += len(events)
            self.harvested += len(events)
            if len(events) < HARVEST_BATCH:
                return total

    def _entry(self, event_id: str, body: Mapping[str, Any] | None) -> Entry | None:
        try:
            entry = parse_event(event_id, body, self.clock)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            # Dropped (and deleted from Redis with the batch): raising here would stop the
            # forwarder on every start, on one bad event (docs/security.md).
            self.dropped_events += 1
            log.error("dropping garbled completion event %s: %r", event_id, exc)
            return None
        loc = entry.loc
        if self.compacted.is_compacted((loc[0], loc[1])) or loc[0] not in self.checkpoint.positions:
            # A late duplicate of a job long gone (its segment, or its whole chain, compacted
            # and forgotten): its outcome is already counted.
            return None
        if entry.kind == "done" and entry.outcome == "failed" and not self.index.is_terminal(loc):
            env = self._envelope_at(loc)  # so it can be requeued after its segment is gone
            if env is not None:
                entry = dataclasses.replace(entry, job=env.to_dict())
        return entry

    def _drop_compacted(self, entries: list[Entry]) -> list[Entry]:
        """Drop late duplicates for segments below their chain's first present one.

        Such a segment was compacted (its outcomes counted in the compaction state) even when its
        chain was forgotten and then grew again, so ``is_compacted`` no longer says so.
        """
        if not entries:
            return entries
        first = {writer: indices[0] for writer, indices in list_chains(self.journal).items()}
        return [e for e in entries if e.loc[1] >= first.get(e.loc[0], sys.maxsize)]

    # -- retries ------------------------------------------------------------------------------

    def due_retries(self) -> list[Delivery]:
        """Deliveries of the next attempt of every failed job whose retry time has come."""
        now = self.clock()
        out: list[Delivery] = []
        for loc, (run_at, attempt) in list(self.index.retries.items()):
            if run_at > now or self._pushed_retries.get(loc, 0) > attempt:
                continue
            env = self._envelope_at(loc)
            if env is not None:
                out.append(self.delivery(env, loc, attempt + 1, force=True))
        return out

    def pushed(self, deliveries: Sequence[Delivery]) -> None:
        """Note deliveries the transport accepted (so due retries are not pushed again)."""
        for d in deliveries:
            if d.loc in self.index.retries:
                self._pushed_retries[d.loc] = d.attempt

    # -- epoch and reconciliation -------------------------------------------------------------

    def check_epoch(self) -> None:
        """Start a refill pass if Redis lost state or restarted since the epoch was set."""
        token = self.transport.state_token(self.checkpoint.owner)
        cp = self.checkpoint
        if cp.epoch is not None and token.epoch == cp.epoch and token.run_id == cp.run_id:
            return
        if cp.epoch is None and not cp.positions:
            log.info("setting this forwarder's epoch in Redis (owner %s)", cp.owner)
        elif token.epoch != cp.epoch:
            log.warning(
                "Redis lost this forwarder's state (epoch key gone): re-forwarding every unfinished job"
            )
            self._start_pass(refill=True)
        else:
            log.warning("Redis restarted (new run_id): re-forwarding what it does not have")
            self._start_pass(refill=True)
        cp.epoch = uuid.uuid4().hex
        cp.run_id = token.run_id
        # The new epoch is stored in Redis now, and in the checkpoint by the forwarder's next save;
        # a crash in between only repeats the refill.
        self.transport.set_epoch(cp.owner, cp.epoch)

    def hurry(self, *, reconcile: bool = True) -> None:
        """Run compaction (and a reconcile pass) at the next step, whatever their timers say."""
        if reconcile:
            self._next_pass = 0.0
        if self._compactor is not None:
            self._compactor.hurry()

    def _start_pass(self, *, refill: bool) -> None:
        self._pass = JournalReader(self.journal).records()
        self._pass_refill = refill or self._pass_refill
        self._pass_started = time.monotonic()
        if self._pass_refill:
            self._pass_limit = dict(self.checkpoint.positions)  # everything forwarded
        else:
            self._pass_limit = self._positions_before(self._pass_started - self.lease_s)

    def _snapshot_positions(self) -> None:
        """Remember where forwarding stood, about every second (what was forwarded when)."""
        now = time.monotonic()
        if now - self._snapshots[-1][0] >= min(SNAPSHOT_EVERY_S, self.lease_s / 4):
            self._snapshots.append((now, dict(self.checkpoint.positions)))
            # Keep the newest snapshot old enough for any pass, and everything after it.
            while len(self._snapshots) > 1 and self._snapshots[1][0] <= now - self.lease_s:
                self._snapshots.popleft()

    def _positions_before(self, when: float) -> dict[str, ChainPosition]:
        """Positions forwarding had reached by ``when`` (what was forwarded at least that long ago)."""
        best: dict[str, ChainPosition] = {}
        for at, positions in self._snapshots:
            if at > when:
                break
            best = positions
        return best

    def reconcile_step(self) -> list[Delivery]:
        """Advance the reconcile (or refill) pass by one batch; return what to deliver again."""
        self._snapshot_positions()
        if self._pass is None:
            if time.monotonic() < self._next_pass:
                return []
            self._start_pass(refill=False)
        assert self._pass is not None
        batch: list[tuple[Loc, Envelope]] = []
        for record in self._pass:
            candidate = self._candidate(record)
            if candidate is not None:
                batch.append(candidate)
                if len(batch) >= PROBE_BATCH:
                    break
        else:
            self._pass = None
            # A pass over a long backlog takes a while: spend at most a third of the time on them.
            ended = time.monotonic()
            self._next_pass = ended + max(self.reconcile_interval_s, 2 * (ended - self._pass_started))
            self._suspects = {loc: s for loc, s in self._suspects.items() if not self.index.is_terminal(loc)}
            self._lost_here = {loc for loc in self._lost_here if not self.index.is_terminal(loc)}
        refill = self._pass_refill
        if self._pass is None:
            self._pass_refill = False
        if not batch:
            return []
        if refill:
            self.refilled += len(batch)
            return [self.delivery(env, loc, self.index.attempts(loc) + 1) for loc, env in batch]
        verdicts = self.transport.probe(
            [Probe(env.id, env.key_id, env.queue) for _, env in batch], lease_s=self.lease_s
        )
        return self._redeliveries(batch, verdicts)

    def _candidate(self, record: Record) -> tuple[Loc, Envelope] | None:
        """A forwarded job that is not terminal and not waiting for its time, else ``None``."""
        if record.rtype != RecordType.DATA:
            return None
        loc = (record.writer_id, record.segment_index, record.offset)
        # Only jobs forwarded at least a lease ago: a younger one cannot have lost its worker's
        # lease yet, and one Redis lost is the epoch check's (a refill pass takes them all).
        if not record.consumed_by(self._pass_limit):
            return None
        if self.index.is_terminal(loc):
            return None
        retry = self.index.retries.get(loc)
        if retry is not None and self._pushed_retries.get(loc, 0) <= retry[1]:
            return None  # its next attempt is not due (or not pushed) yet
        try:
            env = Envelope.from_bytes(record.payload)
        except EnvelopeError:
            return None
        if env.run_at is not None and env.run_at > self.clock():
            return None  # a delayed job the forwarder still holds
        return loc, env

    def _redeliveries(self, batch: Sequence[tuple[Loc, Envelope]], verdicts: Sequence[str]) -> list[Delivery]:
        out: list[Delivery] = []
        lost: list[Entry] = []
        now = time.monotonic()
        for (loc, env), verdict in zip(batch, verdicts, strict=True):
            attempt = self.index.attempts(loc) + 1  # the attempt delivered now
            if verdict in ("done", "stranded"):
                # The same attempt again: a stranded job never started, a "done" one is reported.
                if self._stuck(loc, verdict, now):
                    log.warning("job %s: %s in Redis for too long; delivering it again", env.id, verdict)
                    out.append(dataclasses.replace(self.delivery(env, loc, attempt), replace=True))
                continue
            self._suspects.pop(loc, None)
            if verdict == "missing":
                out.append(self.delivery(env, loc, attempt))
            elif verdict == "orphaned":
                lost_attempt, times = self.index.lost.get(loc, (0, 0))
                if lost_attempt and lost_attempt == attempt - 1 and loc not in self._lost_here:
                    # The newest thing known of this job is a `lost` entry an earlier forwarder
                    # wrote; it may have died before pushing the attempt that entry promised, so
                    # this may be the same vanish: push that attempt, count nothing. (Had it been
                    # pushed and lost too, the push is stale and the next pass counts it.)
                    self._lost_here.add(loc)
                    out.append(self.delivery(env, loc, attempt, force=True))
                    continue
                self._lost_here.add(loc)
                times += 1
                if times >= self.max_lost:
                    log.error("job %s: its worker vanished %d times; failing it for good", env.id, times)
                    error = f"the worker running it vanished {times} times (killed, or lost its lease)"
                    lost.append(
                        Entry(
                            "done",
                            env.id,
                            loc,
                            outcome="failed",
                            attempt=attempt,
                            error=error,
                            at=self.clock(),
                            queue=env.queue,
                            job=env.to_dict(),
                        )
                    )
                    continue
                lost.append(Entry("lost", env.id, loc, attempt=attempt, at=self.clock(), queue=env.queue))
                out.append(self.delivery(env, loc, attempt + 1, force=True))
        # The attempt count is durable before the next attempt is delivered.
        self._append(lost)
        if lost:
            crashpoints.reached("redeliver_after_ledger")
        self.redelivered += len(out)
        return out

    def _stuck(self, loc: Loc, verdict: str, now: float) -> bool:
        """Whether ``loc`` has had ``verdict`` long enough to act on it (then forget it)."""
        grace = self.stranded_grace_s if verdict == "stranded" else self.done_grace_s
        seen = self._suspects.get(loc)
        if seen is None or seen[0] != verdict:
            self._suspects[loc] = (verdict, now)
            return False
        if now - seen[1] < grace:
            return False
        del self._suspects[loc]
        return True

    def delivery(self, env: Envelope, loc: Loc, attempt: int, *, force: bool = False) -> Delivery:
        """A delivery of ``env``: this forwarder's owner id, lease and key lifetime."""
        return Delivery(
            env,
            self.checkpoint.owner,
            loc,
            attempt=attempt,
            force=force,
            lease_s=self.lease_s,
            key_ttl_s=self.key_ttl_s,
        )

    def _envelope_at(self, loc: Loc) -> Envelope | None:
        try:
            record = read_record_at(self.journal, loc[0], loc[1], loc[2])
            return Envelope.from_bytes(record.payload)
        except (JournalError, EnvelopeError, OSError) as exc:
            log.error("cannot read job at %s:%d:%d: %s", *loc, exc)
            return None

    # -- compaction ---------------------------------------------------------------------------

    def compact(self) -> int:
        """Delete dead journal and ledger segments (see :mod:`hybridq.compaction`); how many went."""
        if self._pass is not None or self._compactor is None:
            return 0  # never under a pass that may be reading the segment
        deleted = self._compactor.compact()
        self.segments_deleted += deleted
        return deleted

    def take_forgotten_chains(self) -> bool:
        """Whether compaction dropped chains from the checkpoint since the last call."""
        forgot = self._compactor is not None and self._compactor.forgot_chains
        if forgot and self._compactor is not None:
            self._compactor.forgot_chains = False
        return forgot
