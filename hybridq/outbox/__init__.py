"""Enqueue inside the application's own database transaction: the transactional outbox.

The package owns :class:`Outbox` (``enqueue``; loaded on first use, so that reading the table
or its backlog loads no producer), its table (``schema``, ``store``), the relay that moves
committed rows into the journal (``relay``, ``pg``, ``background``), its backlog figures
(``backlog``) and exactly-once side effects in the same transaction (``once``). It may use the
producer's checks, the journal, the envelope and the signing keys; never Redis or a transport.

``Outbox.enqueue(conn, f, *args, ...)`` validates the call exactly as ``Queue.enqueue`` does,
builds its envelope (job id and idempotency key fixed now), and INSERTs it as one row on
``conn``, inside whatever transaction the application has open there: rolled back, there is no
job; committed, the job is accepted. The relay (:mod:`hybridq.outbox.relay`, ``hybridq relay``)
moves committed rows into the journal. ``docs/outbox.md`` says what is guaranteed.

``conn`` is a ``sqlite3`` connection, a psycopg 3 connection, or a SQLAlchemy ``Connection`` or
``Session`` (over SQLite or PostgreSQL). psycopg and SQLAlchemy are never imported here: an
object is recognised as theirs only when their modules are already loaded (they must be, for
the application to hold one). This module must not import redis or rq.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridq.lazy import lazy_names

if TYPE_CHECKING:
    from hybridq.outbox.enqueue import DEFAULT_KEY_PREFIX, SUPPORTED_CONNECTIONS, Outbox
    from hybridq.outbox.once import DEFAULT_DONE_TABLE
    from hybridq.outbox.schema import DEFAULT_TABLE

__all__ = ["DEFAULT_DONE_TABLE", "DEFAULT_KEY_PREFIX", "DEFAULT_TABLE", "SUPPORTED_CONNECTIONS", "Outbox"]

# Loaded on first use: Outbox imports the producer (its queue's checks, ~200 ms of a start), which
# the readers of the outbox's table and backlog (``hybridq status --outbox``) never uses.
__getattr__, __dir__ = lazy_names(
    globals(),
    {
        "DEFAULT_DONE_TABLE": ".once",
        "DEFAULT_KEY_PREFIX": ".enqueue",
        "DEFAULT_TABLE": ".schema",
        "Outbox": ".enqueue",
        "SUPPORTED_CONNECTIONS": ".enqueue",
    },
)
