"""The relay's PostgreSQL side: several relays, ``FOR UPDATE SKIP LOCKED``, ``LISTEN/NOTIFY``.

A relay claims a batch in one transaction: it locks the oldest rows no relay holds
(``FOR UPDATE SKIP LOCKED``: relays running at once never wait for, nor take, each other's
rows), marks them with its **token** and commits. It then appends them to its journal and
deletes them (:class:`hybridq.outbox.relay.Relay`). A row carrying a relay's token is that
relay's alone, until the relay is gone: the crash rule of the SQLite relay holds per token (a
marked row is appended again only if the journal lacks its job id).

The token names a place: ``(host, journal directory, table, slot)``, hashed. A relay holds a
session-level advisory lock on its token for as long as its connection lives, taking the first
free slot: a relay restarted on the same journal finds its own marked rows (or a sibling's:
same journal, so the journal check holds for them too) and takes them over at once. Rows
marked by a relay on **another** journal whose lock has been free for ``ADOPT_AFTER_S``
(its host gone for good) are taken over too, logged: if that relay had appended them, the job
is then in two journals, with one job id and one idempotency key (docs/outbox.md). "Free for
60 s" is what this relay watched: free at every look, the looks at most ``WATCH_GAP_S`` apart;
a look that finds the lock held, or no rows of that relay, or a gap, starts the clock again.

Each inserting transaction's commit sends a ``NOTIFY`` (the table's trigger); the relay
``LISTEN``s on a second connection and waits for it, or for ``poll_s`` (the fallback poll).
A lost connection (PostgreSQL restarted) raises ConnectionError; the relay reconnects.

This module must not import redis, rq or click.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import select
import socket
import time
from collections.abc import Iterator

import psycopg
from psycopg.rows import TupleRow

from hybridq.errors import JournalLocked
from hybridq.journal import MAX_PAYLOAD_BYTES
from hybridq.outbox.schema import SET_ASIDE, table_exists
from hybridq.outbox.store import DEFAULT_PG_POLL_S, Row, bad_envelope
from hybridq.transport.redisurl import redact_url

__all__ = ["ADOPT_AFTER_S", "SLOTS", "WATCH_GAP_S", "PgStore", "token"]

log = logging.getLogger("hybridq.relay")

#: Relays that may run on one journal for one table (each takes a slot).
SLOTS = 16
#: Seconds the lock of another journal's relay must stay free before its rows are taken over.
ADOPT_AFTER_S = 60.0
#: Most seconds between two looks that both found such a lock free for the time between them to
#: count as free: a relay can come back and die again between looks further apart.
WATCH_GAP_S = ADOPT_AFTER_S / 4


def token(journal: str, table: str, slot: int) -> int:
    """The advisory-lock key (and ``relaying`` mark) of a relay's place; never 0 (unmarked)."""
    place = f"hybridq-relay\0{socket.gethostname()}\0{os.path.realpath(journal)}\0{table}\0{slot}"
    value = int.from_bytes(hashlib.sha256(place.encode()).digest()[:8], "big") & (2**63 - 1)
    return value or 1


@contextlib.contextmanager
def _connection_errors() -> Iterator[None]:
    """Psycopg's connection failures as one-line ConnectionErrors (the relay reconnects)."""
    try:
        yield
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        lines = str(exc).strip().splitlines()
        raise ConnectionError(lines[0] if lines else type(exc).__name__) from exc


