"""The journal writer: durable appends with group commit, rotation and a fatal-error policy.

Format: ``docs/journal-format.md``. Rules: docs/reliability.md rules 1-9. One :class:`JournalWriter` is
meant to be shared by every thread of a process; each writer appends to its own chain of segment
files, so many processes can share one journal directory without a global lock.

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import secrets
import threading
import time
import warnings
import weakref
from _thread import LockType
from _thread import allocate_lock as _allocate_lock
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Self

from hybridq import crashpoints
from hybridq.errors import JournalClosed, JournalIOError, RecordTooLarge

from .fileops import OS_FILEOPS, FileOpError, FileOps, replace_durably, write_all
from .format import (
    DEFAULT_MAX_SEGMENT_BYTES,
    MAX_PAYLOAD_BYTES,
    RECORD_HEADER_SIZE,
    SEAL_RECORDS,
    TMP_SUFFIX,
    RecordType,
    SegmentHeader,
    encode_records,
    segment_name,
)
from .paths import check_journal_dir, ensure_journal_dir, open_journal_dir
from .segment import OpenSegment, SealError, as_oserror, close_quietly, seal_fd

__all__ = ["Durability", "JournalWriter", "RecordId"]

log = logging.getLogger("hybridq.journal")

_ZERO_SALT = bytes(8)
#: Fsyncs one group-commit leader runs in a row at most while appends keep arriving (its own
#: append waits for them all: the bound keeps its latency at a few fsyncs).
_LEADER_ROUNDS = 4
#: Rounds of queued batches one writer writes at most before handing the role on.
_WRITER_ROUNDS = 4


class _Slot:
    """One appender's batch on its way through write combining and group commit."""

    __slots__ = ("error", "gen", "items", "lock", "result", "rtype", "seg", "size", "write_next")

    def __init__(self, items: Sequence[bytes], rtype: int, size: int) -> None:
        self.items = items
        self.rtype = rtype
        self.size = size
        self.lock: LockType | None = None  # the queued appender sleeps on it
        self.seg: OpenSegment | None = None  # where it was written, and under which generation
        self.gen = 0
        self.result: tuple[str, int, int, int] = ("", 0, -1, -1)
        self.error: BaseException | None = None
        self.write_next = False  # woken to take the writer's role over


class Durability(StrEnum):
    """What an acknowledged append survives."""

    #: Acknowledge after an fdatasync covering the record: survives power loss. The default.
    FSYNC = "fsync"
    #: Acknowledge after write(2): survives a crash of the process, **not** of the machine.
    NO_FSYNC = "no-fsync"


@dataclass(frozen=True, slots=True)
class RecordId:
    """Where an appended record lives: its chain (writer id), sequence number, segment, offset."""

    writer_id: str
    seq: int
    segment: int = -1
    offset: int = -1


