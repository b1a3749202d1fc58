"""Exactly-once effects in the application's database: ``with outbox.once(conn) as first:``.

A task whose effect is a write to the same database records its key in a ``hybridq_done`` table
in the very transaction that makes the effect. The first run inserts the key (``first`` is
True) and makes the effect; both commit together. A later run of the same key (a re-delivery
after a crash, Redis wiped before the outcome was harvested, a producer's retry) finds the row
(``first`` is False) and skips the effect. ``docs/outbox.md`` ("Exactly-once effects") says what
is guaranteed, per database, and how long to keep the rows.

The SQL is plain enough for SQLite (``sqlite3``, ``?`` parameters) and PostgreSQL (psycopg 3,
``%s`` parameters): ``INSERT ... ON CONFLICT DO NOTHING`` never raises on a duplicate (which
would abort a PostgreSQL transaction), and a savepoint makes the block all-or-nothing.
This module must not import redis or rq.
"""

from __future__ import annotations

import sqlite3
import time
from types import TracebackType
from typing import Any

from hybridq.context import current_job
from hybridq.outbox.schema import validate_table

__all__ = ["DEFAULT_DONE_TABLE", "Once", "create_done_table", "done_ddl", "prune_done", "resolve_key"]

DEFAULT_DONE_TABLE = "hybridq_done"
#: The connection types ``once`` accepts (said when it refuses one).
SUPPORTED_CONNECTIONS = "sqlite3.Connection or psycopg.Connection (psycopg 3)"

_SAVEPOINT = "hybridq_once"
#: psycopg's ``TransactionStatus.IDLE``: no transaction open (kept as a number: no psycopg import).
_PG_IDLE = 0


def done_ddl(table: str = DEFAULT_DONE_TABLE) -> str:
    """The SQL that creates the done table (idempotent; the same text on SQLite and PostgreSQL).

    One row per key whose effect committed: ``done_at`` (Unix seconds) is what pruning reads,
    ``job_id`` the job that made the effect (NULL when ``once`` ran outside a task).
    """
    validate_table(table)
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n"
        "    idempotency_key TEXT PRIMARY KEY,\n"
        "    job_id TEXT,\n"
        "    done_at DOUBLE PRECISION NOT NULL\n"
        ");\n"
    )


def _dialect(conn: Any) -> str:
    """``"sqlite"`` or ``"postgresql"``; TypeError for a connection this module does not know."""
    if isinstance(conn, sqlite3.Connection):
        return "sqlite"
    if any(cls.__module__.partition(".")[0] == "psycopg" for cls in type(conn).__mro__):
        return "postgresql"
    raise TypeError(
        f"outbox.once supports {SUPPORTED_CONNECTIONS}, not {type(conn).__module__}.{type(conn).__qualname__}"
    )


def _in_transaction(conn: Any, dialect: str) -> bool:
    if dialect == "sqlite":
        return bool(conn.in_transaction)
    return int(conn.info.transaction_status) != _PG_IDLE


def _autocommit(conn: Any, dialect: str) -> bool:
    """Whether statements on ``conn`` commit on their own unless the caller says BEGIN."""
    if dialect == "postgresql":
        return bool(conn.autocommit)
    mode = getattr(conn, "autocommit", None)  # Python 3.12+: True, False or LEGACY (-1)
    if mode is True or mode is False:
        return mode
    return conn.isolation_level is None


def create_done_table(conn: Any, table: str = DEFAULT_DONE_TABLE) -> bool:
    """Create the done table on ``conn`` if it is missing; return whether it was created.

    On SQLite the statement commits at once (outside a transaction); on a psycopg connection
    that is not in autocommit mode, it is part of the open transaction: commit it.
    """
    dialect = _dialect(conn)
    validate_table(table)
    if dialect == "sqlite":
        sql, param = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", table
    else:
        sql, param = "SELECT 1 FROM pg_catalog.pg_tables WHERE tablename = %s", table
    existed = conn.execute(sql, (param,)).fetchone() is not None
    conn.execute(done_ddl(table))  # psycopg without autocommit: the caller commits
    return not existed


def prune_done(conn: Any, older_than_s: float, *, table: str = DEFAULT_DONE_TABLE) -> int:
    """Delete the done rows older than ``older_than_s`` seconds; return how many (caller commits).

    A pruned key no longer protects its effect: prune only keys no job can run again
    (``docs/outbox.md``, "Keeping and pruning the done rows").
    """
    dialect = _dialect(conn)
    validate_table(table)
    mark = "?" if dialect == "sqlite" else "%s"
    cur = conn.execute(
        f"DELETE FROM {table} WHERE done_at < {mark}",  # noqa: S608 - validated identifier
        (time.time() - older_than_s,),
    )
    return int(cur.rowcount)


