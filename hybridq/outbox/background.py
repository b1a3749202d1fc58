"""The relay in a thread of another process: ``hybridq forward --outbox DSN`` (one daemon).

:class:`BackgroundRelay` runs a :class:`~hybridq.outbox.relay.Relay` (the same code as
``hybridq relay``: its batches, its crash check, its lock) in a daemon thread beside the
forwarder's loop, on the forwarder's journal. What it adds is supervision: a relay that fails
(a database locked past its timeout, a dropped table, an I/O error on the journal) is closed,
logged once, and opened again with backoff until it works, while the forwarder keeps
forwarding. A failed batch is no risk: its rows stay in the outbox, and those it had marked
are checked against the journal when they are relayed again (``docs/outbox.md``).

This module must not import redis, rq or click.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from hybridq.outbox.backlog import Backlog, read_backlog
from hybridq.outbox.relay import PROGRESS_EVERY_S, Relay
from hybridq.outbox.schema import DEFAULT_TABLE
from hybridq.transport.redisurl import redact_url

__all__ = ["RETRY_BACKOFF_S", "BackgroundRelay"]

log = logging.getLogger("hybridq.relay")

#: A failed relay is opened again after the first value (seconds), doubling up to the second.
RETRY_BACKOFF_S = (0.5, 30.0)


class BackgroundRelay:
    """A relay run by a supervising thread: failures are logged once and retried with backoff.

    Args:
        dsn: the outbox database (``sqlite:///path`` or ``postgresql://...``).
        journal: the journal directory the relay appends to (the forwarder's).
        table: the outbox table.
        poll_s: seconds between two looks at an empty outbox (default: the relay's, 0.05 on
            SQLite; on PostgreSQL a NOTIFY wakes it and this is a 2 s fallback).
        backoff_s: the first and the longest wait before a failed relay is opened again.
    """

    def __init__(
        self,
        dsn: str,
        journal: str,
        *,
        table: str = DEFAULT_TABLE,
        poll_s: float | None = None,
        backoff_s: tuple[float, float] = RETRY_BACKOFF_S,
    ) -> None:
        self.dsn = dsn
        self.journal = journal
        self.table = table
        self.poll_s = poll_s
        self.backoff_s = backoff_s
        self._relay: Relay | None = Relay(dsn, journal, table=table, poll_s=poll_s)  # ValueError: bad DSN
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._relayed_before = 0  # by relays closed after a failure
        self._count_lock = threading.Lock()  # `relayed` is read by the metrics thread
        #: When the relay started failing (monotonic seconds), or ``None`` while it works.
        self.failing_since: float | None = None
        #: Failures since the process started (each one retried).
        self.failures = 0

    @property
    def relayed(self) -> int:
        """Rows moved into the journal (and deleted from the outbox) by this process."""
        with self._count_lock:
            relay = self._relay
            return self._relayed_before + (relay.relayed if relay is not None else 0)

    def open(self) -> None:
        """Open the relay now, so that a bad outbox is an error at start, not a retry loop.

        Raises what :meth:`Relay.open` raises: FileNotFoundError (no database or table),
        JournalLocked (another relay has this outbox), OSError or HybridqError (the journal).
        """
        assert self._relay is not None
        self._relay.open()

    def start(self) -> None:
        """Start relaying in a daemon thread (after :meth:`open`)."""
        self._thread = threading.Thread(target=self._run, name="hybridq-relay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to finish its batch in flight and return (it sets flags only)."""
        self._stop.set()
        relay = self._relay
        if relay is not None:
            relay.stop()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to return (after :meth:`stop`); return whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        """Close the relay (after :meth:`join` returned True). Idempotent."""
        relay = self._detach()
        if relay is not None:
            _close(relay)

    def backlog(self) -> Backlog:
        """The outbox's backlog now, read on a connection of its own (the relay may be stuck)."""
        return read_backlog(self.dsn, self.table)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        log.info(
            "relaying %s table %s -> journal %s (inside the forwarder)",
            redact_url(self.dsn),
            self.table,
            self.journal,
        )
        delay = self.backoff_s[0]
        while not self._stop.is_set():
            try:
                self._relay_until_stopped()
            except Exception as exc:  # any failure of the relay: forwarding goes on
                self._failed(exc)
                self._stop.wait(delay)
                delay = min(self.backoff_s[1], delay * 2)
                continue
        log.info("stopped; relayed %d jobs", self.relayed)

    def _relay_until_stopped(self) -> None:
        """Relay until stopped (or an exception): the outbox is emptied, then looked at again."""
        relay = self._relay
        if relay is None:  # closed after a failure: a fresh relay, with a fresh connection
            relay = Relay(self.dsn, self.journal, table=self.table, poll_s=self.poll_s)
            relay.open()
            with self._count_lock:
                self._relay = relay
            if self._stop.is_set():  # stop() may have run before the new relay was published
                relay.stop()
        window_start, window_rows = time.monotonic(), 0
        while not self._stop.is_set():
            moved = relay.run_once()
            if self.failing_since is not None:
                log.warning("outbox relay working again after %.1f s", time.monotonic() - self.failing_since)
                self.failing_since = None
            window_rows += moved
            now = time.monotonic()
            if window_rows and now - window_start >= PROGRESS_EVERY_S:
                log.info("relayed %d jobs in the last %.1f s", window_rows, now - window_start)
                window_start, window_rows = now, 0
            elif not window_rows:
                window_start = now
            relay.wait()  # poll_s, or less: a NOTIFY (PostgreSQL) or stop() wakes it

    def _failed(self, exc: Exception) -> None:
        """Log the first failure of a run of them (the rest at DEBUG), close the relay."""
        self.failures += 1
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.error(
                "outbox relay failed (%s: %s); forwarding continues, the relay is retried with backoff",
                type(exc).__name__,
                exc,
            )
        else:
            log.debug("outbox relay failed again: %s", exc)
        relay = self._detach()
        if relay is not None:
            _close(relay)

    def _detach(self) -> Relay | None:
        """Take the relay out (its count kept in ``relayed``); the caller closes it."""
        with self._count_lock:
            relay, self._relay = self._relay, None
            if relay is not None:
                self._relayed_before += relay.relayed
        return relay


def _close(relay: Relay) -> None:
    """Close ``relay`` whatever fails: a second ``close`` finishes what a failed first one left."""
    try:
        relay.close()
    except Exception as exc:  # e.g. sealing its segment hit the same I/O error
        log.debug("closing the outbox relay: %s", exc)
        with contextlib.suppress(Exception):
            relay.close()  # the writer is marked closed now: this releases the database and lock
