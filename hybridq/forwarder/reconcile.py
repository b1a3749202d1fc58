"""Jobs Redis lost or stranded: the epoch check, refill passes and reconcile passes.

* **Epoch** (checked by :mod:`hybridq.forwarder.epoch`): Redis losing the owner's epoch key, or
  restarting, bumps the epoch *generation* and re-forwards every forwarded job that is not
  durably terminal (docs/reliability.md rule 15). Workers refuse a delivery pushed under an
  older generation, so a queue entry Redis brings back from an older state (a snapshot, a
  lagging replica) never runs a job the ledger holds as finished; the refill pass deletes such
  copies of finished jobs and rewrites unfinished ones under the new generation
  (:meth:`Transport.refill`).
* **Reconcile**: a pass over the forwarded, non-terminal jobs asks Redis about each (a pipelined
  probe): missing -> deliver again; orphaned (its worker's lease expired) -> a ``lost`` entry,
  then deliver the next attempt (rule 14: never wait for RQ's abandoned-job handling).

Both passes read the jobs the forwarder pushed and that are not terminal, listed on disk
(:mod:`hybridq.forwarder.pushed`), and their records only: O(jobs in Redis) per pass, not
O(journal). The jobs waiting in the run table were never pushed: Redis cannot have lost them.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError
from hybridq.forwarder.config import DONE_GRACE_LEASES
from hybridq.forwarder.epoch import check_epoch
from hybridq.forwarder.harvest import Harvester
from hybridq.forwarder.pushed import read_pushed
from hybridq.forwarder.refusals import moved_on
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import Record, RecordType, crashpoints
from hybridq.ledger.entries import Entry
from hybridq.protocol import Overwrite
from hybridq.transport.base import Delivery, Loc, Probe, Transport

__all__ = ["PROBE_BATCH", "Reconciler"]

log = logging.getLogger("hybridq.forwarder")

#: Jobs probed per round trip during a reconcile pass (and records it reads per step, at most).
PROBE_BATCH = 1000


class Reconciler:
    """The epoch check and the refill and reconcile passes of one forwarder (see module docstring).

    Args:
        state: the forwarder's state (checkpoint, ledger index; its epoch is set through it).
        transport: the backend.
        retries: the harvester, which knows which retries this process pushed already.
    """

    def __init__(self, state: ForwarderState, transport: Transport, retries: Harvester) -> None:
        config = state.config
        self.state = state
        self.journal = state.journal
        self.transport = transport
        self.retries = retries
        self.clock = config.clock
        self.lease_s = config.lease_s
        self.max_lost = config.max_lost
        self.reconcile_interval_s = config.reconcile_every_s
        #: Counters since this forwarder started: deliveries made again; refilled; copies of
        #: finished jobs deleted from Redis by a refill.
        self.redelivered = self.refilled = self.purged = 0
        #: How long a job may stay "done" or "stranded" in Redis before it is delivered again.
        self.done_grace_s = max(60.0, DONE_GRACE_LEASES * config.lease_s)
        self.stranded_grace_s = config.lease_s
        #: A refill batch Redis has not accepted yet (tried again before the pass goes on).
        self._refill_batch: tuple[list[Probe], list[Delivery]] | None = None
        #: Deliveries the last step made that Redis has not accepted yet (see :meth:`redo`).
        self._redo: list[Delivery] = []
        #: Those of the jobs Redis lost the windows have room for now (the forwarder's
        #: ``Backlog.admit``): a lost run table makes the whole backlog read as lost, and the
        #: rest is found missing again by a later pass.
        self.admit: Callable[[list[Delivery]], list[Delivery]] = list
        #: Told what of the admitted the transport accepted (``Backlog.sent``: the key gate).
        self.sent: Callable[[list[Delivery]], None] = _ignore
        #: The same for the refill's new copies (which its script does not count: the gate adds them).
        self.refill_sent: Callable[[list[Delivery]], None] = _ignore
        #: The deliveries of :attr:`_redo` that ``admit`` let through (the rest bypass it).
        self._admitted: list[Delivery] = []
        #: The deliveries of :attr:`_redo` of orphaned jobs' next attempts.
        self._next: list[Delivery] = []
        #: Whether the job at a loc is held back by the forwarder's workflows (an anchor, or a job
        #: waiting for its ``depends_on``): never delivered by a pass, even after a Redis wipe.
        self.held: Callable[[Loc], bool] = lambda _: False
        #: The same, decided from the job's record: an anchor, a job whose dependencies have not
        #: all succeeded (:meth:`hybridq.forwarder.flows.Flows.holds`).
        self.held_record: Callable[[Loc, Envelope], bool] = lambda _loc, _env: False
        #: Whether a pass is under way; the last pushed job it read (loc order); it takes jobs
        #: pushed in an interval below this one only (a reconcile: a lease ago; a refill: all
        #: pushed before it began); whether the list was written since it began.
        self._passing = False
        self._cursor: Loc | None = None
        self._listed = False
        self._pushed_before = 0
        self._flushed = False
        self._pass_refill = False
        self._pass_started = 0.0
        self._next_pass = 0.0
        #: Jobs seen "done" or "stranded" by a probe: loc -> (verdict, when first seen).
        self._suspects: dict[Loc, tuple[str, float]] = {}
        #: Jobs whose worker this process found vanished (it wrote, or confirmed, their newest
        #: ``lost`` entry and pushed the next attempt): a later vanish of theirs is a new one.
        self._lost_here: set[Loc] = set()

    @property
    def passing(self) -> bool:
        """Whether a pass is under way (it may be reading any segment)."""
        return self._passing

    def hurry(self) -> None:
        """Start a reconcile pass at the next step, whatever the timer says."""
        self._next_pass = 0.0

    # -- epoch ----------------------------------------------------------------------------------

    def check_epoch(self) -> None:
        """Start a refill pass if Redis lost state or restarted since the epoch was set.

        The check, and the new generation, are :func:`hybridq.forwarder.epoch.check_epoch`'s.
        """
        if check_epoch(self.state, self.transport):
            self._start_pass(refill=True)

    @property
    def refilling(self) -> bool:
        """Whether a refill pass is under way (the loop goes on without waiting until it ends)."""
        return self._passing and self._pass_refill

    # -- passes ---------------------------------------------------------------------------------

    def _start_pass(self, *, refill: bool) -> None:
        """Note a pass under way; no I/O (a full disk here would lose the refill: the epoch is set)."""
        self._passing = True
        self._cursor, self._listed, self._flushed = None, False, False
        self._pass_refill = refill or self._pass_refill
        self._pass_started = time.monotonic()
        # Only jobs pushed at least a lease ago: a younger one cannot have lost its worker's
        # lease yet, and one Redis lost is the epoch check's. A refill pass takes all those
        # pushed before it started (later ones went under the new generation). Intervals, not
        # wall time: a clock stepping back would leave rows out.
        pushed = self.state.pushed
        self._pushed_before = pushed.cut() if self._pass_refill else pushed.pushed_before(self.lease_s)

    def redo(self) -> list[Delivery]:
        """What to deliver again: the last step's until :meth:`redone`, else the next step's.

        A delivery Redis refused (OOM) is not dropped: its ``lost`` entry is durable already,
        and the next pass would find the job orphaned again and count another vanish.
        """
        if not self._redo:
            self._redo = self.reconcile_step()
        return self._redo

    def redone(self, accepted: list[Delivery], queued: frozenset[str] | None = None) -> None:
        """Redis accepted what :meth:`redo` returned (``accepted``: less what it could not encode).

        The key gate is told of the new copies on a limit key's queued count: the admitted ones
        and the next attempts of orphaned jobs (their claimed copy left the count), of those
        Redis queued (``queued``: their ids; ``None``: not known, all). A job delivered again
        as done or stranded replaces a copy that never left it (no claim took it off), so it is
        not counted again.
        """
        took = {id(d) for d in accepted}
        self.sent(
            [
                d
                for d in (*self._admitted, *self._next)
                if id(d) in took and (queued is None or d.envelope.id in queued)
            ]
        )
        self._redo = []
        self._admitted = []
        self._next = []

    def reconcile_step(self) -> list[Delivery]:
        """Advance the reconcile (or refill) pass by one batch; return what to deliver again."""
        if self._refill_batch is not None:
            self._send_refill()  # Redis refused the last one: nothing further before it
        if not self._passing:
            if time.monotonic() < self._next_pass:
                return []
            self._start_pass(refill=False)
        index = self.state.index
        batch = self._next_batch()
        if self._listed:  # the end of the list
            self._passing = False
            # A pass over a long backlog takes a while: spend at most a third of the time on them.
            ended = time.monotonic()
            self._next_pass = ended + max(self.reconcile_interval_s, 2 * (ended - self._pass_started))
            self._suspects = {loc: s for loc, s in self._suspects.items() if not index.is_terminal(loc)}
            self._lost_here = {loc for loc in self._lost_here if not index.is_terminal(loc)}
        refill = self._pass_refill
        if not self._passing:
            self._pass_refill = False
        if not batch:
            return []
        if refill:
            self._refill(batch)
            return []
        verdicts = self.transport.probe(
            [Probe(env.id, env.key_id, env.queue) for _, env in batch], lease_s=self.lease_s
        )
        return self._redeliveries(batch, verdicts)

    def _next_batch(self) -> list[tuple[Loc, Envelope]]:
        """The pass's next jobs (up to :data:`PROBE_BATCH` records read; a refill's finished too).

        Notes the end of the list (:attr:`_listed`). A job whose record is gone (compacted)
        leaves the list; a terminal one left unmarked by a crash is marked.
        """
        pushed = self.state.pushed
        if not self._flushed:  # the jobs pushed as read, listed with the others (retried if it fails)
            self.state.flush_pushed(force=True)
            self._flushed = True
        locs = pushed.after(self._cursor, self._pushed_before, PROBE_BATCH, finished=self._pass_refill)
        self._cursor = locs[-1] if locs else None
        self._listed = len(locs) < PROBE_BATCH
        batch: list[tuple[Loc, Envelope]] = []
        for loc in locs:
            record = read_pushed(self.journal, loc)
            if record is None:
                pushed.drop(loc)
            elif not self._pass_refill and self.state.index.is_terminal(loc):
                pushed.done(loc)
            candidate = None if record is None else self._candidate(record, with_terminal=self._pass_refill)
            if candidate is not None:
                batch.append(candidate)
        return batch

    def _candidate(self, record: Record, *, with_terminal: bool = False) -> tuple[Loc, Envelope] | None:
        """A pushed job that is not terminal and not waiting for its time, else ``None``.

        ``with_terminal`` (a refill pass): terminal jobs too, so their copies can be purged.
        """
        if record.rtype != RecordType.DATA:
            return None
        loc = (record.writer_id, record.segment_index, record.offset)
        if loc in self.state.index.duplicates:
            return None  # never pushed: it waits for its key's owner (hybridq.forwarder.admission)
        runs = self.state.runs
        if (
            runs.contains(loc)
            and (self._pass_refill or loc not in runs.backs)
            and not moved_on(self.state, loc)
        ):
            # It waits in the run table for room (hybridq.forwarder.backlog): never pushed, or
            # put back by its claim's refusal (refusals; a probe checks it: its run may go on).
            return None
        if self.held(loc):
            return None  # a workflow's anchor, or a job waiting for others (hybridq.forwarder.flows)
        if loc in self.state.index.cancels and not self.state.index.is_terminal(loc):
            return None  # cancelled: never delivered again (hybridq.forwarder.cancelling settles it)
        if self.state.index.is_terminal(loc):
            if not with_terminal:
                return None
            try:
                return loc, Envelope.from_bytes(record.payload)
            except EnvelopeError:
                return None
        try:
            env = Envelope.from_bytes(record.payload)
        except EnvelopeError:
            return None
        return None if self.holds(loc, env) else (loc, env)

    def holds(self, loc: Loc, env: Envelope) -> bool:
        """Whether the live job ``env`` at ``loc`` is held back: no pass (nor refusal) delivers it."""
        retry = self.state.index.retries.get(loc)
        if retry is not None and not self.retries.retry_pushed(loc, retry[1]):
            return True  # its next attempt is not due (or not pushed) yet
        if env.run_at is not None and env.run_at > self.clock():
            return True  # a delayed job the forwarder still holds
        return self.held(loc) or self.held_record(loc, env)  # a workflow's (or its record's) hold

    def _refill(self, batch: Sequence[tuple[Loc, Envelope]]) -> None:
        """One batch of a refill pass: purge finished jobs' copies, bring the others up to date."""
        terminal: list[Probe] = []
        live: list[Delivery] = []
        for loc, env in batch:
            if self.state.index.is_terminal(loc):
                terminal.append(Probe(env.id, env.key_id, env.queue))
            else:
                live.append(self.state.delivery(env, loc, self.state.index.attempts(loc) + 1))
        self._refill_batch = (terminal, live)
        self._send_refill()

    def _send_refill(self) -> None:
        assert self._refill_batch is not None
        terminal, live = self._refill_batch
        result = self.transport.refill(terminal, live)  # TransportError: kept, tried again
        self._refill_batch = None
        if result.queued:  # new copies: on their limit keys' queued counts (the key gate)
            self.refill_sent([d for d in live if d.envelope.id in result.queued])
        self.refilled += result.requeued
        self.purged += result.purged
        if result.purged:
            log.warning(
                "refill: deleted %d queued copies of finished jobs that Redis brought back", result.purged
            )

    def _redeliveries(self, batch: Sequence[tuple[Loc, Envelope]], verdicts: Sequence[str]) -> list[Delivery]:
        out: list[Delivery] = []
        missing: list[Delivery] = []
        lost: list[Entry] = []
        self._next = []
        now = time.monotonic()
        index, delivery = self.state.index, self.state.delivery
        for (loc, env), verdict in zip(batch, verdicts, strict=True):
            attempt = index.attempts(loc) + 1  # the attempt delivered now
            if verdict == "stranded" and loc in self.state.runs.backs and not moved_on(self.state, loc):
                continue  # the copy its claim refused: the row put back delivers it, through the gate
            if verdict in ("done", "stranded"):
                # The same attempt again: a stranded job never started, a "done" one is reported.
                if self._stuck(loc, verdict, now):
                    log.warning("job %s: %s in Redis for too long; delivering it again", env.id, verdict)
                    out.append(delivery(env, loc, attempt, overwrite=Overwrite.ALWAYS))
                continue
            self._suspects.pop(loc, None)
            if verdict == "missing":
                missing.append(delivery(env, loc, attempt))
            elif verdict == "orphaned":
                lost_attempt, times = index.lost.get(loc, (0, 0))
                if lost_attempt and lost_attempt == attempt - 1 and loc not in self._lost_here:
                    # The newest thing known of this job is a `lost` entry an earlier forwarder
                    # wrote; it may have died before pushing the attempt that entry promised, so
                    # this may be the same vanish: push that attempt, count nothing. (Had it been
                    # pushed and lost too, the push is stale and the next pass counts it.)
                    self._lost_here.add(loc)
                    self._next.append(delivery(env, loc, attempt, overwrite=Overwrite.EARLIER, lost=times))
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
                            later=index.later.get(loc, (0, 0.0))[0],  # runs that used no attempt
                        )
                    )
                    continue
                lost.append(Entry("lost", env.id, loc, attempt=attempt, at=self.clock(), queue=env.queue))
                self._next.append(delivery(env, loc, attempt + 1, overwrite=Overwrite.EARLIER, lost=times))
        out += self._next
        self._admitted = self.admit(missing)  # through the windows, the memory and key gates
        out += self._admitted
        # The attempt count is durable before the next attempt is delivered.
        self.state.append(lost)
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


def _ignore(_deliveries: list[Delivery]) -> None:
    """The default of :attr:`Reconciler.sent`: no key gate to tell."""
