"""The relay's database side: a claimed row, the store protocol, and the SQLite store.

:class:`hybridq.outbox.relay.Relay` drives a store: :class:`SqliteStore` here (one relay per
SQLite outbox: a lock file beside the database, ``<db>.relay.lock``, refuses a second one, and
an idle relay polls) or :class:`hybridq.outbox.pg.PgStore` (PostgreSQL). ``docs/outbox.md``
describes both.

This module must not import redis, rq or click.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from typing import Protocol

from hybridq.errors import JournalLocked
from hybridq.outbox.schema import connect, sqlite_path, table_exists

__all__ = ["DEFAULT_PG_POLL_S", "DEFAULT_POLL_S", "Row", "SqliteStore", "Store"]

#: Seconds an idle relay sleeps before looking at an SQLite outbox again.
DEFAULT_POLL_S = 0.05
#: Seconds between two looks at a PostgreSQL outbox when no NOTIFY came (the fallback poll).
DEFAULT_PG_POLL_S = 2.0
#: One claimed row: its id, its job id, its envelope, and whether it was marked already (by a
#: relay that stopped before deleting it: it may be in the journal).
Row = tuple[int, str, bytes, bool]


class Store(Protocol):
    """The relay's side of one outbox table (SQLite or PostgreSQL)."""

    #: Where the outbox is, for logs (no password).
    where: str
    #: Seconds :meth:`wait` waits when nothing wakes it (the poll, or PostgreSQL's fallback poll).
    poll_s: float

    def open(self, journal: str) -> None:
        """Connect; FileNotFoundError without the table, JournalLocked if refused a place."""

    def claim(self, limit: int) -> list[Row]:
        """Up to ``limit`` of the oldest rows this relay may take, the fresh ones marked (committed)."""

    def delete(self, ids: list[int]) -> None:
        """Delete relayed rows (committed)."""

    def unmark(self, ids: list[int]) -> None:
        """Mark claimed rows fresh again (committed): their journal append failed."""

    def backlog(self) -> int:
        """Rows in the outbox now."""

    def wait(self, timeout: float) -> None:
        """Return after ``timeout`` seconds, or sooner when rows may have come or :meth:`wake`."""

    def wake(self) -> None:
        """Make a :meth:`wait` in progress return (safe from a signal handler)."""

    def housekeeping(self) -> None:
        """Periodic upkeep while idle (PostgreSQL: take over rows of relays gone)."""

    def reconnect(self) -> None:
        """Connect again after a ConnectionError (raises ConnectionError while it cannot)."""

    def close(self) -> None:
        """Release everything; idempotent."""


class SqliteStore:
    """An SQLite outbox: one relay (a lock file beside the database), polled."""

    def __init__(self, dsn: str, table: str) -> None:
        self.path = sqlite_path(dsn)  # ValueError for a bad DSN
        self.dsn, self.table, self.where = dsn, table, self.path
        self.poll_s = DEFAULT_POLL_S
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._wake = threading.Event()
        self._select = f"SELECT id, job_id, envelope, relaying FROM {table} ORDER BY id LIMIT ?"  # noqa: S608
        self._mark = f"UPDATE {table} SET relaying = 1 WHERE id = ?"  # noqa: S608
        self._unmark = f"UPDATE {table} SET relaying = 0 WHERE id = ?"  # noqa: S608
        self._delete = f"DELETE FROM {table} WHERE id = ?"  # noqa: S608

    def open(self, journal: str) -> None:  # noqa: ARG002 - one relay per SQLite outbox, whatever the journal
        """Connect; check the table; take the lock beside the database (JournalLocked if held)."""
        conn = connect(self.dsn)
        if not table_exists(conn, self.table):
            conn.close()
            raise FileNotFoundError(
                f"no table {self.table!r} in {self.path!r} (hybridq outbox init creates it)"
            )
        try:
            self._lock_fd = _lock(self.path + ".relay.lock")
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def claim(self, limit: int) -> list[Row]:
        """The oldest rows (marked or not); the fresh ones marked in one committed transaction."""
        assert self._conn is not None, "open() first"
        rows: list[tuple[int, str, bytes, int]] = self._conn.execute(self._select, (limit,)).fetchall()
        fresh = [(row_id,) for row_id, _, _, relaying in rows if not relaying]
        if fresh:
            _in_transaction(self._conn, self._mark, fresh)
        return [(row_id, job, bytes(env), bool(relaying)) for row_id, job, env, relaying in rows]

    def delete(self, ids: list[int]) -> None:
        """Delete relayed rows in one committed transaction."""
        assert self._conn is not None, "open() first"
        _in_transaction(self._conn, self._delete, [(row_id,) for row_id in ids])

    def unmark(self, ids: list[int]) -> None:
        """Mark claimed rows fresh again, in one committed transaction."""
        assert self._conn is not None, "open() first"
        _in_transaction(self._conn, self._unmark, [(row_id,) for row_id in ids])

    def backlog(self) -> int:
        """Rows in the outbox now."""
        assert self._conn is not None, "open() first"
        return int(self._conn.execute(f"SELECT count(*) FROM {self.table}").fetchone()[0])  # noqa: S608

    def wait(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds, or until :meth:`wake`."""
        self._wake.wait(timeout)

    def wake(self) -> None:
        """Make a :meth:`wait` in progress return."""
        self._wake.set()

    def housekeeping(self) -> None:
        """Nothing: one relay per SQLite outbox."""

    def reconnect(self) -> None:
        """Never needed: SQLite does not go away."""

    def close(self) -> None:
        """Close the database, release the lock; idempotent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _in_transaction(conn: sqlite3.Connection, sql: str, params: list[tuple[int]]) -> None:
    """Run ``sql`` for every parameter tuple in one write transaction, committed."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(sql, params)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _lock(path: str) -> int:
    """Hold an exclusive lock on ``path`` (created if missing); JournalLocked if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JournalLocked(path, "another relay (one relay per outbox)") from None
    return fd
