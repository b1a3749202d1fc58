"""The completions side's turn in each step, and its timers: the epoch check, the terminal count.

:meth:`Maintenance.run` is what the loop calls after the new records' push: harvest the outcomes
into the ledger, the jobs Redis lost pushed again, the limit keys' room, due retries and the
windows' refill, then compaction. A Redis outage only postpones it (the loop goes on forwarding
to the journal's checkpoint, nothing is lost: docs/reliability.md). Once a second it checks that
Redis still holds the forwarder's epoch (a lost or older Redis starts a refill), and at most every
:data:`PUBLISH_TERMINAL_S` it saves the checkpoint for the terminal count producers read.

The forwarder's loop holds one (:attr:`hybridq.forwarder.loop.Forwarder.maintenance`); it pushes
and saves through the loop's own calls, passed in, so that both sides push the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridq.errors import RedisFull, TransportError
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.backlog import Backlog
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.keylimits import KeyLimits
from hybridq.forwarder.push import Pusher
from hybridq.forwarder.state import ForwarderState
from hybridq.forwarder.upkeep import Upkeep
from hybridq.forwarder.watcher import EventWatcher
from hybridq.forwarder.window import check_eviction_policy
from hybridq.journal import JournalReader
from hybridq.transport import Transport
from hybridq.transport.base import Delivery

__all__ = ["EPOCH_CHECK_S", "PUBLISH_TERMINAL_S", "Maintenance", "Parts"]

#: How often the forwarder checks that Redis still has its epoch (seconds).
EPOCH_CHECK_S = 1.0
#: While completions stream in, the checkpoint that publishes the terminal count (the producers'
#: capacity check) is saved at most this often (seconds). The ledger holds the outcomes durably;
#: the published count is a hint that errs towards "pending", and producers read it at most once
#: a second. A save per harvest cost three fsyncs per batch of events (docs/worker.md).
PUBLISH_TERMINAL_S = 0.25


@dataclass(frozen=True)
class Parts:
    """What the completions side works with, all held by the loop."""

    state: ForwarderState
    config: ForwarderConfig
    transport: Transport
    completions: Upkeep
    admission: Admission
    key_limits: KeyLimits
    backlog: Backlog
    pusher: Pusher
    reader: JournalReader
    #: The loop's push and save (late-bound: tests replace them on the loop).
    push: Callable[[list[Delivery]], list[Delivery]]
    save: Callable[[int], None]


class Maintenance:
    """Runs the completions side in each step; keeps its epoch and terminal-count timers.

    Args:
        parts: the loop's parts it calls.
    """

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        #: When the epoch is checked next (``time.monotonic()``); 0: at the next step.
        self.next_epoch_check = 0.0
        #: Outcomes harvested since the terminal count was last published.
        self.publish_due = False
        self.next_publish = 0.0
        #: Wakes the loop when events arrive (:meth:`watch`), where the transport can block on them.
        self.watcher: EventWatcher | None = None

    def run(self) -> bool:
        """Harvest, retries, epoch, reconcile, compaction; return whether the lookup index is due.

        A Redis outage (or a full Redis) only postpones them: the next step tries again.
        """
        p = self.parts
        harvester, reconciler = p.completions.harvester, p.completions.reconciler
        lookup_due = False
        try:
            if time.monotonic() >= self.next_epoch_check:
                self.check_epoch()
            harvested = harvester.harvest()
            lookup_due = harvested > 0 or harvester.started_harvested > 0
            if self.watcher is not None:
                self.watcher.harvested()
            p.admission.settle()  # duplicates whose key's owner finished now
            self.publish_due |= harvested > 0
            redo = reconciler.redo()  # a refill pass after Redis lost state first
            if redo:
                # RedisFull: pushed again before the pass goes on
                reconciler.redone(p.push(redo), p.pusher.queued)
            if p.key_limits.look():  # the limit keys' room, once per step (one call)
                p.state.figures_changed()
            p.backlog.look()  # outcomes made room: top the windows up
            # Due retries first: the refill would take all the room, and a retry wait for the
            # whole backlog (they are due now; the backlog waits in order anyway).
            retries = p.backlog.admit(harvester.due_retries())  # through the same window
            if retries:
                p.backlog.sent(p.push(retries))
                harvester.pushed(retries)
            refilled = p.backlog.refill()
            if refilled:
                p.save(refilled)
            p.state.flush_pushed()  # the jobs pushed as read, for a refill to find (once a second)
            if p.completions.compact():
                # Gone for good: the reader must not put their positions back in the checkpoint.
                p.reader.seek(p.state.checkpoint.positions)
                p.save(0)
            p.pusher.came_back()
        except RedisFull as exc:
            p.backlog.paused(exc)  # the harvest goes on at the next step: it frees memory
        except TransportError as exc:
            p.pusher.went_down(exc, "completions wait")
        self.publish_terminal()  # local state only: an outage must not hold it back
        return lookup_due

    def watch(self, wake: Callable[[], None]) -> None:
        """Wake the loop (``wake``) as outcomes arrive, if the transport can block on its events."""
        p = self.parts
        if p.transport.blocking_events:
            self.watcher = EventWatcher(
                p.transport,
                p.state.checkpoint.owner,
                last_event_id=lambda: p.completions.harvester.last_event_id,
                wake=wake,
                patience_s=p.config.idle_timeout_s,
            )
            self.watcher.start()

    def unwatch(self) -> None:
        """Stop the watcher, if one runs. Idempotent."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None

    def publish_terminal(self, *, now: bool = False) -> None:
        """Save the checkpoint for its terminal count, at most every :data:`PUBLISH_TERMINAL_S`."""
        if self.publish_due and (now or time.monotonic() >= self.next_publish):
            self.parts.save(0)
            self.publish_due = False
            self.next_publish = time.monotonic() + PUBLISH_TERMINAL_S

    def publish_at(self) -> float | None:
        """When the terminal count is due (``time.monotonic()``), if it is."""
        return self.next_publish if self.publish_due else None

    def check_epoch(self) -> None:
        """Start a refill if Redis lost state since the epoch was set; TransportError if it is down."""
        p = self.parts
        epoch = p.state.checkpoint.epoch
        p.completions.reconciler.check_epoch()
        p.backlog.gate.sample(p.transport, force=True)
        check_eviction_policy(p.backlog.gate.info, allow_eviction=p.config.allow_eviction)
        # Finished jobs leave Redis: the worker deletes RQ's copy at the end (result_ttl 0).
        p.transport.default_result_ttl_s = 0.0 if self.forgetting() else None
        self.next_epoch_check = time.monotonic() + EPOCH_CHECK_S
        if p.state.checkpoint.epoch != epoch:
            p.backlog.windows.reset()  # an emptied queue is not a drain (no rate, no boost)
            p.key_limits.forget()  # every key's room is read again (its quarantine) before it pushes
            p.save(0)

    def forgetting(self) -> bool:
        """Whether finished jobs leave Redis at their harvest (default: if it has a maxmemory)."""
        if self.parts.config.forget_finished is not None:
            return self.parts.config.forget_finished
        info = self.parts.backlog.gate.info
        return info is not None and info.maxmemory > 0