_live_writers: weakref.WeakSet[JournalWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_live_writers):
        writer._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class JournalWriter:
    """Appends records to a journal directory; thread-safe; ack only after fsync.

    Args:
        path: the journal directory (created 0700 when missing).
        durability: :attr:`Durability.FSYNC` unless a weaker mode is asked for by name.
        max_segment_bytes: seal the segment and start the next one past this size.
        fileops: the file-operations seam (tests inject faults through it).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durability: Durability = Durability.FSYNC,
        max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
        fileops: FileOps = OS_FILEOPS,
    ) -> None:
        if max_segment_bytes < 4096:
            raise ValueError("max_segment_bytes must be at least 4096")
        self.path = ensure_journal_dir(path, fileops)
        # The directory itself, held open: a segment is created only while the path still
        # leads to it (a journal swapped in at that path never receives our jobs).
        self._dir_fd = open_journal_dir(self.path)
        self.durability = Durability(durability)
        self.max_segment_bytes = max_segment_bytes
        self._ops = fileops
        self._lock = threading.Lock()  # serializes writes, rotation and chain changes
        self._sync_lock = threading.Lock()  # guards every OpenSegment's sync state
        self._cond = threading.Condition(self._sync_lock)  # "an fsync or seal ended"
        self._segment: OpenSegment | None = None
        self._closed = False
        self._writing = False  # an appender is writing queued batches (guarded by _sync_lock)
        self._queued: list[_Slot] = []  # batches waiting for it, in arrival order
        self._new_chain()
        #: Number of fsyncs that covered appended records (group commit makes this < appends).
        self.fsync_count = 0
        #: Seconds the last such fsync took.
        self.last_fsync_seconds = 0.0
        self._crashpoints = crashpoints.enabled()  # armed by HYBRIDQ_CRASH_POINT (tests only)
        _live_writers.add(self)

    # -- public API ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def writer_id(self) -> str:
        """The id of the chain the next append goes to."""
        return self._writer_id

    @property
    def written(self) -> tuple[str, int]:
        """The chain and the sequence number through which its records are written.

        Read without a lock: at most a moment stale, and then smaller, never ahead of the file.
        """
        seg = self._segment
        return (seg.writer_id, seg.written_seq) if seg is not None else (self._writer_id, 0)

    def append(self, payload: bytes, rtype: int = RecordType.DATA) -> RecordId:
        """Append one record; return once it is durable (per :attr:`durability`).

        Raises:
            RecordTooLarge: the payload is over ``MAX_PAYLOAD_BYTES``; nothing was written.
            JournalIOError: a write or fsync failed; the record is not acknowledged, and its
                outcome is unknown (written bytes whose fsync failed may still be read).
        """
        if type(payload) is not bytes:
            payload = bytes(payload)
        _check_batch((payload,), rtype)
        writer_id, first, segment, offset = self._commit((payload,), rtype, RECORD_HEADER_SIZE + len(payload))
        return RecordId(writer_id, first, segment, offset)

    def append_many(self, payloads: Iterable[bytes], rtype: int = RecordType.DATA) -> list[RecordId]:
        """Append records as one batch under one fsync; all or none are acknowledged."""
        items = [p if type(p) is bytes else bytes(p) for p in payloads]
        _check_batch(items, rtype)
        if not items:
            return []
        batch_bytes = sum(map(len, items)) + RECORD_HEADER_SIZE * len(items)
        writer_id, first, segment, offset = self._commit(items, rtype, batch_bytes)
        if len(items) == 1:  # enqueue's case: no offsets to add up
            return [RecordId(writer_id, first, segment, offset)]
        offsets = itertools.accumulate((RECORD_HEADER_SIZE + len(p) for p in items[:-1]), initial=offset)
        return [RecordId(writer_id, first + i, segment, at) for i, at in enumerate(offsets)]

    def _commit(self, items: Sequence[bytes], rtype: int, batch_bytes: int) -> tuple[str, int, int, int]:
        """Write a checked batch and wait until it is durable.

        Returns the chain, the first sequence number, and the segment index and offset of the
        first record.

        Write combining: the appender that finds no write running becomes the *writer*; batches
        that arrive while it writes are queued, and it writes them too (one ``write(2)`` per
        segment), in arrival order, so their threads never queue for the write lock (each such
        queueing is a thread hand-off under the GIL). They sleep once, until an fsync covers
        their batch (or their write failed).
        """
        slot = _Slot(items, rtype, batch_bytes)
        with self._cond:
            if self._closed:
                raise JournalClosed
            queued = self._writing
            if queued:
                slot.lock = _allocate_lock()
                slot.lock.acquire()
                self._queued.append(slot)
            else:
                self._writing = True
        last: tuple[OpenSegment, int] | None = None
        if queued:
            try:
                slot.lock.acquire()  # type: ignore[union-attr]  # written and durable, failed, or our turn
            except BaseException:  # KeyboardInterrupt: never leave the others without a writer
                self._abandon(slot)
                raise
            if slot.write_next:
                last = self._write_queued(slot)
        else:
            last = self._write_queued(slot)
        seg = slot.seg
        lead = last if slot.error is None and last is not None and last[0] is seg else None
        if lead is None and last is not None:
            with self._cond:
                self._wake(last[0])  # we will not lead the fsync of what we wrote: one of them does
        if slot.error is not None:
            raise slot.error
        assert seg is not None
        if self._crashpoints:
            crashpoints.reached("after_write_before_fsync")
        if lead is not None:
            # As the writer, wait for the last generation written: the batches written for
            # others then get their fsync too (led by us if none is running).
            self._wait_durable(*lead)
        elif seg.synced_gen < slot.gen:
            self._wait_durable(seg, slot.gen)  # lead its fsync, or learn why it failed
        if self._crashpoints:
            crashpoints.reached("after_fsync_before_ack")
        return slot.result

    def _abandon(self, slot: _Slot) -> None:
        """A queued appender interrupted while asleep: leave the queue, or pass on its role."""
        with self._cond:
            if slot in self._queued:
                self._queued.remove(slot)
                return
        slot.lock.acquire()  # type: ignore[union-attr]  # taken from the queue: its release is due
        last = self._write_queued(slot) if slot.write_next else (slot.seg, slot.gen)
        if last is not None and last[0] is not None and last[0].synced_gen < last[1]:
            with self._cond:
                self._wake(last[0])  # another sleeper leads the fsync we will not wait for

    def _write_queued(self, own: _Slot) -> tuple[OpenSegment, int] | None:
        """As the writer: write ``own``, then what was queued meanwhile (a few rounds at most).

        Every other batch written is handed to the group commit (its thread sleeps until an
        fsync covers it); a failed one is woken with its error. Returns the segment and
        generation of the last batch written, whose fsync the caller must see to.
        """
        batch = [own]
        last: tuple[OpenSegment, int] | None = None
        failure: BaseException | None = None
        for rounds in range(1, _WRITER_ROUNDS + 1):
            try:
                self._write_slots(batch)
            except BaseException as exc:  # not a batch's own outcome: fail whatever is left
                failure = exc
                for slot in batch:
                    if slot.seg is None and slot.error is None:
                        slot.error = exc
            with self._cond:
                for slot in batch:
                    seg = slot.seg
                    if slot.error is None and seg is not None:
                        last = (seg, slot.gen)
                    if slot is own:
                        continue
                    if slot.error is not None or seg is None or self.durability is Durability.NO_FSYNC:
                        slot.lock.release()  # type: ignore[union-attr]
                        continue
                    seg.gens.setdefault(slot.gen, []).append(slot.lock)  # type: ignore[arg-type]
                    if seg.synced_gen >= slot.gen or seg.error is not None:
                        self._wake(seg, leader=False)  # sealed or poisoned since it was written
                batch, self._queued = self._queued, []
                if not batch:
                    self._writing = False
                    break
                if rounds == _WRITER_ROUNDS or failure is not None:
                    # Hand the writer's role on: our own batch must not wait behind a stream.
                    nxt = batch.pop(0)
                    self._queued = batch
                    nxt.write_next = True
                    nxt.lock.release()  # type: ignore[union-attr]
                    break
        if failure is not None and not isinstance(failure, Exception):
            raise failure
        return last

    def _write_slots(self, batch: list[_Slot]) -> None:
        """Write queued batches in order, one write per segment; fill in each one's outcome."""
        with self._lock:
            i = 0
            while i < len(batch):
                if self._closed:
                    for slot in batch[i:]:
                        slot.error = JournalClosed()
                    return
                try:
                    seg = self._writable_segment(batch[i].size)
                except Exception as exc:
                    batch[i].error = exc
                    i += 1
                    continue
                # As many of the following batches as fit without rotating.
                j, size = i + 1, seg.size + batch[i].size
                while j < len(batch) and size + batch[j].size <= self.max_segment_bytes:
                    size += batch[j].size
                    j += 1
                group = batch[i:j]
                i = j
                first = seq = seg.next_seq
                offset = seg.size
                parts = []
                for slot in group:
                    # synced_seq may be a moment stale (smaller): that only makes the stated
                    # distance larger, which the reader treats as "less was durable" (safe).
                    blob = encode_records(seg.seed, seq, slot.rtype, slot.items, synced_seq=seg.synced_seq)
                    slot.result = (seg.writer_id, seq, seg.index, offset)
                    seq += len(slot.items)
                    offset += len(blob)
                    parts.append(blob)
                try:
                    self._write(seg, parts[0] if len(parts) == 1 else b"".join(parts))
                except JournalIOError as exc:
                    for slot in group:
                        slot.error = exc
                    continue
                seg.next_seq = seq
                seg.data_count += seq - first
                seg.last_data_seq = seq - 1
                with self._cond:
                    seg.written_seq = seq - 1
                    gen = seg.open_gen
                for slot in group:
                    slot.seg, slot.gen = seg, gen

    def close(self) -> None:
        """Seal the current segment and release it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            seg, self._segment = self._segment, None
            try:
                if seg is not None and seg.error is None:
                    self._seal(seg)
                elif seg is not None:
                    close_quietly(self._ops, seg.fd)
            finally:
                with contextlib.suppress(OSError):
                    os.close(self._dir_fd)
        _live_writers.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and getattr(self, "_segment", None) is not None:
            warnings.warn(f"JournalWriter for {self.path} was not closed", ResourceWarning, stacklevel=1)
        if not getattr(self, "_closed", True) and hasattr(self, "_dir_fd"):
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)

    # -- internals ----------------------------------------------------------------------------

    def _new_chain(self) -> None:
        """Start a fresh chain: a new writer id whose first segment is created on first append."""
        self._writer_id = secrets.token_hex(8)
        self._next_index = 0
        self._next_first_seq = 1
        self._prev_salt = _ZERO_SALT

    def _forget_after_fork(self) -> None:
        # In a forked child: the parent owns the open segment (and its flock). Never write
        # through it; start a chain of our own. Only the forking thread exists here, so the
        # locks are replaced rather than trusted (another thread may have held them).
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._cond = threading.Condition(self._sync_lock)
        self._writing = False
        self._queued = []
        seg, self._segment = self._segment, None
        if seg is not None:
            close_quietly(self._ops, seg.fd)  # our copy only; the parent's fd and lock stay
        self._new_chain()

    def _writable_segment(self, batch_bytes: int) -> OpenSegment:
        """The segment the next batch goes to, rotating or replacing a poisoned one. Holds _lock."""
        seg = self._segment
        if seg is not None and seg.error is not None:
            # Invariant 2: a failed write or fsync is fatal for that file. Its unacknowledged
            # records are failed already; continue in a new chain so no record ever follows a
            # damaged region of the same chain.
            close_quietly(self._ops, seg.fd)
            self._segment = seg = None
            self._new_chain()
        if seg is not None and seg.size + batch_bytes > self.max_segment_bytes and seg.data_count:
            self._seal(seg)
            self._segment = seg = None
        if seg is None:
            seg = self._segment = self._create_segment()
        return seg

    def _create_segment(self) -> OpenSegment:
        """Create the chain's next segment: temp file, header, fsync, flock, rename, dir fsync."""
        ops = self._ops
        check_journal_dir(self._dir_fd, self.path)  # JournalPathError: nothing is written
        name = segment_name(self._writer_id, self._next_index)
        path = os.path.join(self.path, name)
        tmp = path + TMP_SUFFIX
        salt = secrets.token_bytes(8)
        header = SegmentHeader(self._writer_id, salt, self._prev_salt, self._next_index, self._next_first_seq)
        encoded = header.encode()

        def fill(fd: int) -> None:
            # Lock before the file gets its real name: an unlocked unsealed segment means "its
            # writer is dead" to recovery, so it must never be visible unlocked while we live.
            try:
                ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                raise FileOpError("flock", exc) from exc
            write_all(ops, fd, encoded)

        try:
            # Rule 5: the directory fsync at its end keeps the new name (and acked records) there.
            fd = replace_durably(ops, path, fill, tmp=tmp, flags=os.O_EXCL | os.O_APPEND, keep_open=True)
        except JournalIOError as exc:
            if exc.op != "create":
                for leftover in (tmp, path) if exc.op == "directory fsync" else (tmp,):
                    with contextlib.suppress(OSError):
                        ops.unlink(leftover)
            self._new_chain()
            raise
        seg = OpenSegment(
            fd=fd,
            path=path,
            writer_id=self._writer_id,
            index=self._next_index,
            salt=salt,
            first_seq=self._next_first_seq,
        )
        seg.size = len(encoded)
        return seg

    def _write(self, seg: OpenSegment, blob: bytes) -> None:
        """Write a whole batch to ``seg`` or poison it. Holds _lock."""
        start = seg.size
        try:
            if self._crashpoints:
                crashpoints.reached("before_write")
                if crashpoints.armed("mid_record"):
                    write_all(self._ops, seg.fd, blob[: max(1, len(blob) // 2)])
                crashpoints.reached("mid_record")  # counts every passage; kills on the armed one
            write_all(self._ops, seg.fd, blob)
        except OSError as exc:
            # Rule 2: take the partial record back off the file if we can. Either way the
            # segment is poisoned: pending appends fail and nothing more goes into it.
            with contextlib.suppress(OSError):
                self._ops.ftruncate(seg.fd, start)
            err = JournalIOError(seg.path, "write", exc)
            self._poison(seg, err)
            raise err from exc
        seg.size += len(blob)

    def _poison(self, seg: OpenSegment, err: JournalIOError) -> None:
        with self._cond:
            if seg.error is None:
                seg.error = err
                log.error("journal segment %s abandoned after %s error: %s", seg.path, err.op, err)
            self._wake(seg)

    def _wake(self, seg: OpenSegment, *, leader: bool = True) -> None:
        """After an fsync, seal or error (holding the sync lock): wake whoever must act.

        ``leader``: also wake one appender of the next generation to lead its fsync (not when
        the caller goes on to lead it itself).
        """
        gens = seg.gens
        done = list(gens) if seg.error is not None else [g for g in gens if g <= seg.synced_gen]
        for g in done:
            for waiter in gens.pop(g):
                waiter.release()
        if leader and not seg.syncing:
            nxt = gens.get(seg.open_gen)
            if nxt:
                nxt.pop().release()  # it takes the sync lock again and leads
        self._cond.notify_all()  # a seal waiting for the fsync to end

    def _wait_durable(self, seg: OpenSegment, gen: int) -> None:
        """Group commit: return once an fsync covering generation ``gen`` has completed.

        An appender that finds no fsync running leads: it closes the open generation and fsyncs
        everything written so far. Appenders arriving meanwhile join the next generation and
        are all covered by one fsync: the same leader's next one when they arrived during its
        fsync (up to :data:`_LEADER_ROUNDS` in a row, so no handoff to a new leader sits
        between two fsyncs), else one led by one of them.
        """
        if self.durability is Durability.NO_FSYNC:
            # Our write(2) succeeded, which is this mode's acknowledgement. An error on the
            # segment now is a later batch's: ours stays in the file (a failed write is cut
            # back to its own start), so it must not be reported failed.
            return
        lock = self._sync_lock
        lock.acquire()
        held = True
        try:
            while True:
                # Durable first: an fsync that covered ``gen`` makes the records durable even
                # if a later batch's write or fsync poisoned the segment since. So does one
                # still running that covers it (it closed ``gen``): wait for its result.
                if seg.synced_gen >= gen:
                    return
                if seg.error is not None and not (seg.syncing and gen < seg.open_gen):
                    raise seg.error
                if not seg.syncing:
                    self._lead(seg)  # no fsync is running, so ``gen`` is the open generation
                    continue
                waiter = _allocate_lock()
                waiter.acquire()
                seg.gens.setdefault(gen, []).append(waiter)
                lock.release()
                held = False
                waiter.acquire()  # released by _wake: covered, failed, or asked to lead
                # _wake ran under the sync lock after updating the segment, so its writes are
                # visible here. Covered: return without queueing for the sync lock again.
                if seg.synced_gen >= gen:
                    return
                lock.acquire()
                held = True
        finally:
            if held:
                lock.release()

    def _lead(self, seg: OpenSegment) -> None:
        """Run fsyncs for the open generation and those that fill up meanwhile. Holds the sync lock."""
        lock = self._sync_lock
        for rounds in range(1, _LEADER_ROUNDS + 1):
            leading = seg.open_gen
            seg.open_gen += 1
            seg.syncing = True
            target = seg.written_seq
            lock.release()
            failure: OSError | None = None
            started = time.perf_counter()
            try:
                self._ops.fdatasync(seg.fd)
            except OSError as exc:
                failure = exc
            finally:
                lock.acquire()
            if failure is None:
                self.fsync_count += 1
                self.last_fsync_seconds = time.perf_counter() - started
                seg.synced_seq = max(seg.synced_seq, target)
                seg.synced_gen = max(seg.synced_gen, leading)
            elif seg.error is None:
                # Rule 9: after a failed fsync the kernel may have dropped the dirty pages;
                # a retry could "succeed" over lost data. Fail everything pending.
                seg.error = JournalIOError(seg.path, "fsync", failure)
                log.error("journal segment %s abandoned after fsync error: %s", seg.path, failure)
            # Records written during this fsync (their generation is now the open one) get the
            # next fsync at once, from this thread: waking a waiter to lead it would leave the
            # disk idle for a thread hand-off.
            again = seg.error is None and seg.written_seq > seg.synced_seq and rounds < _LEADER_ROUNDS
            if not again:
                seg.syncing = False
            self._wake(seg, leader=not again)
            if not again:
                return

    def _seal(self, seg: OpenSegment) -> None:
        """Seal ``seg`` (two seal records, fsync, read-only, fsync) and close it. Holds _lock.

        Any failure poisons the segment and starts a new chain; the fd is closed exactly once.
        """
        cond = self._cond
        with cond:
            while seg.syncing:
                cond.wait()
            seg.syncing = True  # keep group-commit leaders off the fd while we seal it
        try:
            written = seal_fd(
                self._ops,
                seg.fd,
                seg.seed,
                seg.next_seq,
                seg.last_data_seq,
                seg.data_count,
                synced_seq=seg.synced_seq,
            )
        except BaseException as exc:
            cause = exc.cause if isinstance(exc, SealError) else exc
            err = JournalIOError(
                seg.path, exc.op if isinstance(exc, SealError) else "seal", as_oserror(cause)
            )
            with cond:
                seg.syncing = False
                if seg.error is None:
                    seg.error = err
                self._wake(seg)
            close_quietly(self._ops, seg.fd)
            seg.fd = -1
            self._segment = None
            self._new_chain()
            log.error("journal segment %s abandoned: sealing failed: %s", seg.path, err)
            if not isinstance(exc, Exception):
                raise
            raise err from cause
        seg.next_seq += SEAL_RECORDS
        seg.size += written
        with cond:
            seg.written_seq = seg.synced_seq = seg.next_seq - 1
            seg.synced_gen = seg.open_gen  # the seal's fsync covered every generation
            seg.open_gen += 1
            seg.syncing = False
            self._wake(seg)
        # The seal is durable: whatever close(2) says, this segment is done. Never reuse the fd.
        close_quietly(self._ops, seg.fd)
        seg.fd = -1
        self._next_index = seg.index + 1
        self._next_first_seq = seg.next_seq
        self._prev_salt = seg.salt


def _check_batch(items: Sequence[bytes], rtype: int) -> None:
    if not RecordType.is_data(rtype):
        raise ValueError(f"record type must be 1..127, not {rtype}")
    for payload in items:
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise RecordTooLarge(len(payload), MAX_PAYLOAD_BYTES)
