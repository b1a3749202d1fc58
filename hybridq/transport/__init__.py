"""Transports: how the forwarder hands jobs to workers. The forwarder knows only :class:`Transport`.

It owns the port (``base``: :class:`Transport`), its RQ adapter on Redis (``rq``, with its Lua
scripts in ``rq_scripts`` and its job-hash fields in ``rq_codec``), queues over several Redis
instances (``sharded``, ``routes``), and the Redis URLs and clients every role connects with
(``redisurl``, ``sentinel``). It may use the protocol, the envelope and :mod:`hybridq.errors`;
never the journal, the ledger or the worker side (import-linter checks it), and only ``rq``,
``redisurl`` and ``sentinel`` import redis.

* :class:`~hybridq.testing.memory.MemoryTransport` — in-process, for unit tests (yours too); also
  importable from here, loaded only when first asked for.
* :class:`~hybridq.transport.rq.RQTransport` — RQ queues on Redis; the only module that talks to
  RQ and Redis for the forwarder.
* :class:`~hybridq.transport.sharded.ShardedTransport` — queues over several Redis instances
  (``--redis-for``): one ``RQTransport`` per Redis, each queue routed to its own.

Both pass one contract test class (``tests/integration/test_transport_contract.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridq.lazy import lazy_names

if TYPE_CHECKING:
    from hybridq.testing.memory import MemoryTransport
    from hybridq.transport.base import PushResult, Transport

__all__ = ["MemoryTransport", "PushResult", "Transport"]

# Loaded on first use: production code never imports the test double, and a worker, which
# reaches ``redisurl`` and ``routes`` through this package, does not build the port's dataclasses
# (~5 ms of its start-up).
__getattr__, __dir__ = lazy_names(
    globals(),
    {
        "MemoryTransport": "hybridq.testing.memory",
        "PushResult": ".base",
        "Transport": ".base",
    },
)
