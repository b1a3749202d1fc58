"""The relay: committed outbox rows → journal records, in batches; then the rows are deleted.

One batch: read the oldest rows; mark those not yet marked ``relaying`` (committed); append
their envelopes to the journal under one fsync; nudge the forwarder; delete the rows
(committed). The envelope, and so the job id and idempotency key, was fixed when the
application inserted the row, so a relay killed anywhere in between never makes another job:

* killed before the append: the rows are still there and are appended on restart;
* killed after the append, before the delete: the rows are still there, marked ``relaying``;
  a marked row is appended again only if the journal does not already hold a record with its
  job id (the journal is read once for the marked rows, which only a crash leaves behind), and
  a record found counts only once it is durable: its segment is fsync'd first, and a segment
  whose write or fsync failed in this process counts for nothing (docs/reliability.md rule 9);
* an append that failed (a write or fsync error): its rows are unmarked before the error is
  raised, so the next pass appends them afresh instead of finding their unsynced records.

The database side is a store: :class:`hybridq.outbox.store.SqliteStore` (one relay per SQLite outbox: a lock
file beside the database, ``<db>.relay.lock``, refuses a second one) or
:class:`hybridq.outbox.pg.PgStore` (several relays, ``FOR UPDATE SKIP LOCKED``, woken by
``LISTEN/NOTIFY``, reconnecting when PostgreSQL goes away). ``docs/outbox.md`` describes the whole.

This module must not import redis, rq or click.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from typing import cast

from hybridq import crashpoints
from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, JournalIOError
from hybridq.extras import missing
from hybridq.journal import Durability, JournalReader, JournalWriter, RecordType
from hybridq.journal.fileops import OS_FILEOPS, FileOps
from hybridq.journal.format import segment_name
from hybridq.journal.paths import ensure_journal_dir
from hybridq.ledger.compacted import consistent
from hybridq.outbox.schema import (
    DEFAULT_TABLE,
    PG_FEATURE,
    is_postgres,
    validate_table,
)
from hybridq.outbox.store import DEFAULT_PG_POLL_S, DEFAULT_POLL_S, Row, SqliteStore, Store
from hybridq.protocol.nudge import address, nudge

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_PG_POLL_S",
    "DEFAULT_POLL_S",
    "PROGRESS_EVERY_S",
    "Relay",
    "Row",
    "SqliteStore",
    "Store",
]

log = logging.getLogger("hybridq.relay")

DEFAULT_BATCH = 500
#: Seconds between two progress lines while rows are being relayed.
PROGRESS_EVERY_S = 5.0
#: Longest wait between two attempts at reconnecting to a database that went away.
MAX_BACKOFF_S = 5.0

#: The job id near the start of an envelope's bytes: ``Envelope.to_bytes`` writes it first, a
#: signed envelope after its ``not_after``. Anything else is decoded in full.
_ID_PREFIX = re.compile(rb'\A\{(?:"not_after":[0-9.eE+-]+,)?"v":\d+,"id":"([A-Za-z0-9_-]{1,128})"')

#: Journal segments whose write or fsync failed in this process: their records may never reach
#: the disk, whatever a later fsync says (docs/reliability.md rule 9), so they prove nothing.
_FAILED_SEGMENTS: set[str] = set()


class Relay:
    """Moves an outbox's committed rows (SQLite or PostgreSQL) into a journal.

    Args:
        dsn: ``sqlite:///path`` or ``postgresql://...`` of the application's database.
        journal: the journal directory (created if missing).
        table: the outbox table.
        batch_size: most rows per journal append (one fsync) and per delete.
        poll_s: seconds :meth:`run` waits when the outbox is empty before looking again
            (default: 0.05 on SQLite; on PostgreSQL a ``NOTIFY`` wakes it, this is the fallback,
            2 s by default).
        fileops: the journal's file-operations seam (tests inject I/O errors and power loss).
    """

    def __init__(
        self,
        dsn: str,
        journal: str,
        *,
        table: str = DEFAULT_TABLE,
        batch_size: int = DEFAULT_BATCH,
        poll_s: float | None = None,
        fileops: FileOps = OS_FILEOPS,
    ) -> None:
        self.table = validate_table(table)
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if is_postgres(dsn):
            try:
                from hybridq.outbox.pg import PgStore  # noqa: PLC0415 - psycopg only for PostgreSQL
            except ImportError:
                raise missing("postgres", PG_FEATURE) from None
            self.store: Store = PgStore(dsn, self.table)
        else:
            self.store = SqliteStore(dsn, self.table)  # ValueError for a bad DSN, before anything opens
        if poll_s is not None:
            self.store.poll_s = poll_s
        self.path = self.store.where
        self.dsn = dsn
        self.journal = journal
        self.batch_size = batch_size
        self._ops = fileops
        #: Rows moved into the journal (appended, or found there already) and deleted.
        self.relayed = 0
        #: Rows a crashed relay had appended already: deleted without a second record.
        self.skipped_present = 0
        #: Bad rows set aside (``SET_ASIDE``): they cannot be appended to the journal.
        self.set_aside = 0
        #: Times the database went away and the relay reconnected.
        self.reconnects = 0
        self._stop = threading.Event()
        self._writer: JournalWriter | None = None

    @property
    def poll_s(self) -> float:
        """Seconds an idle relay waits before looking again (unless woken)."""
        return self.store.poll_s

    @poll_s.setter
    def poll_s(self, value: float) -> None:
        self.store.poll_s = value

    def open(self) -> None:
        """Open the database (it and the table must exist), take the relay's place, open the journal."""
        try:
            self.store.open(os.path.abspath(self.journal))  # first: refused, no journal is made
            self.journal = ensure_journal_dir(self.journal)
            self._writer = JournalWriter(self.journal, durability=Durability.FSYNC, fileops=self._ops)
        except BaseException:
            self.store.close()
            raise
        self._nudge_name = address(self.journal)

    def close(self) -> None:
        """Seal the journal segment, close the database and release the relay's place. Idempotent."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.store.close()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the batch in flight (safe from a signal handler)."""
        self._stop.set()
        self.store.wake()

    def backlog(self) -> int:
        """Rows in the outbox now (committed, not yet relayed)."""
        return self.store.backlog()

    def run_once(self) -> int:
        """Relay until the outbox is empty (or :meth:`stop`); return the rows relayed."""
        before = self.relayed
        while not self._stop.is_set():
            if self.step() < self.batch_size:
                break
        return self.relayed - before

    def run(self) -> None:
        """Relay until :meth:`stop`; wait ``poll_s`` (or for a NOTIFY) when the outbox is empty.

        A database that goes away (``ConnectionError``: PostgreSQL restarted) is logged in one
        line and reconnected to with backoff; the batch in flight is finished by the next one.
        """
        log.info("relaying %s table %s -> journal %s", self.path, self.table, self.journal)
        window_start, window_rows = time.monotonic(), 0
        while not self._stop.is_set():
            try:
                before = self.relayed
                moved = self.step()
                window_rows += self.relayed - before
                now = time.monotonic()
                if window_rows and now - window_start >= PROGRESS_EVERY_S:
                    log.info(
                        "relayed %d jobs in the last %.1f s; backlog %d",
                        window_rows,
                        now - window_start,
                        self.backlog(),
                    )
                    window_start, window_rows = now, 0
                elif not window_rows:
                    window_start = now
                if moved < self.batch_size and not self._stop.is_set():
                    self.wait()
            except ConnectionError as exc:
                self._reconnect(exc)
        log.info("stopped; relayed %d jobs", self.relayed)

    def wait(self, timeout: float | None = None) -> None:
        """Wait ``timeout`` (default ``poll_s``) seconds, less if rows come (NOTIFY) or :meth:`stop`.

        Then the store's upkeep (PostgreSQL: take over the rows of relays that are gone).
        """
        self.store.wait(self.poll_s if timeout is None else timeout)
        self.store.housekeeping()

    def _reconnect(self, exc: ConnectionError) -> None:
        """Connect again, backing off up to MAX_BACKOFF_S, until connected or stopped."""
        log.warning("lost the outbox database (%s); reconnecting", exc)
        started, delay = time.monotonic(), 0.05
        while not self._stop.wait(delay):
            try:
                self.store.reconnect()
            except ConnectionError:
                delay = min(delay * 2, MAX_BACKOFF_S)
                continue
            self.reconnects += 1
            log.info("reconnected to the outbox after %.1f s", time.monotonic() - started)
            return

    def step(self) -> int:
        """Relay one batch of the oldest rows; return how many rows it took (0: empty).

        Bad rows (:func:`~hybridq.outbox.store.bad_envelope`) are set aside, not relayed: they
        count among the rows taken, not in :attr:`relayed`.
        """
        writer = self._writer
        assert writer is not None, "open() first"
        taken = self.store.claim(self.batch_size)
        if not taken:
            return 0
        bad = [row for row in taken if row[4] is not None]
        rows = [row for row in taken if row[4] is None] if bad else taken
        if bad:
            self._set_aside(bad)
        present = self._already_appended([job for _, job, _, marked, _ in rows if marked])
        todo = [row for row in rows if row[1] not in present] if present else rows
        if todo:
            # A good row carries its envelope (None only in a bad one, set aside above).
            payloads = cast("list[bytes]", [env for _, _, env, _, _ in todo])
            try:
                writer.append_many(payloads)
            except Exception as exc:
                self._append_failed(exc, [row_id for row_id, _, _, _, _ in todo])
                raise
            nudge(self.journal, name=self._nudge_name)
        # A relay killed here has appended the batch but not deleted it (the crash tests).
        crashpoints.reached("relay_after_append")
        if rows:
            self.store.delete([row_id for row_id, _, _, _, _ in rows])
        self.relayed += len(rows)
        self.skipped_present += len(rows) - len(todo)
        return len(taken)

    def _set_aside(self, bad: list[Row]) -> None:
        """Set bad rows aside (``relaying = SET_ASIDE``, committed), each logged: the rest flows.

        Appended, one would fail the whole batch at every pass, and stop the outbox for good
        (issue 27, finding 5). ``docs/outbox.md`` ("Bad rows") says how to look at them.
        """
        self.store.set_aside([row_id for row_id, _, _, _, _ in bad])
        self.set_aside += len(bad)
        for row_id, job_id, _, _, why in bad:
            log.error(
                "outbox row %d (job %s) set aside: %s; the other rows are relayed "
                "(hybridq doctor --outbox lists it; docs/outbox.md, 'Bad rows')",
                row_id,
                job_id[:128],
                why,
            )

    def _append_failed(self, exc: Exception, row_ids: list[int]) -> None:
        """Unmark the rows of a failed append: their records, if written, are not durable.

        Marked, the next pass would find those records in the page cache and delete the rows
        on the strength of them (issue 26, item 5). A segment that failed is also remembered
        for this process, in case the unmark fails too.
        """
        if isinstance(exc, JournalIOError):
            _FAILED_SEGMENTS.add(os.path.abspath(exc.path))
        try:
            self.store.unmark(row_ids)
        except Exception as unmark_error:
            log.exception("could not unmark %d rows after a failed journal append", len(row_ids))
            exc.add_note(f"the rows stay marked ({unmark_error}): they are appended again in this process")

    def _already_appended(self, job_ids: list[str]) -> set[str]:
        """Which of ``job_ids`` (rows marked ``relaying``) the journal holds a record of."""
        if not job_ids:
            return set()
        wanted = set(job_ids)
        # Read again if the forwarder's compaction deleted a segment under the reader meanwhile.
        found = consistent(self.journal, lambda _: self._durable(wanted))
        log.info(
            "%d rows were being relayed when a relay stopped; %d of them are in the journal "
            "already (deleted, not appended again)",
            len(wanted),
            len(found),
        )
        return found

    def _durable(self, wanted: set[str]) -> set[str]:
        """Which of ``wanted`` the journal holds durably: found, and their segment fsync'd now.

        A relay killed before its fsync ended leaves records only the page cache holds; one
        fsync per segment found makes them durable (or fails, and they count for nothing).
        """
        where: dict[str, set[str]] = {}
        for job_id, segment in _journal_job_ids(self.journal):
            if job_id in wanted:
                where.setdefault(os.path.join(self.journal, segment), set()).add(job_id)
        durable: set[str] = set()
        for path, ids in where.items():
            if self._sync(path):
                durable |= ids
        return durable

    def _sync(self, path: str) -> bool:
        """Fsync the segment ``path``; whether its records are durable now."""
        if os.path.abspath(path) in _FAILED_SEGMENTS:
            return False
        ops = self._ops
        fd = ops.open(path, os.O_RDONLY)  # FileNotFoundError: compacted, so consistent() reads again
        try:
            ops.fdatasync(fd)
        except OSError as exc:
            _FAILED_SEGMENTS.add(os.path.abspath(path))
            log.warning("journal segment %s: fsync failed (%s): its rows are appended again", path, exc)
            return False
        finally:
            ops.close(fd)
        return True


def _journal_job_ids(journal: str) -> Iterable[tuple[str, str]]:
    """Each job record's job id and segment file name (a full read: used only after a crash)."""
    for record in JournalReader(journal).records():
        if record.rtype != RecordType.DATA:
            continue
        segment = segment_name(record.writer_id, record.segment_index)
        match = _ID_PREFIX.match(record.payload)
        if match is not None:
            yield match.group(1).decode("ascii"), segment
            continue
        try:
            yield Envelope.from_bytes(record.payload).id, segment
        except EnvelopeError:
            continue  # not a job: the forwarder skips it loudly
