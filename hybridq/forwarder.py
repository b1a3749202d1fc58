"""The forwarder: tails the journal and pushes jobs into the transport, one per journal directory.

Loop: read new records (streaming, bounded memory) -> hold delayed jobs -> push a batch -> save
the checkpoint -> then the completions side (:mod:`hybridq.completions`): harvest outcomes into
the ledger, deliver due retries, check the epoch, reconcile, compact.
The checkpoint is saved only after the transport accepted the batch
(invariant 5), so a crash in between re-pushes at most that batch, and the deterministic job id
absorbs it. While the transport is down, the forwarder backs off (exponential, with jitter),
logs once when it goes down and once when it comes back, and keeps nothing in memory beyond the
current batch: the backlog stays on disk.

This module must not import redis or rq (only :mod:`hybridq.transport.rq` does).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from hybridq.completions import Completions, check_key_ttl
from hybridq.envelope import Envelope
from hybridq.errors import (
    EnvelopeError,
    JournalIOError,
    RedisRefused,
    TransportError,
    UnencodableJobs,
)
from hybridq.journal import JournalReader, Record, RecordType
from hybridq.journal.ownerlock import take_owner_lock
from hybridq.journal.paths import check_journal_dir, ensure_journal_dir, open_journal_dir
from hybridq.journal.reader import clamp_to_seals, read_record_at, seal_offset
from hybridq.journal.recovery import recover
from hybridq.nudge import NudgeListener, nudge
from hybridq.state import Checkpoint, Held, load_checkpoint, save_checkpoint
from hybridq.transport import Transport
from hybridq.transport.base import Delivery

__all__ = ["LOCK_NAME", "Forwarder", "ForwarderStats"]

log = logging.getLogger("hybridq.forwarder")

#: The lock file that makes the forwarder the only one for its journal.
LOCK_NAME = "forwarder.lock"
#: How often the forwarder checks that Redis still has its epoch (seconds).
EPOCH_CHECK_S = 1.0
#: A full disk (or quota) pauses the forwarder instead of stopping it: it retries, backing off
#: from the first to the second value (seconds), until its writes succeed again.
DISK_FULL_BACKOFF_S = (0.5, 10.0)
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
#: How long the event watcher blocks on the completion stream per call (seconds).
WATCH_BLOCK_S = 0.5


@dataclass
class ForwarderStats:
    """Counters since this forwarder started (the durable totals are in the checkpoint)."""

    batches: int = 0
    pushed: int = 0
    duplicate_pushes: int = 0
    transport_failures: int = 0
    #: Steps retried because the disk was full.
    disk_full_retries: int = 0
    #: ``time.monotonic()`` when the transport went down, while it is down; else ``None``.
    down_since: float | None = None
    #: While a batch is being pushed: its oldest job's ``created_at`` (the forwarding lag).
    oldest_unpushed: float | None = None


class _Stopped(Exception):
    """Stop was requested while a batch could not be delivered; its checkpoint is not moved."""


class Forwarder:
    """Forwards one journal directory into a transport.

    Args:
        journal: the journal directory (created 0700 when missing).
        transport: where jobs go.
        batch_size: the most jobs per push (one pipeline, one checkpoint write).
        idle_timeout_s: the longest sleep without a nudge (a missed nudge costs at most this).
        backoff_initial_s: first wait after a transport failure; doubles up to ``backoff_max_s``.
        lease_s: how long a worker's claim on a job lasts without renewal; a job whose worker
            stopped renewing it is delivered again about this long after the worker died.
        key_ttl_s: how long a job's outcome stays stored under its idempotency key in Redis
            (duplicates within this window return the stored result; the ledger covers the
            forwarder's own jobs forever).
        max_lost: a job whose worker vanished this many times fails for good.
        reconcile_interval_s: the least time between two reconcile passes (default: a fifth of
            ``lease_s``, at least 1 s).
        clock: wall-clock time (for delays); replaced in tests.
        on_durable_write: called with the seconds each durable write took (checkpoint saves,
            ledger appends: each ends in an fsync), e.g. a metrics histogram's ``observe``.
    """

    def __init__(
        self,
        journal: str | os.PathLike[str],
        transport: Transport,
        *,
        batch_size: int = 500,
        idle_timeout_s: float = 1.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        lease_s: float = 10.0,
        key_ttl_s: float = 86400.0,
        max_lost: int = 5,
        reconcile_interval_s: float | None = None,
        clock: Callable[[], float] = time.time,
        on_durable_write: Callable[[float], None] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        check_key_ttl(lease_s, key_ttl_s)  # ConfigError before anything is created
        # The forwarder may start before any producer has: it creates the directory (0700).
        self.journal = ensure_journal_dir(journal)
        self.transport = transport
        self.batch_size = batch_size
        self.idle_timeout_s = idle_timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.lease_s = lease_s
        self.key_ttl_s = key_ttl_s
        self.max_lost = max_lost
        self.reconcile_interval_s = (
            reconcile_interval_s if reconcile_interval_s is not None else max(1.0, lease_s / 5)
        )
        self.on_durable_write = on_durable_write
        self.stats = ForwarderStats()
        self.checkpoint = Checkpoint()
        self.completions: Completions | None = None
        self._next_epoch_check = 0.0
        # A plain flag, not an Event: stop() runs in a signal handler, and Event.set() takes a
        # lock the interrupted main thread may be holding inside Event.wait() (a deadlock).
        self._stopping = False
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None
        self._listener: NudgeListener | None = None
        self._reader: JournalReader | None = None
        self._rng = random.Random()  # noqa: S311 - backoff jitter, not security
        self._watcher: threading.Thread | None = None
        #: Set by the loop after each harvest: the watcher waits for it before it looks again.
        self._harvested = threading.Event()
        self._watch_stop = threading.Event()

    # -- life cycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Take the journal's forwarder lock, recover the journal, load the checkpoint.

        Raises :class:`JournalLocked` if another forwarder holds the journal, and the journal's
        own error (e.g. :class:`JournalCorruption`) if it cannot be opened safely.
        """
        # Held while it runs: the lock is taken in this very directory, and every step checks
        # that the path still leads here (a swapped-in journal is never forwarded from).
        self._dir_fd = open_journal_dir(self.journal)
        try:
            self._lock_fd = take_owner_lock(
                os.path.join(self.journal, LOCK_NAME),
                owner="forwarder",
                busy="one forwarder per journal directory",
                patience_s=1.0,  # `hybridq status` probes it for an instant: not a reason to give up
                dir_fd=self._dir_fd,
            )
        except BaseException:
            self.close()
            raise
        try:
            report = recover(self.journal)
            for torn in report.repaired:
                log.warning("repaired torn tail in %s at offset %d", torn.path, torn.offset)
            saved = load_checkpoint(self.journal)
            if saved is None:
                log.info("no checkpoint in %s: forwarding the journal from its start", self.journal)
            self.checkpoint = saved or Checkpoint()
            if saved is None:
                save_checkpoint(self.journal, self.checkpoint)  # its owner id must not change
            self._clamp_checkpoint()
            self.completions = Completions(
                self.journal,
                self.transport,
                self.checkpoint,
                lease_s=self.lease_s,
                key_ttl_s=self.key_ttl_s,
                max_lost=self.max_lost,
                reconcile_interval_s=self.reconcile_interval_s,
                clock=self.clock,
                on_durable_write=self.on_durable_write,
            )
            self.completions.open()
            with contextlib.suppress(TransportError):  # Redis down: the loop checks it later
                self._check_epoch()  # before the first push, so the checkpoint it saves has the epoch
            self._reader = JournalReader(self.journal)
            self._reader.seek(self.checkpoint.positions)
            try:
                self._listener = NudgeListener(self.journal)
            except OSError as exc:
                # Someone else holds the name (abstract sockets have no permissions): run
                # without nudges; new records are still picked up within the idle timeout.
                log.warning(
                    "cannot listen for producers' nudges (%s): polling every %.1f s", exc, self.idle_timeout_s
                )
            if self._listener is not None and self.transport.blocking_events:
                self._watcher = threading.Thread(
                    target=self._watch, name="hybridq-event-watcher", daemon=True
                )
                self._watcher.start()
        except BaseException:
            self.close()
            raise
        log.info(
            "forwarding %s (%d delayed jobs held, %d forwarded so far)",
            self.journal,
            len(self.checkpoint.held),
            self.checkpoint.forwarded,
        )

    def close(self) -> None:
        """Release the socket, the ledger and the lock. Idempotent."""
        if self._watcher is not None:
            self._watch_stop.set()
            self._harvested.set()
            self._watcher.join(WATCH_BLOCK_S * 2)  # it blocks in Redis for at most that long
            self._watcher = None
        if self.completions is not None:
            self.completions.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stop(self) -> None:
        """Ask :meth:`run` to finish the batch in flight, save the checkpoint and return.

        Safe in a signal handler: it sets a flag and sends one datagram, taking no lock.
        """
        self._stopping = True
        if self._listener is not None:
            # Wake the loop if it is waiting for a nudge (or backing off).
            nudge(self.journal, name=self._listener.name)

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopping

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        """Forward until :meth:`stop` is called.

        A full disk pauses it: a checkpoint or ledger write that fails with ENOSPC (or EDQUOT)
        changed nothing durable (the ledger continues in a new segment, completion events stay
        in Redis until the ledger has them, a checkpoint is replaced atomically or not at all),
        so the step is simply tried again, with backoff, until space returns.
        """
        full_since: float | None = None
        delay = DISK_FULL_BACKOFF_S[0]
        while not self._stopping:
            try:
                self.step()
            except _Stopped:
                break
            except (JournalIOError, OSError) as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                if full_since is None:
                    full_since = time.monotonic()
                    log.error("disk full (%s): forwarding paused, retrying until writes succeed", exc)
                self.stats.disk_full_retries += 1
                self._sleep(delay)
                delay = min(DISK_FULL_BACKOFF_S[1], delay * 2)
                continue
            if full_since is not None:
                log.warning("writing again after %.1f s of a full disk", time.monotonic() - full_since)
                full_since, delay = None, DISK_FULL_BACKOFF_S[0]
            self._wait()

    def step(self) -> int:
        """Forward everything available now (due delayed jobs, then new records); return the count.

        Then the completions side: harvest outcomes, deliver due retries, reconcile, compact
        (after the new records, so that it never delays a new job's push).
        """
        if self._dir_fd is not None:
            check_journal_dir(self._dir_fd, self.journal)  # JournalPathError: stop, never forward
        done = self._forward_due() + self._forward_new()
        if not self._stopping:
            self._maintain()
        return done

    def _forward_new(self) -> int:
        reader = self._require_reader()
        try:
            return self._read_and_deliver(reader)
        except BaseException:
            # The reader has moved past records whose batch was not delivered (a full disk while
            # recording an invalid record, a failed save, a stop): read them again next time.
            # Everything before the checkpoint's positions is pushed already.
            reader.seek(self.checkpoint.positions)
            raise

    def _read_and_deliver(self, reader: JournalReader) -> int:
        done = 0
        batch: list[Delivery] = []
        for record in reader.records():
            loc = (record.writer_id, record.segment_index, record.offset)
            if self._require_completions().index.is_terminal(loc):
                # Finished already (a checkpoint lost or older than the ledger), or an invalid
                # record recorded before a step was retried: never counted twice.
                continue
            env = self._decode(record, record_invalid=True)
            if env is None:
                continue
            if env.run_at is not None and env.run_at > self.clock():
                self._hold(env, record)
                continue
            batch.append(self._delivery(env, loc))
            if len(batch) >= self.batch_size:
                done += self._deliver(batch)
                batch = []
                done += self._forward_due()  # a long backlog must not hold back due jobs
                if self._stopping:
                    return done  # SIGTERM: the batch in flight is delivered and checkpointed
        if batch or self._position_moved():
            done += self._deliver(batch)
        return done

    def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, waking early only for a stop (producers' nudges do not cut it short)."""
        deadline = time.monotonic() + seconds
        while not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._listener is not None:
                self._listener.wait(left)
            else:
                time.sleep(min(left, 0.05))  # no socket to wake it: look at the stop flag often

    def _maintain(self) -> None:
        """Harvest, retries, epoch, reconcile, compaction; a Redis outage only postpones them."""
        c = self._require_completions()
        try:
            if time.monotonic() >= self._next_epoch_check:
                self._check_epoch()
            harvested = c.harvest()
            self._harvested.set()
            if harvested:
                self._save(0)  # publishes the terminal count (producers' capacity check)
            retries = c.due_retries()
            if retries:
                self._push(retries)
                c.pushed(retries)
            redo = c.reconcile_step()
            if redo:
                self._push(redo)
            c.compact()
            if c.take_forgotten_chains():
                # Gone for good: the reader must not put their positions back in the checkpoint.
                self._require_reader().seek(self.checkpoint.positions)
                self._save(0)
            self._came_back()
        except TransportError as exc:
            self._went_down(exc, "completions wait")

    def _check_epoch(self) -> None:
        """Start a refill if Redis lost state since the epoch was set; TransportError if it is down."""
        epoch = self.checkpoint.epoch
        self._require_completions().check_epoch()
        self._next_epoch_check = time.monotonic() + EPOCH_CHECK_S
        if self.checkpoint.epoch != epoch:
            self._save(0)

    def _require_completions(self) -> Completions:
        if self.completions is None:
            raise RuntimeError("Forwarder.open() was not called")
        return self.completions

    def _delivery(self, env: Envelope, loc: tuple[str, int, int]) -> Delivery:
        # A requeued job replaces its failed predecessor in RQ (same job id, a later run).
        return self._require_completions().delivery(env, loc, 1, force=env.requeue > 0)

    def _wait(self) -> None:
        timeout = self.idle_timeout_s
        if self.checkpoint.held:
            timeout = min(timeout, max(0.0, self.checkpoint.held[0].run_at - self.clock()))
        retries = self.completions.index.retries if self.completions is not None else {}
        if retries:
            soonest = min(run_at for run_at, _ in retries.values())
            timeout = min(timeout, max(0.05, soonest - self.clock()))
        if self._listener is not None:
            self._listener.wait(timeout)
        else:
            self._sleep(timeout)  # no nudges: poll (a stop still wakes it within 50 ms)

    def _watch(self) -> None:
        """The event watcher (a thread): nudge the loop as soon as a completion event arrives.

        A finished job whose event waits in Redis runs again if Redis loses it before the
        harvest (the one window in docs/guarantees.md): harvesting only on producers' nudges and
        the idle timeout left it open up to a second. The watcher blocks on the stream (XREAD
        BLOCK) and wakes the loop through its own nudge socket, so the loop still sleeps in one
        place and a producer's nudge wakes it as before. After a nudge it waits until the loop
        has harvested, so it never spins on events the loop has not taken yet.
        """
        completions = self._require_completions()
        owner = self.checkpoint.owner
        while not self._watch_stop.is_set():
            try:
                found = self.transport.wait_events(owner, completions.last_event_id, WATCH_BLOCK_S)
            except Exception:  # Redis down, or anything else: the loop's idle timeout still harvests
                self._watch_stop.wait(WATCH_BLOCK_S)
                continue
            if found and not self._watch_stop.is_set() and self._listener is not None:
                self._harvested.clear()
                nudge(self.journal, name=self._listener.name)
                self._harvested.wait(self.idle_timeout_s + WATCH_BLOCK_S)

    # -- pieces -------------------------------------------------------------------------------

    def _require_reader(self) -> JournalReader:
        if self._reader is None:
            raise RuntimeError("Forwarder.open() was not called")
        return self._reader

    def _position_moved(self) -> bool:
        return self._require_reader().position != self.checkpoint.positions

    def _decode(self, record: Record, *, record_invalid: bool = False) -> Envelope | None:
        if record.rtype != RecordType.DATA:
            return None  # a record type this version does not forward
        try:
            return Envelope.from_bytes(record.payload)
        except EnvelopeError as exc:
            # The record passed its checksum, so these are the bytes a producer wrote: a bug or
            # a newer, incompatible producer. Skip it loudly rather than stop every other job,
            # and mark it terminal in the ledger so its segment can be compacted.
            if record_invalid:
                self._require_completions().record_invalid(record)
            self.checkpoint.invalid += 1
            log.error(
                "skipping record %s:%d (segment %d offset %d): not a valid job envelope: %s",
                record.writer_id,
                record.seq,
                record.segment_index,
                record.offset,
                exc,
            )
            return None

    def _hold(self, env: Envelope, record: Record) -> None:
        assert env.run_at is not None
        held = Held(env.run_at, env.id, record.writer_id, record.segment_index, record.offset)
        at = bisect.bisect_left(self.checkpoint.held, held)
        if at < len(self.checkpoint.held) and self.checkpoint.held[at] == held:
            return  # read again after a step was retried: held once
        self.checkpoint.held.insert(at, held)

    def _forward_due(self) -> int:
        """Push held jobs whose time has come, then drop them from the checkpoint."""
        now = self.clock()
        held = self.checkpoint.held
        due = 0
        while due < len(held) and held[due].run_at <= now:
            due += 1
        if not due:
            return 0
        done = 0
        for start in range(0, due, self.batch_size):
            chunk = held[start : min(due, start + self.batch_size)]
            envs = [(h, self._read_held(h)) for h in chunk]
            self._push(
                [self._delivery(e, (h.writer_id, h.segment, h.offset)) for h, e in envs if e is not None]
            )
            done += len(chunk)
        # Only now that Redis has them may they leave the durable checkpoint.
        del held[:due]
        self._save(done)
        return done

    def _read_held(self, held: Held) -> Envelope | None:
        seal_at = seal_offset(self.journal, held.writer_id, held.segment)
        if seal_at is not None and held.offset >= seal_at:
            # Cut off since it was read: a torn tail recovery dropped (never acknowledged, so
            # never promised), or damage an operator dropped with `journal repair --accept-loss`.
            log.warning("held job %s: its record is gone (dropped by recovery or repair)", held.job_id)
            return None
        try:
            record = read_record_at(self.journal, held.writer_id, held.segment, held.offset)
        except FileNotFoundError:
            log.warning("held job %s: its segment is gone (moved aside by journal repair)", held.job_id)
            return None
        # Decoded when it was held; refused now only by a stricter version: terminal, not lost.
        return self._decode(record, record_invalid=True)

    def _clamp_checkpoint(self) -> None:
        """Move positions that point past a segment's data back to its seal (see clamp_to_seals)."""
        moved = clamp_to_seals(self.journal, self.checkpoint.positions)
        for writer_id, position in moved.items():
            log.warning(
                "checkpoint for writer %s pointed past the durable end of segment %d (records "
                "read before they were durable, dropped since as a torn tail); resuming at %d",
                writer_id,
                position.segment,
                position.offset,
            )
            self.checkpoint.positions[writer_id] = position
        if moved:
            save_checkpoint(self.journal, self.checkpoint)

    def _deliver(self, batch: list[Delivery]) -> int:
        """Push a batch, then move the checkpoint to the reader's position (never before)."""
        if batch:
            self._push(batch)
        self.checkpoint.positions = self._require_reader().position
        self._save(len(batch))
        return len(batch)

    def _save(self, forwarded: int) -> None:
        self.checkpoint.forwarded += forwarded
        if self.completions is not None:
            self.checkpoint.terminal = self.completions.terminal_total
        started = time.perf_counter()
        save_checkpoint(self.journal, self.checkpoint)
        if self.on_durable_write is not None:
            self.on_durable_write(time.perf_counter() - started)

    def _went_down(self, exc: TransportError, what: str) -> None:
        """Count a transport failure; log only the first of an outage.

        Raises ``exc`` again if Redis refuses the configuration (RedisRefused): retrying cannot
        fix a wrong password or a denying ACL, and the journal keeps every job meanwhile.
        """
        if isinstance(exc, RedisRefused):
            raise exc
        self.stats.transport_failures += 1
        if self.stats.down_since is None:
            self.stats.down_since = time.monotonic()
            log.warning("transport unavailable (%s), retrying: %s", what, exc)

    def _came_back(self) -> None:
        if self.stats.down_since is not None:
            log.warning("transport available again after %.1f s", time.monotonic() - self.stats.down_since)
            self.stats.down_since = None

    def _push(self, batch: list[Delivery]) -> None:
        """Push until the transport takes the batch; back off while it is down."""
        if not batch:
            return
        self.stats.oldest_unpushed = min(d.envelope.created_at for d in batch)
        delay = self.backoff_initial_s
        while True:
            try:
                result = self.transport.push(batch)
            except UnencodableJobs as exc:
                # Not an outage: these would fail again on every retry, holding back the rest.
                batch = self._drop_unencodable(batch, exc)
                if not batch:
                    return
                continue
            except TransportError as exc:
                self._went_down(exc, f"holding {len(batch)} jobs")
                self._sleep(self._rng.uniform(delay / 2, delay))
                if self._stopping:
                    raise _Stopped from exc
                delay = min(self.backoff_max_s, delay * 2)
                continue
            self._came_back()
            self.stats.oldest_unpushed = None
            self.stats.batches += 1
            self.stats.pushed += result.pushed
            self.stats.duplicate_pushes += result.already_present
            self.checkpoint.duplicate_pushes += result.already_present
            return

    def _drop_unencodable(self, batch: list[Delivery], exc: UnencodableJobs) -> list[Delivery]:
        """Record the jobs the transport refused as invalid (durably, before the checkpoint moves)."""
        refused = {id(delivery) for delivery, _ in exc.rejected}
        for delivery, reason in exc.rejected:
            self._require_completions().record_invalid_at(delivery.loc)
            self.checkpoint.invalid += 1
            log.error(
                "skipping job %s (record %s:%d:%d): the transport cannot encode it: %s",
                delivery.envelope.id,
                *delivery.loc,
                reason,
            )
        return [d for d in batch if id(d) not in refused]
