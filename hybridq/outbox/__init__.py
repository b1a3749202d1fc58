"""Enqueue inside the application's own database transaction: the transactional outbox.

``Outbox.enqueue(conn, f, *args, ...)`` validates the call exactly as ``Queue.enqueue`` does,
builds its envelope (job id and idempotency key fixed now), and INSERTs it as one row on
``conn``, inside whatever transaction the application has open there: rolled back, there is no
job; committed, the job is accepted. The relay (:mod:`hybridq.outbox.relay`, ``hybridq relay``)
moves committed rows into the journal. ``docs/outbox.md`` says what is guaranteed.

This version supports ``sqlite3`` connections only (PostgreSQL and SQLAlchemy come later).
This module must not import redis or rq.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import Any

from hybridq.envelope import Envelope, validate_queue_name
from hybridq.errors import RecordTooLarge
from hybridq.journal import MAX_PAYLOAD_BYTES
from hybridq.outbox.once import DEFAULT_DONE_TABLE, Once
from hybridq.outbox.schema import DEFAULT_TABLE, create_table, ddl, validate_table
from hybridq.producer import Queue, split_call
from hybridq.signing import keyring

__all__ = ["DEFAULT_DONE_TABLE", "DEFAULT_TABLE", "Outbox"]

#: The connection types ``Outbox.enqueue`` accepts in this version (said when it refuses one).
SUPPORTED_CONNECTIONS = "sqlite3.Connection"


class _Validator(Queue):
    """``Queue.prepare`` without a journal: the outbox validates with the very same code.

    A queue's journal, capacity and writer are not used by ``prepare``; only its name and its
    defaults are, and an outbox job has no per-queue defaults (each call gives its options).
    """

    def __init__(self, name: str) -> None:
        self.name = validate_queue_name(name)
        self.default_timeout = None
        self.default_result_ttl = None
        self.default_retry = None


class Outbox:
    """An outbox table the application enqueues into inside its own transactions.

    Args:
        table: the table's name (a plain SQL identifier); create it with
            ``hybridq outbox init`` or :meth:`create_table`.
    """

    def __init__(self, table: str = DEFAULT_TABLE) -> None:
        self.table = validate_table(table)
        self._insert = (
            f"INSERT INTO {self.table} (job_id, idempotency_key, queue, envelope, created_at) "  # noqa: S608 - validated identifier
            "VALUES (?, ?, ?, ?, ?)"
        )
        self._validators: dict[str, _Validator] = {}

    def __repr__(self) -> str:
        return f"<hybridq.Outbox table={self.table!r}>"

    def enqueue(
        self,
        conn: Any,
        f: Callable[..., Any] | str,
        *args: Any,
        idempotency_key: str | None = None,
        queue: str = "default",
        **kwargs: Any,
    ) -> str:
        """Insert the job ``f(*args, **kwargs)`` on ``conn``, in its open transaction; return its id.

        The keyword options are ``Queue.enqueue``'s (``job_timeout``, ``result_ttl``,
        ``description``, ``meta``, ``retry``, ``job_id``, ``delay``, ``run_at``), with the same
        validation: bad input raises (``EnvelopeError``, ``NotSerializable``, ``RecordTooLarge``)
        before anything is written. The row commits or rolls back with the caller's transaction.

        Raises:
            TypeError: ``conn`` is not a connection type this version supports.
        """
        if not isinstance(conn, sqlite3.Connection):
            raise TypeError(
                f"Outbox.enqueue supports {SUPPORTED_CONNECTIONS} only in this version, not "
                f"{type(conn).__module__}.{type(conn).__qualname__} (PostgreSQL and SQLAlchemy: not yet)"
            )
        env = self.prepare(f, args, kwargs, idempotency_key=idempotency_key, queue=queue)
        payload = env.to_bytes()
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise RecordTooLarge(len(payload), MAX_PAYLOAD_BYTES)
        try:
            conn.execute(self._insert, (env.id, env.idempotency_key, env.queue, payload, time.time()))
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise
            raise sqlite3.OperationalError(
                f"{exc}: create it with `hybridq outbox init --dsn sqlite:///PATH --table {self.table}` "
                "or Outbox.create_table(conn)"
            ) from exc
        return env.id

    def prepare(
        self,
        f: Callable[..., Any] | str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        queue: str = "default",
    ) -> Envelope:
        """The (signed, when a key is configured) envelope of a call; nothing is written."""
        validator = self._validators.get(queue)
        if validator is None:
            validator = _Validator(queue)  # raises EnvelopeError for a bad name
            self._validators[queue] = validator
        options: dict[str, Any] = {}
        call_kwargs: dict[str, Any] | None = None
        if kwargs:
            args, call_kwargs, options = split_call(args, kwargs)
        env = validator.prepare(f, args, call_kwargs, idempotency_key=idempotency_key, **options)
        ring = keyring()  # as Queue.enqueue_many: the application is the producer, it signs
        return ring.sign(env) if ring is not None else env

    def create_table(self, conn: sqlite3.Connection) -> bool:
        """Create this outbox's table on ``conn`` if missing (as ``hybridq outbox init``)."""
        return create_table(conn, self.table)

    def ddl(self) -> str:
        """The SQL that creates this outbox's table, for migrations you manage yourself."""
        return ddl(self.table)

    def once(self, conn: Any, key: str | None = None, *, table: str = DEFAULT_DONE_TABLE) -> Once:
        """``with outbox.once(conn) as first: if first: <effect on conn>``: an effect once per key.

        Records ``key`` (default: the running job's idempotency key) in the done table inside
        ``conn``'s transaction; ``first`` is False when it was already there, and the effect is
        skipped. See :class:`hybridq.outbox.once.Once` and ``docs/outbox.md``.
        """
        return Once(conn, key, table=table)
