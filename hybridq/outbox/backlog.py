"""The outbox backlog: how many committed rows wait for the relay, and since when.

``hybridq status --outbox DSN`` and the forwarder's metrics (``hybridq forward --outbox DSN``)
read it with one plain SQL statement (``count(*)`` and ``min(created_at)`` of the rows not set
aside, and the count of those set aside) on any DB-API connection
:func:`hybridq.outbox.schema.connect` returns. A row's ``created_at`` is the insert's time in
seconds since the epoch, so the oldest row's age is how long the relay has kept the
application's oldest committed job waiting (``docs/outbox.md``). ``hybridq doctor --outbox``
lists the rows set aside (:func:`read_set_aside`).

This module must not import redis, rq or click.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hybridq.outbox.schema import SET_ASIDE, connect, is_postgres, table_exists, validate_table
from hybridq.outbox.store import bad_envelope
from hybridq.transport.redisurl import redact_url

__all__ = ["Backlog", "SetAside", "check_outbox", "query_backlog", "read_backlog", "read_set_aside"]


@dataclass(frozen=True)
class Backlog:
    """The outbox's committed rows not yet relayed.

    Attributes:
        rows: how many there are (those set aside not counted).
        oldest_created_at: the oldest one's ``created_at`` (seconds since the epoch), or
            ``None`` when there are none.
        set_aside: bad rows the relay set aside (``docs/outbox.md``, "Bad rows").
    """

    rows: int
    oldest_created_at: float | None
    set_aside: int = 0

    def oldest_age_s(self, now: float | None = None) -> float:
        """Seconds since the oldest row was inserted (0 when there is none; never negative)."""
        if self.oldest_created_at is None:
            return 0.0
        now = time.time() if now is None else now
        return round(max(0.0, now - self.oldest_created_at), 3)


def query_backlog(conn: Any, table: str) -> Backlog:
    """The backlog of ``table``, read on ``conn`` (a DB-API 2.0 connection).

    A cursor, not ``conn.execute``: that is SQLite's shortcut, not DB-API. Raises the driver's
    own error when the table is missing or the database cannot be read.
    """
    sql = (
        "SELECT sum(CASE WHEN relaying >= 0 THEN 1 ELSE 0 END), "  # noqa: S608 - validated identifier
        "min(CASE WHEN relaying >= 0 THEN created_at END), "
        f"sum(CASE WHEN relaying = {SET_ASIDE} THEN 1 ELSE 0 END) FROM {validate_table(table)}"
    )
    cursor = conn.cursor()
    try:
        cursor.execute(sql)
        row = cursor.fetchone()
    finally:
        cursor.close()
    count, oldest, aside = (0, None, 0) if row is None else row
    # float(): a driver may hand back a Decimal for a NUMERIC column (and for a sum).
    return Backlog(int(count or 0), None if oldest is None else float(oldest), int(aside or 0))


#: Seconds a backlog read waits for a lock (a migration, a VACUUM) before it gives up: a metrics
#: scrape must answer within Prometheus's timeout (10 s by default), with the other metrics.
READ_TIMEOUT_S = 2.0


def read_backlog(dsn: str, table: str) -> Backlog:
    """Open the database ``dsn`` names, read the backlog of ``table``, close it.

    A connection of its own, closed at once: no transaction is left open on the database (the
    read is a single statement), and nothing is shared with a relay working on it meanwhile.
    Raises ValueError (bad DSN), FileNotFoundError (no database), or the driver's error.
    """
    conn = connect(dsn, timeout_s=READ_TIMEOUT_S)
    try:
        return query_backlog(conn, table)
    finally:
        conn.close()


@dataclass(frozen=True)
class SetAside:
    """The rows the relay set aside: how many, and the first few (id, job id, created_at, why)."""

    count: int
    rows: list[dict[str, object]]


def read_set_aside(dsn: str, table: str, *, limit: int = 10) -> SetAside:
    """The rows of ``table`` the relay set aside, oldest first (``hybridq doctor --outbox``).

    Says why each is bad from its envelope's SQL type and size, without reading the envelope.
    Raises as :func:`read_backlog`.
    """
    validate_table(table)
    kind = (
        "pg_typeof(envelope)::text, octet_length(envelope)"
        if is_postgres(dsn)
        else ("typeof(envelope), length(envelope)")
    )
    where = f"FROM {table} WHERE relaying = {SET_ASIDE}"
    conn = connect(dsn, timeout_s=READ_TIMEOUT_S)
    try:
        cursor = conn.cursor()
        try:
            cursor.execute(f"SELECT count(*) {where}")
            count = int(cursor.fetchone()[0])
            cursor.execute(f"SELECT id, job_id, created_at, {kind} {where} ORDER BY id LIMIT {int(limit)}")
            found = cursor.fetchall()
        finally:
            cursor.close()
    finally:
        conn.close()
    rows: list[dict[str, object]] = [
        {
            "id": int(row_id),
            "job_id": "".join(c if c.isprintable() else "?" for c in str(job)[:128]),  # shown on a terminal
            "created_at": float(created) if isinstance(created, int | float) else None,
            "why": bad_envelope(t, n),
        }
        for row_id, job, created, t, n in found
    ]
    return SetAside(count, rows)


def check_outbox(dsn: str, table: str, *, timeout_s: float = 30.0) -> None:
    """Check that the database ``dsn`` names exists and has ``table``; change nothing.

    Raises ValueError (a bad DSN or table name) or FileNotFoundError (no database, no table),
    each with a one-line message.
    """
    validate_table(table)
    conn = connect(dsn, timeout_s=timeout_s)
    try:
        if not table_exists(conn, table):
            raise FileNotFoundError(
                f"no outbox table {table!r} in {redact_url(dsn)!r} (hybridq outbox init creates it)"
            )
    finally:
        conn.close()