def resolve_key(key: str | None) -> tuple[str, str | None]:
    """(the key ``once`` records, the running job's id or None).

    Without ``key``, the running job's idempotency key (its job id when the producer gave
    none); outside a task, a key is required.
    """
    job = current_job()
    if key is None:
        if job is None:
            raise RuntimeError(
                "outbox.once(conn) outside a hybridq task needs a key: outbox.once(conn, key=...) "
                "(inside a task it defaults to the job's idempotency key)"
            )
        return job.idempotency_key or job.id, job.id
    if not isinstance(key, str) or not key:
        raise ValueError(f"outbox.once key must be a non-empty string, not {key!r}")
    return key, job.id if job is not None else None


class Once:
    """The context manager ``Outbox.once`` returns; ``with`` gives True on the key's first time.

    Entering it records the key in the done table on ``conn``, inside the caller's open
    transaction (a savepoint within it). Leaving it normally keeps the row: it commits with the
    caller's transaction, together with the effect. An exception leaving the block rolls back
    to the savepoint (the row and whatever the block wrote on ``conn``) and propagates, so the
    key is never recorded without its effect. A connection in autocommit mode with no
    transaction open gets one for the block: begun on entry, committed on a normal exit.

    Args:
        conn: a ``sqlite3`` or psycopg 3 connection (the one the effect is written on).
        key: the effect's key; None: the running job's idempotency key.
        table: the done table (``done_ddl``, ``hybridq outbox init``).
    """

    def __init__(self, conn: Any, key: str | None = None, *, table: str = DEFAULT_DONE_TABLE) -> None:
        self.conn = conn
        self._dialect = _dialect(conn)
        self.table = validate_table(table)
        self.key, self.job_id = resolve_key(key)
        self.first: bool | None = None
        self._own = False  # whether this block began (and so ends) the transaction
        mark = "?" if self._dialect == "sqlite" else "%s"
        self._insert = (
            f"INSERT INTO {self.table} (idempotency_key, job_id, done_at) "  # noqa: S608 - validated identifier
            f"VALUES ({mark}, {mark}, {mark}) ON CONFLICT (idempotency_key) DO NOTHING"
        )

    def __repr__(self) -> str:
        return f"<hybridq.outbox.Once key={self.key!r} table={self.table!r} first={self.first}>"

    def __enter__(self) -> bool:
        conn = self.conn
        if not _in_transaction(conn, self._dialect):
            if _autocommit(conn, self._dialect):
                conn.execute("BEGIN")
                self._own = True
            elif self._dialect == "sqlite":
                # What sqlite3 would say before the caller's next write: the transaction stays
                # open after the block, for the caller to commit (a bare SAVEPOINT would open
                # one that its RELEASE commits).
                conn.execute(f"BEGIN {conn.isolation_level or ''}".rstrip())
            # psycopg (not autocommit) says BEGIN itself before the next statement.
        if not self._own:
            conn.execute(f"SAVEPOINT {_SAVEPOINT}")
        try:
            cur = conn.execute(self._insert, (self.key, self.job_id, time.time()))
        except BaseException as exc:
            self._undo()
            if isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc):
                raise sqlite3.OperationalError(
                    f"{exc}: create it with `hybridq outbox init --dsn sqlite:///PATH` "
                    f"or hybridq.outbox.once.create_done_table(conn, {self.table!r})"
                ) from exc
            raise
        # 1: inserted now; 0: the key's row was there (committed, or by this very transaction).
        self.first = cur.rowcount == 1
        return self.first

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self._undo()
            return
        if not _in_transaction(self.conn, self._dialect):
            return  # the caller committed (or rolled back) inside the block: nothing left to end
        self.conn.execute("COMMIT" if self._own else f"RELEASE SAVEPOINT {_SAVEPOINT}")

    def _undo(self) -> None:
        """Roll back what the block did on the connection (its savepoint, or its own transaction)."""
        if not _in_transaction(self.conn, self._dialect):
            return  # already rolled back (by the caller, or by the database after an error)
        if self._own:
            self.conn.execute("ROLLBACK")
        else:
            self.conn.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            self.conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
