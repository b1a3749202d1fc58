"""The :class:`Outbox` class: a job INSERTed on the application's connection, in its transaction.

It owns what ``Outbox.enqueue`` does (the package's docstring says what it is for): the call
validated by the very code ``Queue.enqueue`` runs (:class:`_Validator`, a journal-less queue),
the envelope signed when a key is configured, and the row written through sqlite3, psycopg 3 or
SQLAlchemy. Kept out of the package's ``__init__`` (which re-exports it lazily) because it
imports the producer: ``hybridq status --outbox`` reads the outbox's table and
backlog without it (docs/architecture.md). This module must not import redis or rq.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from collections.abc import Callable
from typing import Any

from hybridq.envelope.model import Envelope, new_job_id, validate_queue_name
from hybridq.errors import EnvelopeError, RecordTooLarge
from hybridq.journal import MAX_PAYLOAD_BYTES
from hybridq.outbox.once import DEFAULT_DONE_TABLE, Once
from hybridq.outbox.schema import DEFAULT_TABLE, Dialect, create_table, ddl, validate_table
from hybridq.producer.calls import split_call
from hybridq.producer.flows import is_workflow
from hybridq.producer.queue import Queue
from hybridq.security.signing import keyring

__all__ = ["DEFAULT_KEY_PREFIX", "SUPPORTED_CONNECTIONS", "Outbox"]

#: The connection types ``Outbox.enqueue`` accepts (said when it refuses one).
SUPPORTED_CONNECTIONS = (
    "a sqlite3.Connection, a psycopg.Connection (psycopg 3), or a SQLAlchemy Connection or Session"
)
_COLUMNS = "(job_id, idempotency_key, queue, envelope, created_at)"


#: The idempotency key of an outbox job enqueued without one: this prefix and its job id.
DEFAULT_KEY_PREFIX = "outbox:"


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
        self.remote = None  # never remote: it only prepares


class Outbox:
    """An outbox table the application enqueues into inside its own transactions.

    Args:
        table: the table's name (a plain SQL identifier); create it with
            ``hybridq outbox init`` or :meth:`create_table`.
    """

    def __init__(self, table: str = DEFAULT_TABLE) -> None:
        self.table = validate_table(table)
        # The same INSERT in each driver's parameter style (the table name is a validated identifier).
        self._insert = f"INSERT INTO {self.table} {_COLUMNS} VALUES (?, ?, ?, ?, ?)"  # noqa: S608
        self._insert_pg = f"INSERT INTO {self.table} {_COLUMNS} VALUES (%s, %s, %s, %s, %s)"  # noqa: S608
        self._insert_sa: Any = None  # a sqlalchemy TextClause, made on first use
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
        ``description``, ``meta``, ``retry``, ``job_id``, ``delay``, ``run_at``, ``priority``,
        ``limit_key``), with the same
        validation: bad input raises (``EnvelopeError``, ``NotSerializable``, ``RecordTooLarge``)
        before anything is written. The row commits or rolls back with the caller's transaction.

        Raises:
            TypeError: ``conn`` is none of the connection types supported (``SUPPORTED_CONNECTIONS``).
        """
        kind = _kind(conn)  # TypeError before anything else
        env = self.prepare(f, args, kwargs, idempotency_key=idempotency_key, queue=queue)
        payload = env.to_bytes()
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise RecordTooLarge(len(payload), MAX_PAYLOAD_BYTES)
        row = (env.id, env.idempotency_key, env.queue, payload, time.time())
        if kind == "sqlite3":
            self._insert_sqlite(conn, row)
        elif kind == "psycopg":
            try:
                conn.execute(self._insert_pg, row)
            except sys.modules["psycopg"].errors.UndefinedTable as exc:
                exc.add_note(self._missing_table_hint("postgresql://..."))
                raise
        else:
            self._insert_sqlalchemy(conn, row)
        return env.id

    def _insert_sqlite(self, conn: sqlite3.Connection, row: tuple[Any, ...]) -> None:
        try:
            conn.execute(self._insert, row)
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise
            raise sqlite3.OperationalError(f"{exc}: {self._missing_table_hint('sqlite:///PATH')}") from exc

    def _insert_sqlalchemy(self, conn: Any, row: tuple[Any, ...]) -> None:
        """Through SQLAlchemy: its Connection or Session runs it in the transaction it has open."""
        if self._insert_sa is None:
            from sqlalchemy import text  # noqa: PLC0415 - loaded already: conn is one of its objects

            names = ("job_id", "idempotency_key", "queue", "envelope", "created_at")
            values = ", ".join(f":{name}" for name in names)
            self._insert_sa = text(f"INSERT INTO {self.table} {_COLUMNS} VALUES ({values})")  # noqa: S608
        job_id, key, queue, payload, created_at = row
        params = {"job_id": job_id, "idempotency_key": key, "queue": queue, "envelope": payload}
        try:
            conn.execute(self._insert_sa, {**params, "created_at": created_at})
        except sys.modules["sqlalchemy.exc"].DBAPIError as exc:
            if "no such table" in str(exc) or "does not exist" in str(exc):
                exc.add_note(self._missing_table_hint("DSN"))
            raise

    def _missing_table_hint(self, dsn: str) -> str:
        return (
            f"create it with `hybridq outbox init --dsn {dsn} --table {self.table}` "
            "or Outbox.create_table(conn)"
        )

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
        if "depends_on" in options or is_workflow(f):
            raise EnvelopeError(
                "the outbox takes neither workflows nor depends_on: use a Queue (docs/workflows.md)"
            )
        if idempotency_key is None:
            # An explicit key, so that the forwarder remembers it (enqueue-if-absent) past the
            # compaction of the job's record: a row that a relay appends again after a crash or
            # a failed delete is then never a second job (docs/outbox.md, "What it guarantees").
            job_id = options.get("job_id")
            if job_id is None:
                job_id = options["job_id"] = new_job_id()
            if isinstance(job_id, str):  # anything else: refused by prepare below
                idempotency_key = f"{DEFAULT_KEY_PREFIX}{job_id}"
        env = validator.prepare(f, args, call_kwargs, idempotency_key=idempotency_key, **options)
        ring = keyring()  # as Queue.enqueue_many: the application is the producer, it signs
        return ring.sign(env) if ring is not None else env

    def create_table(self, conn: Any) -> bool:
        """Create this outbox's table on a sqlite3 or psycopg ``conn`` if missing (as ``outbox init``)."""
        return create_table(conn, self.table)

    def ddl(self, dialect: Dialect = "sqlite") -> str:
        """The SQL that creates this outbox's table (``sqlite`` or ``postgresql``), for your migrations."""
        return ddl(self.table, dialect=dialect)

    def once(self, conn: Any, key: str | None = None, *, table: str = DEFAULT_DONE_TABLE) -> Once:
        """``with outbox.once(conn) as first: if first: <effect on conn>``: an effect once per key.

        Records ``key`` (default: the running job's idempotency key) in the done table inside
        ``conn``'s transaction; ``first`` is False when it was already there, and the effect is
        skipped. See :class:`hybridq.outbox.once.Once` and ``docs/outbox.md``.
        """
        return Once(conn, key, table=table)


def _kind(conn: Any) -> str:
    """``sqlite3``, ``psycopg`` or ``sqlalchemy``: which driver ``conn`` belongs to; TypeError if none."""
    if isinstance(conn, sqlite3.Connection):
        return "sqlite3"
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(conn, psycopg.Connection):
        return "psycopg"
    engine, orm = sys.modules.get("sqlalchemy.engine"), sys.modules.get("sqlalchemy.orm")
    if (engine is not None and isinstance(conn, engine.Connection)) or (
        orm is not None and isinstance(conn, orm.Session)
    ):
        return "sqlalchemy"
    raise TypeError(
        f"Outbox.enqueue supports {SUPPORTED_CONNECTIONS}, not "
        f"{type(conn).__module__}.{type(conn).__qualname__}"
    )
