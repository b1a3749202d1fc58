"""Test support shipped in the package: not the product, and nothing in the product imports it.

* :mod:`hybridq.testing.memory` — :class:`MemoryTransport`, an in-memory transport with a
  simulated worker, for testing your own code without Redis (also importable as
  ``hybridq.transport.MemoryTransport``).
* :mod:`hybridq.testing.embedded` — a private redis-server process (the test suite, benchmarks
  and ``hybridq demo``).
* :mod:`hybridq.testing.chaos` and :mod:`hybridq.testing.faultproxy` — the project's own
  fault-injection harness behind ``hybridq chaos`` (``docs/reliability.md``); not an API.

Importing this package imports none of them.
"""
