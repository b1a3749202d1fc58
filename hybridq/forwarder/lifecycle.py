"""The forwarder's life cycle: open (the lock, recovery, each part), close, and open again.

:class:`LifeCycle` is the base of :class:`hybridq.forwarder.loop.Forwarder`, which makes the
parts (``Forwarder._build``, in ``__init__``) and runs the loop. Here: :meth:`LifeCycle.open`
takes the journal's lock and opens each part (:meth:`LifeCycle.open_waiting_for_space`: paused
while the disk is full, ``hybridq forward``'s start), :meth:`LifeCycle.close` closes them all (each
even when one before it fails: a full disk) and releases the lock, and
:meth:`LifeCycle._reopen` does what a start does in the same process, the lock kept, after a
full disk poisoned the key table (docs/reliability.md, "The key table", rule 6; the loop's
pause: :mod:`hybridq.forwarder.disk_full`) or its check found it damaged (rule 4).

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Self

from hybridq.errors import HybridqError, JournalIOError, JournalPathError, RedisRefused, TransportError
from hybridq.forwarder.backlog import Backlog
from hybridq.forwarder.dirlock import DirLock
from hybridq.forwarder.disk_full import DISK_FULL, DiskFullPause
from hybridq.forwarder.flows import Flows
from hybridq.forwarder.maintain import Maintenance
from hybridq.forwarder.push import ForwarderStats
from hybridq.forwarder.state import ForwarderState
from hybridq.forwarder.upkeep import Upkeep
from hybridq.forwarder.wait import Ticks, Waits
from hybridq.journal import JournalReader
from hybridq.journal.background import BackgroundCheck, sealed_segments
from hybridq.journal.recovery import recover
from hybridq.ledger.sqlite_errors import remove_probes
from hybridq.lookup.index import LookupIndex

__all__ = ["LifeCycle"]

log = logging.getLogger("hybridq.forwarder")


class LifeCycle:
    """Open, close and open again the parts a :class:`~hybridq.forwarder.loop.Forwarder` holds."""

    journal: str
    schedules: Ticks | None
    stats: ForwarderStats
    state: ForwarderState
    #: The check of the sealed segments start-up skipped (it reads only the chains' tails).
    journal_check: BackgroundCheck | None
    backlog: Backlog
    completions: Upkeep
    flows: Flows
    maintenance: Maintenance
    lookup: LookupIndex
    waits: Waits
    _reader: JournalReader
    #: Set by ``Forwarder.stop()``.
    _stopping: bool
    #: The journal directory, held open and locked from open() to close().
    _dir_lock: DirLock
    #: Set when a full disk poisoned the key table: the next try opens again first (run()).
    _reopen_due: bool

    #: The attributes :meth:`_build` sets (noted by :meth:`_build_noted`).
    _part_names: tuple[str, ...] = ()

    def _build(self, carried: ForwarderState | None = None) -> None:
        """Make the parts (the forwarder's); ``carried``: the state whose figures a reopen keeps."""
        raise NotImplementedError

    def open(self) -> None:
        """Take the journal's forwarder lock, recover the journal, load the checkpoint.

        Raises :class:`JournalLocked` if another forwarder holds the journal, and the journal's
        own error (e.g. :class:`JournalCorruption`) if it cannot be opened safely.
        """
        # Held while it runs: the lock is taken in this very directory, and every step checks
        # that the path still leads here (a swapped-in journal is never forwarded from).
        self._dir_lock.open()
        try:
            self._dir_lock.lock()
        except BaseException:
            self.close()
            raise
        try:
            self._open_parts()
        except BaseException:
            self.close()
            raise
        log.info(
            "forwarding %s (%d delayed jobs held, %d forwarded so far)",
            self.journal,
            len(self.state.checkpoint.held),
            self.state.checkpoint.forwarded,
        )

    def open_waiting_for_space(self, sleep: Callable[[float], None] | None = None) -> None:
        """:meth:`open`, paused and tried again while the disk is full (``hybridq forward``'s start).

        A full disk at the start (ENOSPC, EDQUOT: e.g. the key table's replay) pauses as a run
        does (one log line, ``disk_full_retries``, the same backoff; docs/operations.md "Disk
        full") instead of exiting for a supervisor to start it again at once. A failed open
        closed its parts and released the lock (not held between tries: another forwarder may
        take the journal meanwhile, and this one then stops with ``JournalLocked``); each try makes
        them anew. Any other error raises, and so does the full disk's once :meth:`stop` was
        called (the wait between tries looks at it every 0.1 s; ``sleep``: a wait of one's own).
        """
        pause = DiskFullPause(sleep or self._nap)
        while True:
            try:
                self.open()
            except (JournalIOError, OSError) as exc:
                if exc.errno not in DISK_FULL or self._stopping:
                    raise
                self.stats.disk_full_retries += 1
                pause.wait(exc)
                if self._stopping:
                    raise
                self._build(carried=self.state)  # its on_durable_write too
                continue
            pause.over()
            return

    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds``, or less once :meth:`stop` was called (looked at every 0.1 s)."""
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))

    def _open_parts(self) -> None:
        """What :meth:`open` does under the lock: recover, load, open each part (see there)."""
        # Only the tails before the first job (O(tail), not O(journal)); the sealed segments
        # are checked in the background, and corruption there stops the loop (step()).
        report = recover(self.journal, tails_only=True)
        for torn in report.repaired:
            log.warning("repaired torn tail in %s at offset %d", torn.path, torn.offset)
        remove_probes(self.journal)  # a full disk's probes a kill left (hybridq.ledger.sqlite_errors)
        self.journal_check = BackgroundCheck(self.journal, sealed_segments(self.journal))
        self.state.load()
        self.state.index.keys.on_checked = self.waits.wake  # a damaged verdict reopens at once
        self.backlog.selector.open()  # the rows' lanes follow this start's fair keys
        self.completions.open()
        self.flows.open()
        try:  # before the first push, so the checkpoint it saves has the epoch
            self.maintenance.check_epoch()
        except RedisRefused:
            raise  # a refusal (e.g. an evicting maxmemory-policy) is not an outage
        except TransportError:
            pass  # Redis down: the loop checks it later
        self._reader.seek(self.state.checkpoint.positions)
        self.lookup.open(self._reader.position)  # past it, the delivery notes each record
        self.waits.listen()
        if self.waits.listener is not None:
            self.maintenance.watch(self.waits.wake)

    def close(self) -> None:
        """Publish the terminal count; release the socket, ledger, schedules and lock. Idempotent."""
        try:
            self._close_parts()
        finally:
            self._dir_lock.release()

    def _close_parts(self) -> None:
        """Everything :meth:`close` releases but the lock; each part even when one before fails.

        The caches a close writes by path (the terminal count's checkpoint, the saved index, the
        pending count, the stats snapshot) and the pushed list's flush are skipped unless the
        lock is still held and the path still leads to its directory (the step that saw a swap
        stopped the run with JournalPathError; a second close comes after the lock's release):
        the next start redoes them.
        """
        try:
            self._dir_lock.check()
        except JournalPathError:
            by_path = False
        else:
            by_path = self._dir_lock.locked
        if self.maintenance.publish_due and by_path:
            with contextlib.suppress(OSError, HybridqError):  # a full disk: the older count stays
                self.maintenance.publish_terminal(now=True)
        with contextlib.ExitStack() as closing:  # the callbacks run last registered first
            closing.callback(self.waits.close)
            closing.callback(self.flows.close)
            closing.callback(self.lookup.close)
            closing.callback(self.state.close, by_path=by_path)
            if self.journal_check is not None:
                closing.callback(self.journal_check.stop)
            closing.callback(self.maintenance.unwatch)
            if self.schedules is not None:
                closing.callback(self.schedules.close)

    def _build_noted(self) -> None:
        """:meth:`_build`, noting which attributes it sets: the parts a failed reopen puts back."""
        before = set(vars(self))
        self._build()
        self._part_names = tuple(sorted(set(vars(self)) - before))

    def _reopen(self) -> None:
        """Close the parts and make and open them anew, as a start does, the lock kept.

        After a full disk poisoned the key table (docs/reliability.md, the key table): its rows
        of this run cannot be trusted, a start replays the ledger after the saved index into it.
        Nothing is lost closing on a full disk: what a close could not write, a start redoes.
        The journal's path is checked first and again before the parts open (a directory
        swapped in there is never written to: JournalPathError stops the run, as a step's check).
        While the reopen fails (the disk still full) the old parts stay: /metrics reads their
        figures, and the new state carries them until it is loaded (never zeros: a counter that
        drops and comes back is a spike; docs/operations.md "Disk full").
        """
        self._dir_lock.check()
        old_parts = {name: getattr(self, name) for name in self._part_names}
        try:
            self._close_parts()
        except (HybridqError, OSError, sqlite3.Error) as exc:  # each part was closed all the same
            log.warning("closing for the reopen after a full disk: %s", exc)
        self._build(carried=old_parts["state"])
        try:
            self._dir_lock.check()
            self._open_parts()
        except BaseException:
            with contextlib.suppress(HybridqError, OSError, sqlite3.Error):
                self._close_parts()
            for name, part in old_parts.items():  # closed: their figures only (each close is idempotent)
                setattr(self, name, part)
            raise
        self._reopen_due = False
        why = "its key table was damaged" if old_parts["state"].index.keys.damaged else "a full disk"
        log.warning("opened %s again after %s: the key table replayed from the ledger", self.journal, why)

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
