"""Test support shipped in the package: not the product, and nothing in the product imports it.

It owns the fakes and harnesses below and ``hybridq demo`` (:mod:`hybridq.testing.demo`, a
showcase on a private Redis); it may use every other package, and only the command line imports
it (for ``hybridq demo`` and ``hybridq chaos``).

For testing your own code (docs/testing.md), importable from here:

* :class:`LocalQueue`, :func:`eager` (:mod:`hybridq.testing.local`) — every enqueue of the
  process runs its job here, at ``enqueue`` or at ``drain()``; no journal, no Redis. The pytest
  fixtures ``hybridq_queue`` and ``hybridq_eager`` (:mod:`hybridq.testing.pytest_plugin`,
  registered with pytest by the package) give one per test.
* :func:`fake_stack` (:mod:`hybridq.testing.fakestack`) — the real forwarder, RQ and worker
  code on an in-process fakeredis (the ``testing`` extra: ``fakeredis[lua]``).

And the project's own:

* :mod:`hybridq.testing.memory` — :class:`MemoryTransport`, an in-memory transport with a
  simulated worker (also importable as ``hybridq.transport.MemoryTransport``); what it holds,
  its faults and snapshots in :mod:`~hybridq.testing.memory_state`.
* :mod:`hybridq.testing.embedded` — a private redis-server process (the test suite, benchmarks
  and ``hybridq demo``); where its binary comes from in :mod:`~hybridq.testing.embedded_find`.
* :mod:`hybridq.testing.postgres` — a private PostgreSQL (the test suite, ``scripts/bench-outbox``,
  and ``python -m hybridq.testing.postgres`` to try the outbox on: docs/outbox.md).
* :mod:`hybridq.testing.chaos` and :mod:`hybridq.testing.faultproxy` — the project's own
  fault-injection harness behind ``hybridq chaos`` (``docs/reliability.md``); not an API.
* :mod:`hybridq.testing.torture` (with :mod:`~hybridq.testing.torture_stack`, its processes and
  faults, and :mod:`~hybridq.testing.torture_check`, its independent checker) — the pool
  worker's torture tier, ``python -m hybridq.testing.torture`` (``scripts/torture``,
  ``docs/torture.md``); :mod:`hybridq.testing.ahead` makes a pool under test take jobs ahead
  whatever runs. Not an API.

Importing this package imports none of them: a name loads its module when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridq.testing.fakestack import FakeStack, fake_stack
    from hybridq.testing.local import LocalJob, LocalQueue, eager

__all__ = ["FakeStack", "LocalJob", "LocalQueue", "eager", "fake_stack"]

_LAZY = {
    "FakeStack": ".fakestack",
    "fake_stack": ".fakestack",
    "LocalJob": ".local",
    "LocalQueue": ".local",
    "eager": ".local",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
