"""The outbox table on SQLite and PostgreSQL: its DSN, its DDL, and opening it (issue 16).

The table holds one row per job an application enqueued inside its own transaction
(``docs/outbox.md``). Each row carries the job's envelope, already validated and serialized
(and signed, when a signing key is configured) at insert time, so the job id and idempotency key
are fixed before the relay ever sees the row.

psycopg (PostgreSQL) is imported only when a PostgreSQL DSN or connection is used: SQLite
users need nothing beyond the standard library. This module must not import redis, rq or click.
"""

from __future__ import annotations

import math
import os
import re
import sqlite3
from typing import Any, Literal

from hybridq.extras import missing
from hybridq.transport.redisurl import redact_url

__all__ = [
    "DEFAULT_TABLE",
    "SET_ASIDE",
    "SUPPORTED_DSNS",
    "Dialect",
    "connect",
    "create_table",
    "ddl",
    "dialect_of",
    "first_line",
    "is_postgres",
    "sqlite_path",
    "table_exists",
    "validate_table",
]

DEFAULT_TABLE = "hybridq_outbox"
#: ``relaying`` of a row the relay set aside: it cannot be appended to the journal (its envelope
#: is not bytes, or over the journal's record limit), so it stays, out of every relay's way,
#: for an operator (docs/outbox.md, "Bad rows"). A value, not a column: tables made before
#: need no migration, and a relay needs no more than its UPDATE right.
SET_ASIDE = -1
#: What ``--dsn`` / ``--outbox`` accept (said in every refusal).
SUPPORTED_DSNS = "sqlite:///relative/path, sqlite:////absolute/path or postgresql://[user[:password]@][host][:port]/database"
#: What needs psycopg 3: without it, MissingExtra says so and names the postgres extra.
PG_FEATURE = "an outbox on PostgreSQL"

Dialect = Literal["sqlite", "postgresql"]

_TABLE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]{0,62}\Z")
_PREFIX = "sqlite:///"


def validate_table(table: str) -> str:
    """``table`` if it is a plain SQL identifier (it is spliced into statements), else ValueError."""
    if not isinstance(table, str) or not _TABLE.match(table):
        raise ValueError(
            f"outbox table name {table!r} is not a plain identifier ([A-Za-z_][A-Za-z0-9_]*, at most 63)"
        )
    return table


def ddl(table: str = DEFAULT_TABLE, *, dialect: Dialect = "sqlite") -> str:
    """The SQL that creates the outbox table (idempotent: ``IF NOT EXISTS``), for ``dialect``.

    ``id`` orders the rows (AUTOINCREMENT: never reused, so commit order on SQLite);
    ``relaying`` is set by the relay before it appends a row to the journal, so that after a
    crash only those rows need checking against the journal (``SET_ASIDE``: a bad row).
    """
    validate_table(table)
    if dialect == "postgresql":
        return _pg_ddl(table)
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n"
        "    id INTEGER PRIMARY KEY AUTOINCREMENT,\n"
        "    job_id TEXT NOT NULL,\n"
        "    idempotency_key TEXT NOT NULL,\n"
        "    queue TEXT NOT NULL,\n"
        "    envelope BLOB NOT NULL,\n"
        "    created_at REAL NOT NULL,\n"
        "    relaying INTEGER NOT NULL DEFAULT 0\n"
        ");\n"
    )


def _pg_name(table: str, suffix: str) -> str:
    """A derived identifier that fits PostgreSQL's 63 bytes (it would truncate it with a notice)."""
    return table[: 63 - len(suffix)] + suffix


def _pg_ddl(table: str) -> str:
    """PostgreSQL's table, the index of rows a relay holds, and the trigger that wakes relays.

    The primary key's index serves the relay's ``ORDER BY id ... FOR UPDATE SKIP LOCKED``.
    ``relaying`` holds the token of the relay that marked the row (0: none; ``SET_ASIDE``: a
    bad row); the partial index finds the few marked rows. The envelope is ``bytea``: its exact
    bytes (and so a signature over them) go to the journal unchanged. The statement-level
    trigger sends one ``NOTIFY`` per inserting transaction (PostgreSQL folds identical
    notifications), delivered at commit.
    """
    notify = _pg_name(table, "_notify")
    return (
        f"CREATE TABLE IF NOT EXISTS {table} (\n"
        "    id bigserial PRIMARY KEY,\n"
        "    job_id text NOT NULL,\n"
        "    idempotency_key text NOT NULL,\n"
        "    queue text NOT NULL,\n"
        "    envelope bytea NOT NULL,\n"
        "    created_at double precision NOT NULL,\n"
        "    relaying bigint NOT NULL DEFAULT 0\n"
        ");\n"
        f"CREATE INDEX IF NOT EXISTS {_pg_name(table, '_relaying')}\n"
        f"    ON {table} (relaying) WHERE relaying <> 0;\n"
        f"CREATE OR REPLACE FUNCTION {notify}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        f"BEGIN PERFORM pg_notify('{table}', ''); RETURN NULL; END\n"
        "$$;\n"
        f"DROP TRIGGER IF EXISTS {notify} ON {table};\n"
        f"CREATE TRIGGER {notify} AFTER INSERT ON {table}\n"
        f"    FOR EACH STATEMENT EXECUTE FUNCTION {notify}();\n"
    )


