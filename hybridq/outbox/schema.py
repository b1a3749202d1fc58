"""The outbox table on SQLite: its DSN, its DDL, and opening it (issue 16, SQLite slice).

The table holds one row per job an application enqueued inside its own transaction
(``docs/outbox.md``). Each row carries the job's envelope, already validated and serialized
(and signed, when a signing key is configured) at insert time, so the job id and idempotency key
are fixed before the relay ever sees the row.

This module must not import redis, rq or click.
"""

from __future__ import annotations

import os
import re
import sqlite3

__all__ = [
    "DEFAULT_TABLE",
    "SUPPORTED_DSNS",
    "connect",
    "create_table",
    "ddl",
    "sqlite_path",
    "table_exists",
    "validate_table",
]

DEFAULT_TABLE = "hybridq_outbox"
#: What ``--dsn`` / ``--outbox`` accept in this version (said in every refusal).
SUPPORTED_DSNS = "sqlite:///relative/path or sqlite:////absolute/path"

_TABLE = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]{0,62}\Z")
_PREFIX = "sqlite:///"


def validate_table(table: str) -> str:
    """``table`` if it is a plain SQL identifier (it is spliced into statements), else ValueError."""
    if not isinstance(table, str) or not _TABLE.match(table):
        raise ValueError(
            f"outbox table name {table!r} is not a plain identifier ([A-Za-z_][A-Za-z0-9_]*, at most 63)"
        )
    return table


def ddl(table: str = DEFAULT_TABLE) -> str:
    """The SQL that creates the outbox table (idempotent: ``IF NOT EXISTS``).

    ``id`` orders the rows (AUTOINCREMENT: never reused, so commit order on SQLite);
    ``relaying`` is set by the relay before it appends a row to the journal, so that after a
    crash only those rows need checking against the journal.
    """
    validate_table(table)
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


def sqlite_path(dsn: str) -> str:
    """The database file a ``sqlite:///...`` DSN names; ValueError (one line) for anything else.

    As in SQLAlchemy, ``sqlite:///data/app.db`` is relative to the working directory and
    ``sqlite:////var/lib/app.db`` is absolute.
    """
    if not isinstance(dsn, str) or not dsn:
        raise ValueError(f"empty outbox DSN; use {SUPPORTED_DSNS}")
    scheme = dsn.partition(":")[0].lower()
    if scheme.startswith("postgres"):
        raise ValueError(
            f"PostgreSQL outboxes are not supported yet (this version: SQLite only); use {SUPPORTED_DSNS}"
        )
    if not dsn.startswith(_PREFIX):
        raise ValueError(f"outbox DSN {dsn!r} is not supported; use {SUPPORTED_DSNS}")
    path = dsn[len(_PREFIX) :]
    if not path or path.endswith("/") or "?" in path or path == ":memory:":
        raise ValueError(f"outbox DSN {dsn!r} names no database file; use {SUPPORTED_DSNS}")
    return path


def connect(dsn: str, *, create: bool = False) -> sqlite3.Connection:
    """Open the database a DSN names (in autocommit mode: the caller says BEGIN and COMMIT).

    Without ``create`` the file must exist (a typo must not make an empty database); with it,
    its directory must. Raises ValueError for a bad DSN, FileNotFoundError otherwise.
    """
    path = sqlite_path(dsn)
    if not create and not os.path.isfile(path):
        raise FileNotFoundError(f"outbox database {path!r} does not exist (hybridq outbox init creates it)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"directory {parent!r} of the outbox database does not exist")
    # check_same_thread off: a relay may be opened in one thread and run in another (one at a time).
    conn = sqlite3.connect(path, isolation_level=None, timeout=30.0, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def table_exists(conn: sqlite3.Connection, table: str) -> bool:
    """Whether ``table`` exists in the database ``conn`` is open on."""
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone()
    return row is not None


def create_table(conn: sqlite3.Connection, table: str = DEFAULT_TABLE) -> bool:
    """Create the outbox table if it is missing; return whether it was created."""
    validate_table(table)
    existed = table_exists(conn, table)
    conn.executescript(ddl(table))
    return not existed
