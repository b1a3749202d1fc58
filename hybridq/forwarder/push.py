"""Pushing a batch into the transport: backoff while it is down, one log line per outage.

The forwarder's counters since it started (:class:`ForwarderStats`) are kept here too: most of
them count pushes and outages.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridq.errors import RedisFull, RedisRefused, Stopped, TransportError, UnencodableJobs
from hybridq.forwarder.state import ForwarderState
from hybridq.tracing import push_span
from hybridq.transport import Transport
from hybridq.transport.base import Delivery

__all__ = ["ForwarderStats", "Pusher", "Stopped"]

log = logging.getLogger("hybridq.forwarder")


@dataclass
class ForwarderStats:
    """Counters since this forwarder started (the durable totals are in the checkpoint)."""

    batches: int = 0
    pushed: int = 0
    duplicate_pushes: int = 0
    transport_failures: int = 0
    #: Steps retried because the disk was full.
    disk_full_retries: int = 0
    #: ``time.monotonic()`` when the transport went down, while it is down; else ``None``.
    down_since: float | None = None
    #: While a batch is being pushed: its oldest job's ``created_at`` (the forwarding lag).
    oldest_unpushed: float | None = None


class Pusher:
    """Pushes batches for one forwarder, waiting out transport outages.

    Args:
        transport: where jobs go.
        state: the forwarder's state (duplicate pushes and refused jobs are recorded there).
        stats: the forwarder's counters.
        sleep: sleeps, waking early for a stop (the forwarder's).
        stopping: whether a stop was requested.
    """

    def __init__(
        self,
        transport: Transport,
        state: ForwarderState,
        stats: ForwarderStats,
        *,
        sleep: Callable[[float], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.transport = transport
        self.state = state
        self.stats = stats
        self._sleep = sleep
        self._stopping = stopping
        self._rng = random.Random()  # noqa: S311 - backoff jitter, not security
        #: Told of each accepted push: its jobs and the bytes sent (the memory gate learns from it).
        self.on_pushed: Callable[[int, int], None] | None = None
        #: The ids of the jobs the last accepted push queued (``None``: the transport did not say).
        self.queued: frozenset[str] | None = None

    def went_down(self, exc: TransportError, what: str) -> None:
        """Count a transport failure; log only the first of an outage.

        Raises ``exc`` again if Redis refuses the configuration (RedisRefused): retrying cannot
        fix a wrong password or a denying ACL, and the journal keeps every job meanwhile.
        """
        if isinstance(exc, RedisRefused):
            raise exc
        self.stats.transport_failures += 1
        if self.stats.down_since is None:
            self.stats.down_since = time.monotonic()
            log.warning("transport unavailable (%s), retrying: %s", what, exc)

    def came_back(self) -> None:
        """Log the end of an outage, if there was one."""
        if self.stats.down_since is not None:
            log.warning("transport available again after %.1f s", time.monotonic() - self.stats.down_since)
            self.stats.down_since = None

    def push(self, batch: list[Delivery]) -> list[Delivery]:
        """Push until the transport takes the batch; back off while it is down.

        Returns what the transport accepted: the batch without the jobs it could not encode.

        Traced (a span linked to the jobs' enqueue spans) when a tracer is configured.

        Raises :class:`Stopped` if a stop is requested while the transport is down, and
        :class:`RedisFull` at once if Redis answers ``OOM`` (the caller leaves the jobs in its
        run table: waiting for memory must not hold back the harvest that frees it).
        """
        if not batch:
            return []
        with push_span((d.envelope.trace for d in batch), len(batch)):
            return self._push(batch)

    def _push(self, batch: list[Delivery]) -> list[Delivery]:
        self.stats.oldest_unpushed = min(d.envelope.created_at for d in batch)
        delay = self.state.config.backoff_initial_s
        while True:
            try:
                result = self.transport.push(batch)
            except UnencodableJobs as exc:
                # Not an outage: these would fail again on every retry, holding back the rest.
                batch = self._drop_unencodable(batch, exc)
                if not batch:
                    return batch
                continue
            except RedisFull:
                raise
            except TransportError as exc:
                self.went_down(exc, f"holding {len(batch)} jobs")
                self._sleep(self._rng.uniform(delay / 2, delay))
                if self._stopping():
                    raise Stopped from exc
                delay = min(self.state.config.backoff_max_s, delay * 2)
                continue
            self.came_back()
            self.stats.oldest_unpushed = None
            self.stats.batches += 1
            self.stats.pushed += result.pushed
            self.stats.duplicate_pushes += result.already_present
            self.state.count_duplicates(result.already_present)
            self.queued = result.queued
            if self.on_pushed is not None:
                self.on_pushed(len(batch), result.sent_bytes)
            return batch

    def _drop_unencodable(self, batch: list[Delivery], exc: UnencodableJobs) -> list[Delivery]:
        """Record the jobs the transport refused as invalid (durably, before the checkpoint moves)."""
        refused = {id(delivery) for delivery, _ in exc.rejected}
        for delivery, reason in exc.rejected:
            self.state.record_invalid(delivery.loc, delivery.envelope.id)
            log.error(
                "skipping job %s (record %s:%d:%d): the transport cannot encode it: %s",
                delivery.envelope.id,
                *delivery.loc,
                reason,
            )
        return [d for d in batch if id(d) not in refused]
