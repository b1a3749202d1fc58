"""Transports: how the forwarder hands jobs to workers. The forwarder knows only :class:`Transport`.

* :class:`~hybridq.transport.memory.MemoryTransport` — in-process, for unit tests (yours too).
* :class:`~hybridq.transport.rq.RQTransport` — RQ queues on Redis; the only module that talks to
  RQ and Redis for the forwarder.

Both pass one contract test class (``tests/unit/test_transport_contract.py``).
"""

from .base import PushResult, Transport
from .memory import MemoryTransport

__all__ = ["MemoryTransport", "PushResult", "Transport"]