def dialect_of(dsn: str) -> Dialect:
    """``postgresql`` for a PostgreSQL DSN, ``sqlite`` for anything else (which it validates)."""
    if is_postgres(dsn):
        return "postgresql"
    sqlite_path(dsn)
    return "sqlite"


def is_postgres(dsn: str) -> bool:
    """Whether ``dsn`` is a ``postgresql://`` (or ``postgres://``) URI."""
    return isinstance(dsn, str) and dsn.lower().startswith(("postgresql://", "postgres://"))


def sqlite_path(dsn: str) -> str:
    """The database file a ``sqlite:///...`` DSN names; ValueError (one line) for anything else.

    As in SQLAlchemy, ``sqlite:///data/app.db`` is relative to the working directory and
    ``sqlite:////var/lib/app.db`` is absolute.
    """
    if not isinstance(dsn, str) or not dsn:
        raise ValueError(f"empty outbox DSN; use {SUPPORTED_DSNS}")
    if is_postgres(dsn):
        raise ValueError(f"outbox DSN {redact_url(dsn)!r} is not an SQLite one (sqlite:///PATH)")
    if not dsn.startswith(_PREFIX):
        raise ValueError(f"outbox DSN {redact_url(dsn)!r} is not supported; use {SUPPORTED_DSNS}")
    path = dsn[len(_PREFIX) :]
    if not path or path.endswith("/") or "?" in path or path == ":memory:":
        raise ValueError(f"outbox DSN {dsn!r} names no database file; use {SUPPORTED_DSNS}")
    return path


def connect(dsn: str, *, create: bool = False, timeout_s: float = 30.0) -> Any:
    """Open the database a DSN names, in autocommit mode (the caller says BEGIN and COMMIT).

    Returns a DB-API connection: ``sqlite3.Connection``, or a ``psycopg.Connection`` for a
    PostgreSQL DSN. SQLite: without ``create`` the file must exist (a typo must not make an
    empty database); with it, its directory must. Raises ValueError for a bad DSN (or psycopg
    missing), FileNotFoundError for a missing SQLite file, ConnectionError when PostgreSQL
    cannot be reached (one line, no password). ``timeout_s``: how long a statement waits for a
    lock on SQLite (the busy timeout), and for the connection and each statement on PostgreSQL
    when below the 10 s connect timeout (a monitoring read must not hang on a migration's lock).
    """
    if is_postgres(dsn):
        return _connect_pg(dsn, timeout_s)
    path = sqlite_path(dsn)
    if not create and not os.path.isfile(path):
        raise FileNotFoundError(f"outbox database {path!r} does not exist (hybridq outbox init creates it)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"directory {parent!r} of the outbox database does not exist")
    # check_same_thread off: a relay may be opened in one thread and run in another (one at a time).
    conn = sqlite3.connect(path, isolation_level=None, timeout=timeout_s, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
    return conn


def _connect_pg(dsn: str, timeout_s: float) -> Any:
    try:
        import psycopg  # noqa: PLC0415 - an optional dependency, loaded for PostgreSQL only
    except ImportError:
        raise missing("postgres", PG_FEATURE) from None
    try:
        if timeout_s >= 10:
            return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
        ms = max(1, int(timeout_s * 1000))
        return psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=max(2, math.ceil(timeout_s)),
            options=f"-c statement_timeout={ms}",
        )
    except psycopg.ProgrammingError as exc:  # a DSN psycopg cannot parse
        raise ValueError(f"outbox DSN {redact_url(dsn)!r}: {first_line(exc)}") from None
    except psycopg.OperationalError as exc:
        raise ConnectionError(
            f"cannot connect to PostgreSQL {redact_url(dsn)!r}: {first_line(exc)}"
        ) from None


def first_line(exc: BaseException) -> str:
    """A driver error's first line (PostgreSQL's messages add DETAIL and HINT lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def table_exists(conn: Any, table: str) -> bool:
    """Whether ``table`` exists in the database ``conn`` (sqlite3 or psycopg) is open on."""
    if not isinstance(conn, sqlite3.Connection):  # PostgreSQL: on the search path
        return conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is not None
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
    return row is not None


def create_table(conn: Any, table: str = DEFAULT_TABLE) -> bool:
    """Create the outbox table on a sqlite3 or psycopg connection if missing; whether it was created.

    On PostgreSQL it runs (and commits, unless a transaction of the caller's is open) in one
    transaction; an existing table is kept, its index and trigger made sure of.
    """
    validate_table(table)
    existed = table_exists(conn, table)
    if isinstance(conn, sqlite3.Connection):
        conn.executescript(ddl(table))
    else:
        with conn.transaction():
            conn.execute(ddl(table, dialect="postgresql"))
    return not existed
