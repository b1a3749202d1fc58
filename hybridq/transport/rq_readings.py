"""What the RQ transport reads of Redis for the forwarder's figures, and its published stats.

:class:`RQReadings` holds :class:`~hybridq.transport.rq.RQTransport`'s methods that push and
claim nothing: Redis's memory (the high-water mark), the queues' lengths, the limit keys' use,
and the stats snapshots published for ``hybridq.stats`` (:mod:`.rq_stats`). Apart from
:mod:`hybridq.transport.rq` so that module keeps to the jobs' way in and out of Redis (the
push, refill, probe, cancel and events); :class:`~hybridq.transport.rq.RQTransport` inherits
these, so they are called, and overridden, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis
from redis.exceptions import RedisError, ResponseError

from hybridq.protocol import keys
from hybridq.transport.redisurl import refusal, transport_error

from . import rq_limits, rq_stats
from .base import KeyUse, MemoryInfo, Published, Transport
from .rq_codec import memory_info

__all__ = ["RQReadings"]


class RQReadings(Transport):
    """The readings of :class:`~hybridq.transport.rq.RQTransport` (see module docstring)."""

    connection: redis.Redis
    _key_use: Any

    def memory(self) -> MemoryInfo | None:
        """``INFO memory``: used, ``maxmemory`` and its policy (both ACL users may run INFO).

        ``None`` (unknown: the high-water mark off) where ``INFO`` is not a command (fakeredis,
        :func:`hybridq.testing.fake_stack`) or the ACL refuses it: a Redis that cannot say is
        not a Redis that is down.
        """
        try:
            # One name, so redis-py sends INFO memory and skips its parser of INFO, which types
            # every line (most of the sample's cost, about ten times a second while pushing).
            raw = self.connection.execute_command("INFO memory")  # type: ignore[no-untyped-call]
        except ResponseError as exc:
            if _unknown_or_denied(exc):
                return None
            raise transport_error(exc) from exc
        except RedisError as exc:
            raise transport_error(exc) from exc
        return memory_info(raw)

    def queue_lengths(self, queues: Sequence[str]) -> dict[str, int]:
        """``LLEN`` of each queue: one command for one queue, else one pipeline."""
        if not queues:
            return {}
        try:
            if len(queues) == 1:  # the usual case: no pipeline to build (one per step)
                lengths: list[Any] = [self.connection.llen(keys.rq_queue(queues[0]))]
            else:
                pipe = self.connection.pipeline(transaction=False)
                for queue in queues:
                    pipe.llen(keys.rq_queue(queue))
                lengths = pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc
        return {queue: int(n) for queue, n in zip(queues, lengths, strict=True)}

    def key_use(
        self, periods: Mapping[str, int], added: Mapping[str, int], *, lease_s: float
    ) -> dict[str, KeyUse] | None:
        """Each limit key's use, in one script call (see :meth:`Transport.key_use`)."""
        if self._key_use is None:
            self._key_use = self.connection.register_script(rq_limits.KEY_USE)
        try:
            return rq_limits.key_use(self._key_use, lease_s, periods, added)
        except RedisError as exc:
            raise transport_error(exc) from exc

    publishes_stats = True

    def publish_stats(self, owner: str, body: bytes, ttl_s: float) -> None:
        """Set ``owner``'s snapshot with its TTL and note it in the set of forwarders (:mod:`.rq_stats`)."""
        try:
            rq_stats.publish(self.connection, owner, body, ttl_s)
        except RedisError as exc:
            raise transport_error(exc) from exc

    def read_stats(self, limit: int) -> list[Published]:
        """The published snapshots seen by Redis's time, the most recent first (:mod:`.rq_stats`)."""
        try:
            return rq_stats.read(self.connection, limit)[1]
        except RedisError as exc:
            raise transport_error(exc) from exc

    def forget_stats(self, owner: str) -> bool:
        """Remove ``owner``'s snapshot and entry (:mod:`.rq_stats`)."""
        try:
            return rq_stats.forget(self.connection, owner)
        except RedisError as exc:
            raise transport_error(exc) from exc


def _unknown_or_denied(exc: ResponseError) -> bool:
    """Whether Redis refused a command as unknown or not allowed (not a failure of Redis)."""
    return str(exc).lower().startswith("unknown command") or refusal(exc) is not None
