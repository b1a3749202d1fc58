"""The figures ``hybridq.stats`` reads, as the forwarder writes them (``stats.state``, a cache).

:class:`StatsSnapshot` writes the snapshot (:class:`hybridq.lookup.stats.Snapshot`) of the
checkpoint, the ledger's index, the compaction counters and the jobs read and not terminal, with
each checkpoint save and at the end of a step in which they changed; and once more when closing
sealed the ledger segment it names. A failure to write it only makes ``hybridq.stats`` fall back
to reading the journal (docs/journal-format.md): it is tried again at the end of the next step.
:class:`~hybridq.forwarder.state.ForwarderState` holds one and says when.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from hybridq.ledger.checkpoint import Checkpoint
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.lookup.pending import PendingTracker
from hybridq.lookup.stats import Snapshot, ledger_tail, save_snapshot

__all__ = ["StatsSnapshot"]

log = logging.getLogger("hybridq.forwarder")


class StatsSnapshot:
    """The stats snapshot of one journal: whether it is stale, and the one written last."""

    def __init__(self, journal: str) -> None:
        self.journal = journal
        #: Whether the ledger or the compaction state changed since the last snapshot.
        self.stale = False
        #: The ledger chains loaded into the index when it started (its own is joined at each write).
        self.known: set[str] = set()
        self._snapshot: Snapshot | None = None

    def write(
        self,
        checkpoint: Checkpoint,
        index: LedgerIndex,
        compacted: Compacted,
        pending: PendingTracker,
        *,
        own_chain: str | None,
        figures: Callable[[], tuple[dict[str, dict[str, Any]], dict[str, Any] | None]] | None,
        limit_figures: Callable[[], dict[str, dict[str, Any]]] | None,
    ) -> None:
        """Write the snapshot of these (``figures``: the window's; ``limit_figures``: the keys')."""
        known = self.known | ({own_chain} if own_chain is not None else set())
        try:
            snapshot = Snapshot.of(
                checkpoint,
                index,
                compacted,
                pending,
                known,
                journal=self.journal,
                own_chain=own_chain,
            )
            if figures is not None:
                snapshot.queue_detail, snapshot.redis_memory = figures()
            if limit_figures is not None:
                snapshot.limit_keys = limit_figures()
            save_snapshot(self.journal, snapshot)
        except OSError as exc:
            # Tried again at the end of each step; meanwhile the old one is stale.
            self._snapshot, self.stale = None, True
            log.debug("cannot write the stats snapshot (hybridq.stats scans instead): %s", exc)
            return
        self._snapshot, self.stale = snapshot, False

    def sealed_ledger(self) -> None:
        """Closing sealed the ledger segment the snapshot names: say so, if nothing else changed."""
        snap = self._snapshot
        if snap is None or self.stale or snap.ledger_tail is None:
            return  # an older snapshot, or none: readers scan while no forwarder runs
        snap.ledger_tail = ledger_tail(self.journal, snap.ledger_tail[0])
        with contextlib.suppress(OSError):
            save_snapshot(self.journal, snap)
