"""Write combining and group commit: how an append becomes written, then durable.

The part of :class:`~hybridq.journal.writer.JournalWriter` that coordinates appending threads
(``docs/journal.md``): one appender writes for all that queued behind it, one fsync covers every
batch written before it started, and each appender sleeps once. Rules: docs/reliability.md 1, 2
and 9. This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import logging
import threading
import time
from _thread import LockType
from _thread import allocate_lock as _allocate_lock
from collections.abc import Sequence
from enum import StrEnum

from hybridq import crashpoints
from hybridq.errors import JournalClosed, JournalIOError

from .fileops import FileOps
from .format import encode_records
from .segment import OpenSegment

__all__ = ["Durability", "GroupCommit"]

log = logging.getLogger("hybridq.journal")


class Durability(StrEnum):
    """What an acknowledged append survives."""

    #: Acknowledge after an fdatasync covering the record: survives power loss. The default.
    FSYNC = "fsync"
    #: Acknowledge after write(2): survives a crash of the process, **not** of the machine.
    NO_FSYNC = "no-fsync"


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


class GroupCommit:
    """Appending threads' coordination, mixed into the writer (which owns the state below)."""

    durability: Durability
    max_segment_bytes: int
    fsync_count: int
    last_fsync_seconds: float
    _lock: LockType  # serializes writes, rotation and chain changes
    # Guards every OpenSegment's sync state, _writing and _queued. Taken directly, not through
    # _cond (the same lock): Condition.__enter__ is a Python call, ~0.3 us, a few times per job.
    _sync_lock: LockType
    _cond: threading.Condition  # "an fsync or seal ended", on _sync_lock
    _closed: bool
    _writing: bool  # an appender is writing queued batches
    _queued: list[_Slot]  # batches waiting for it, in arrival order
    _crashpoints: bool
    _ops: FileOps

    def _writable_segment(self, batch_bytes: int) -> OpenSegment:
        raise NotImplementedError

    def _write(self, seg: OpenSegment, blob: bytes) -> None:
        raise NotImplementedError

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
        with self._sync_lock:
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
            with self._sync_lock:
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
        with self._sync_lock:
            if slot in self._queued:
                self._queued.remove(slot)
                return
        slot.lock.acquire()  # type: ignore[union-attr]  # taken from the queue: its release is due
        last = self._write_queued(slot) if slot.write_next else (slot.seg, slot.gen)
        if last is not None and last[0] is not None and last[0].synced_gen < last[1]:
            with self._sync_lock:
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
            with self._sync_lock:
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
                with self._sync_lock:
                    seg.written_seq = seq - 1
                    gen = seg.open_gen
                for slot in group:
                    slot.seg, slot.gen = seg, gen

    def _poison(self, seg: OpenSegment, err: JournalIOError) -> None:
        with self._sync_lock:
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
