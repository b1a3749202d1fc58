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
from hybridq.journal import MAX_PAYLOAD_BYTES
from hybridq.outbox.schema import SET_ASIDE, connect, sqlite_path, table_exists

__all__ = ["DEFAULT_PG_POLL_S", "DEFAULT_POLL_S", "Row", "SqliteStore", "Store", "bad_envelope"]

#: Seconds an idle relay sleeps before looking at an SQLite outbox again.
DEFAULT_POLL_S = 0.05
#: Seconds between two looks at a PostgreSQL outbox when no NOTIFY came (the fallback poll).
DEFAULT_PG_POLL_S = 2.0


#: One claimed row: its id, its job id, its envelope (``None`` for a bad row: never read, it may
#: be huge), whether it was marked already (by a relay that stopped before deleting it: it may be
#: in the journal), and why the relay cannot append it (:func:`bad_envelope`; ``None``: it can).
#: A plain tuple: one is made per relayed row.
Row = tuple[int, str, bytes | None, bool, str | None]


def bad_envelope(kind: str, size: int | None) -> str | None:
    """Why an envelope of SQL type ``kind`` and ``size`` bytes cannot be relayed; ``None`` if it can.

    The database says both (SQLite's ``typeof``/``length``, PostgreSQL's ``pg_typeof``/
    ``octet_length``) before the envelope is fetched: a bad one is never read into memory, and
    an INTEGER one is never taken for a length (``bytes(2**31)`` allocates 2 GiB).
    """
    if size is None or kind == "null":
        return "envelope is NULL"
    if kind not in ("blob", "bytea"):
        return f"envelope is {kind}, not bytes (BLOB/bytea)"
    if size > MAX_PAYLOAD_BYTES:
        return f"envelope is {size} bytes, over the journal's record limit of {MAX_PAYLOAD_BYTES}"
    return None


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

    def set_aside(self, ids: list[int]) -> None:
        """Mark claimed bad rows ``SET_ASIDE`` (committed): no relay claims them again."""

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
        # The envelope only when it is a BLOB within the journal's limit; why not, for the few
        # rows it is not (bad_envelope), in a second query.
        self._select = (
            "SELECT id, job_id, CASE WHEN typeof(envelope) = 'blob' AND length(envelope) <= ? "  # noqa: S608
            f"THEN envelope END, relaying FROM {table} WHERE relaying >= 0 ORDER BY id LIMIT ?"
        )
        self._why = f"SELECT typeof(envelope), length(envelope) FROM {table} WHERE id = ?"  # noqa: S608
        self._mark = f"UPDATE {table} SET relaying = 1 WHERE id = ?"  # noqa: S608
        self._unmark = f"UPDATE {table} SET relaying = 0 WHERE id = ?"  # noqa: S608
        self._set_aside = f"UPDATE {table} SET relaying = {SET_ASIDE} WHERE id = ?"  # noqa: S608
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
        conn = self._conn
        rows = conn.execute(self._select, (MAX_PAYLOAD_BYTES, limit)).fetchall()
        fresh = [(row[0],) for row in rows if not row[3]]
        if fresh:
            _in_transaction(conn, self._mark, fresh)
        return [
            (row_id, str(job), env, relaying != 0, None if env is not None else self._bad(row_id))
            for row_id, job, env, relaying in rows
        ]

    def _bad(self, row_id: int) -> str | None:
        """Why the row ``row_id`` cannot be relayed (its envelope's type and size, not its bytes)."""
        assert self._conn is not None, "open() first"
        return bad_envelope(*self._conn.execute(self._why, (row_id,)).fetchone())

    def delete(self, ids: list[int]) -> None:
        """Delete relayed rows in one committed transaction."""
        assert self._conn is not None, "open() first"
        _in_transaction(self._conn, self._delete, [(row_id,) for row_id in ids])

    def unmark(self, ids: list[int]) -> None:
        """Mark claimed rows fresh again, in one committed transaction."""
        assert self._conn is not None, "open() first"
        _in_transaction(self._conn, self._unmark, [(row_id,) for row_id in ids])

    def set_aside(self, ids: list[int]) -> None:
        """Mark bad rows ``SET_ASIDE``, in one committed transaction."""
        assert self._conn is not None, "open() first"
        _in_transaction(self._conn, self._set_aside, [(row_id,) for row_id in ids])

    def backlog(self) -> int:
        """Rows in the outbox now (those set aside not counted)."""
        assert self._conn is not None, "open() first"
        sql = f"SELECT count(*) FROM {self.table} WHERE relaying >= 0"  # noqa: S608
        return int(self._conn.execute(sql).fetchone()[0])

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
