"""The forwarder's stats, published to Redis for ``hybridq status --all`` (one view of many journals).

Each forwarder sharing a Redis writes a small JSON snapshot of its figures there (the counts
``hybridq status`` shows, its backlog, its oldest waiting job) every
:attr:`~hybridq.forwarder.config.ForwarderConfig.stats_every_s`, from its own loop: at the end of a
step and between the batches of a long one. The key expires after three times that, so a
forwarder that died, hangs or lost Redis drops out of the view as *stale* (docs/operations.md,
"One view of many journals").

It is a display, never an input: nothing reads it to decide anything, and anyone who can write
to Redis can forge it (docs/security.md). Publishing is best effort: a failure is logged at debug
level and never slows the loop down beyond one Redis call.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from hybridq.forwarder.push import ForwarderStats
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import ChainPosition
from hybridq.ledger.compacted import AcceptedCounter
from hybridq.transport import Transport

__all__ = ["STATS_VERSION", "TTL_INTERVALS", "StatsPublisher"]

log = logging.getLogger("hybridq.forwarder")

#: The version of the published JSON (``v``); a reader skips snapshots of other versions.
STATS_VERSION = 1
#: The snapshot's TTL, in publishing intervals: a forwarder that missed this many is stale.
TTL_INTERVALS = 3


class StatsPublisher:
    """Publishes one forwarder's figures through its transport, at most every ``every_s``.

    Args:
        state: the forwarder's durable state (counts, pending jobs per queue, the oldest one).
        stats: its counters (the forwarding lag).
        transport: where to publish (:meth:`Transport.publish_stats`).
        every_s: the interval; 0 publishes nothing.
    """

    def __init__(
        self, state: ForwarderState, stats: ForwarderStats, transport: Transport, every_s: float
    ) -> None:
        self.state = state
        self.stats = stats
        self.transport = transport
        self.every_s = every_s
        # Counting the whole journal again took the first snapshot 0.14 s per 200,000 records
        # inside the forwarder's loop: only what lies past the forwarder's position is read.
        self._accepted = AcceptedCounter(state.journal, since=self._read)
        self._next = 0.0
        self._host = socket.gethostname()
        #: Snapshots published by this process (tests and the log read it).
        self.published = 0

    def _read(self) -> tuple[int, dict[str, ChainPosition]]:
        """How many jobs the forwarder has read, and where it stands in the journal."""
        state = self.state
        return state.compacted.accepted + state.pending.consumed, dict(state.checkpoint.positions)

    def due_at(self) -> float | None:
        """When the next snapshot is due (``time.monotonic()``; the idle wait ends then), if ever."""
        return self._next if self.every_s > 0 and self.transport.publishes_stats else None

    def maybe_publish(self) -> None:
        """Publish if the interval has passed since the last attempt (cheap otherwise)."""
        if self.due_at() is None or self.stats.down_since is not None or time.monotonic() < self._next:
            return
        if not self.state.pending_ready:
            return  # the jobs read before this start are being counted
        self._next = time.monotonic() + self.every_s
        try:
            body = json.dumps(self.figures(), separators=(",", ":")).encode()
            self.transport.publish_stats(self.state.checkpoint.owner, body, self.every_s * TTL_INTERVALS)
        except Exception as exc:  # a display: nothing it meets may stop the forwarder
            log.debug("cannot publish the stats snapshot (status --all shows it stale): %s", exc)
            return
        self.published += 1

    def figures(self) -> dict[str, Any]:
        """The snapshot: what ``hybridq status`` counts, as this forwarder holds it in memory.

        ``not_yet_forwarded`` is what the journal holds beyond what the forwarder has read.
        """
        state = self.state
        outcomes = state.outcome_counts()
        succeeded = outcomes["succeeded"]
        cancelled = outcomes["cancelled"]
        failed = outcomes["failed"] + outcomes["invalid"] + cancelled  # as status counts them
        accepted = self._accepted.count()
        read = state.compacted.accepted + state.pending.consumed
        now = time.time()
        oldest = state.pending.oldest()
        unpushed = self.stats.oldest_unpushed
        return {
            "v": STATS_VERSION,
            "owner": state.checkpoint.owner,
            "host": self._host,
            "pid": os.getpid(),
            "journal": state.journal,
            "published_at": round(now, 3),
            "every_s": self.every_s,
            "ttl_s": self.every_s * TTL_INTERVALS,
            "accepted": accepted,
            "forwarded": state.checkpoint.forwarded,
            "succeeded": succeeded,
            "failed": failed,
            "pending": max(0, accepted - succeeded - failed),
            "cancelled": cancelled,
            "duplicates_suppressed": outcomes["dups"],
            "not_yet_forwarded": max(0, accepted - read),
            "delayed_held": len(state.checkpoint.held),
            "retrying": len(state.index.retries),
            "queues": dict(state.pending.pending),
            "oldest_pending_age_s": 0.0 if oldest is None else round(max(0.0, now - oldest), 3),
            "forwarding_lag_s": 0.0 if unpushed is None else round(max(0.0, now - unpushed), 3),
        }