class PgStore:
    """A PostgreSQL outbox table, as one of possibly several relays sees it."""

    def __init__(self, dsn: str, table: str) -> None:
        self.dsn, self.table, self.where = dsn, table, redact_url(dsn)
        self.poll_s = DEFAULT_PG_POLL_S
        self.token = 0
        self._slots: list[int] = []
        self._siblings: set[int] = set()
        self._conn: psycopg.Connection[TupleRow] | None = None
        self._listen: psycopg.Connection[TupleRow] | None = None
        #: Per token of another relay seen free: when first seen free, and when last seen free.
        self._free_since: dict[int, tuple[float, float]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        t = table
        # The envelope only when it is bytes within the journal's limit; why not, for the few
        # rows it is not (bad_envelope), in a second query.
        self._claim = (
            "SELECT id, job_id, CASE WHEN pg_typeof(envelope) = 'bytea'::regtype "  # noqa: S608
            f"AND octet_length(envelope) <= %s THEN envelope END, relaying FROM {t} "
            "WHERE relaying = 0 OR relaying = %s ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
        )
        self._why = f"SELECT pg_typeof(envelope)::text, octet_length(envelope) FROM {t} WHERE id = %s"  # noqa: S608
        self._mark = f"UPDATE {t} SET relaying = %s WHERE id = ANY(%s)"  # noqa: S608
        self._delete = f"DELETE FROM {t} WHERE id = ANY(%s)"  # noqa: S608
        self._unmark = f"UPDATE {t} SET relaying = 0 WHERE id = ANY(%s) AND relaying = %s"  # noqa: S608
        self._set_aside = f"UPDATE {t} SET relaying = {SET_ASIDE} WHERE id = ANY(%s) AND relaying = %s"  # noqa: S608
        # Other relays' tokens (SET_ASIDE is none: tokens are positive).
        self._others = f"SELECT DISTINCT relaying FROM {t} WHERE relaying > 0 AND relaying <> %s"  # noqa: S608
        self._adopt = f"UPDATE {t} SET relaying = %s WHERE relaying = %s"  # noqa: S608

    def open(self, journal: str) -> None:
        """Connect, check the table, take the first free slot of this journal, LISTEN."""
        self._slots = [token(journal, self.table, slot) for slot in range(SLOTS)]
        self._siblings = set(self._slots)
        self._journal = journal
        self._connect()
        assert self._conn is not None
        with _connection_errors():
            if not table_exists(self._conn, self.table):
                raise FileNotFoundError(
                    f"no table {self.table!r} in {self.where} (hybridq outbox init creates it)"
                )
        self._take_slot(prefer=0)
        self.housekeeping()

    def _connect(self) -> None:
        self._disconnect()
        with _connection_errors():
            self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
            self._listen = psycopg.connect(self.dsn, autocommit=True, connect_timeout=10)
            self._listen.execute(f'LISTEN "{self.table}"')

    def _take_slot(self, prefer: int) -> None:
        """Hold the advisory lock of this journal's first free slot (``prefer`` first)."""
        assert self._conn is not None
        ordered = [prefer, *(slot for slot in self._slots if slot != prefer)] if prefer else self._slots
        with _connection_errors():
            for candidate in ordered:
                row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (candidate,)).fetchone()
                if row is not None and row[0]:
                    self.token = candidate
                    return
        raise JournalLocked(self._journal, f"{SLOTS} relays of table {self.table} on this journal already")

    def claim(self, limit: int) -> list[Row]:
        """Lock the oldest free rows (and this relay's own marked ones), mark the fresh ones, commit."""
        assert self._conn is not None, "open() first"
        with _connection_errors(), self._conn.transaction():
            rows = self._conn.execute(self._claim, (MAX_PAYLOAD_BYTES, self.token, limit)).fetchall()
            fresh = [row[0] for row in rows if row[3] == 0]
            if fresh:
                self._conn.execute(self._mark, (self.token, fresh))
            return [
                (int(r[0]), str(r[1]), r[2], r[3] != 0, None if r[2] is not None else self._bad(r[0]))
                for r in rows
            ]

    def _bad(self, row_id: int) -> str | None:
        """Why the row ``row_id`` cannot be relayed (its envelope's type and size, not its bytes)."""
        assert self._conn is not None
        row = self._conn.execute(self._why, (row_id,)).fetchone()
        return bad_envelope(*row) if row is not None else "gone"

    def delete(self, ids: list[int]) -> None:
        """Delete relayed rows in one committed transaction."""
        assert self._conn is not None, "open() first"
        with _connection_errors(), self._conn.transaction():
            self._conn.execute(self._delete, (ids,))

    def unmark(self, ids: list[int]) -> None:
        """Mark this relay's claimed rows fresh again, in one committed transaction."""
        assert self._conn is not None, "open() first"
        with _connection_errors(), self._conn.transaction():
            self._conn.execute(self._unmark, (ids, self.token))

    def set_aside(self, ids: list[int]) -> None:
        """Mark this relay's claimed bad rows ``SET_ASIDE``, in one committed transaction."""
        assert self._conn is not None, "open() first"
        with _connection_errors(), self._conn.transaction():
            self._conn.execute(self._set_aside, (ids, self.token))

    def backlog(self) -> int:
        """Rows in the outbox now (those set aside not counted)."""
        assert self._conn is not None, "open() first"
        sql = f"SELECT count(*) FROM {self.table} WHERE relaying >= 0"  # noqa: S608
        with _connection_errors():
            row = self._conn.execute(sql).fetchone()
        return int(row[0]) if row is not None else 0

    def wait(self, timeout: float) -> None:
        """Until a NOTIFY on the table's channel (a commit with new rows), ``timeout``, or a wake."""
        listen = self._listen
        assert listen is not None, "open() first"
        with _connection_errors():
            if any(True for _ in listen.notifies(timeout=0)):  # came during the last batch
                return
            ready, _, _ = select.select([listen.fileno(), self._wake_r], [], [], timeout)
            if listen.fileno() in ready:
                for _ in listen.notifies(timeout=0):  # drain; raises if the server went away
                    pass
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)

    def wake(self) -> None:
        """Make a :meth:`wait` in progress return (writes to a pipe: safe in a signal handler)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError as exc:  # full (a wake is pending anyway) or closed
            if exc.errno not in (errno.EAGAIN, errno.EBADF):
                raise

    def housekeeping(self) -> None:
        """Take over rows marked by relays that are gone: this journal's at once, others' later."""
        assert self._conn is not None, "open() first"
        now = time.monotonic()
        # Only what is seen free in this pass carries over: a lock found held, or a relay with no
        # marked rows left (it came back and relayed them), may die again later, and must then
        # get the whole grace again, not the time since its earlier death (issue 26, item 6).
        watched, self._free_since = self._free_since, {}
        with _connection_errors():
            others = [int(row[0]) for row in self._conn.execute(self._others, (self.token,))]
            for other in others:
                sibling = other in self._siblings
                with self._conn.transaction():
                    free = self._conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (other,)).fetchone()
                    if not (free and free[0]):
                        continue  # its relay lives
                    first, last = watched.get(other, (now, now))
                    if now - last > WATCH_GAP_S:
                        first = now  # not watched in between: it may have lived meanwhile
                    if not sibling and now - first < ADOPT_AFTER_S:
                        self._free_since[other] = (first, now)
                        continue
                    taken = self._conn.execute(self._adopt, (self.token, other)).rowcount
                if taken:
                    log.warning(
                        "took over %d rows marked by a relay that is gone (%s); they are checked "
                        "against this journal%s",
                        taken,
                        "this journal's" if sibling else "another journal's",
                        "" if sibling else ": the job is in both journals if that relay had appended it",
                    )

    def reconnect(self) -> None:
        """Connect again (LISTEN again) and take back this relay's slot, or another free one."""
        self._connect()
        self._take_slot(prefer=self.token)

    def _disconnect(self) -> None:
        for conn in (self._conn, self._listen):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self._conn = self._listen = None

    def close(self) -> None:
        """Close both connections (the advisory lock goes with the session) and the wake pipe."""
        self._disconnect()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
