"""The forwarder's completions side: outcomes in, redeliveries out, dead segments deleted.

One object per forwarder builds and holds the three parts that run after each forwarding step,
all working on the forwarder's one :class:`~hybridq.forwarder.state.ForwarderState`:

* :class:`~hybridq.forwarder.harvest.Harvester`: completion events into the ledger, due retries;
* :class:`~hybridq.forwarder.reconcile.Reconciler`: the epoch check, refill and reconcile passes;
* :class:`~hybridq.forwarder.dead_segments.Compactor`: dead journal segments, then ledger segments.

Its counters are what ``hybridq_*`` metrics and tests read (``forwarder.completions``).

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

from hybridq.forwarder.dead_segments import Compactor
from hybridq.forwarder.harvest import Harvester
from hybridq.forwarder.reconcile import Reconciler
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import JournalWriter
from hybridq.ledger.index import LedgerIndex
from hybridq.transport.base import Transport

__all__ = ["Upkeep"]


class Upkeep:
    """Harvest, retries, reconciliation and compaction for one forwarder (see module docstring)."""

    def __init__(self, state: ForwarderState, transport: Transport) -> None:
        self.state = state
        self.harvester = Harvester(state, transport)
        self.reconciler = Reconciler(state, transport, self.harvester)
        self.harvester.holds = self.reconciler.holds  # a refusal takes no held job back
        self.compactor = Compactor(state)

    def open(self) -> None:
        """Once the state is loaded: finish deletions a crash interrupted."""
        self.compactor.finish_deletions()

    def compact(self) -> bool:
        """Delete dead segments (never under a pass, nor under a restart's deferred count).

        Either may be reading one: a segment gone under its reader would stop the forwarder.
        Returns whether chains compacted away whole were dropped from the checkpoint.
        """
        return not self.reconciler.passing and self.state.pending_ready and self.compactor.compact()

    def hurry(self, *, reconcile: bool = True) -> None:
        """Run compaction (and a reconcile pass) at the next step, whatever their timers say."""
        if reconcile:
            self.reconciler.hurry()
        self.compactor.hurry()

    # -- what metrics, status and tests read ----------------------------------------------------

    @property
    def index(self) -> LedgerIndex:
        """The ledger's index (which jobs are terminal, retrying, lost, failed)."""
        return self.state.index

    @property
    def terminal_total(self) -> int:
        """Jobs durably terminal: in compacted segments plus in the ledger's index."""
        return self.state.terminal_total

    @property
    def retrying(self) -> int:
        """Jobs waiting for their next attempt."""
        return len(self.state.index.retries)

    @property
    def dropped_events(self) -> int:
        """Completion events dropped because they did not parse (garbled, forged, out of range)."""
        return self.harvester.dropped_events

    @property
    def late_events(self) -> int:
        """Completion events for jobs the ledger already held as terminal."""
        return self.harvester.late_events

    @property
    def redelivered(self) -> int:
        """Jobs delivered again by reconcile passes (lost, missing, stranded)."""
        return self.reconciler.redelivered

    @property
    def refilled(self) -> int:
        """Jobs refill passes brought up to date after Redis lost or rolled back state."""
        return self.reconciler.refilled

    @property
    def purged(self) -> int:
        """Queued copies of finished jobs refill passes deleted."""
        return self.reconciler.purged

    # Tests tune the grace periods and look at the pass and the ledger writer.

    @property
    def done_grace_s(self) -> float:
        """How long a job may stay "done" in Redis without its event before it is delivered again."""
        return self.reconciler.done_grace_s

    @done_grace_s.setter
    def done_grace_s(self, seconds: float) -> None:
        self.reconciler.done_grace_s = seconds

    @property
    def stranded_grace_s(self) -> float:
        """How long a job may stay "stranded" (queued nowhere) before it is delivered again."""
        return self.reconciler.stranded_grace_s

    @stranded_grace_s.setter
    def stranded_grace_s(self, seconds: float) -> None:
        self.reconciler.stranded_grace_s = seconds

    @property
    def _pass(self) -> object | None:
        return True if self.reconciler.passing else None  # white-box tests wait for a pass to end

    @property
    def _writer(self) -> JournalWriter | None:
        return self.state._writer  # white-box tests look at the ledger chain
