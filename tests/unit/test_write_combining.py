"""Write combining: appenders queued behind a running write are written by that writer.

Each appender still gets its own record id and is acknowledged only after an fsync covering its
record (docs/journal.md); a failed write, a failed fsync or a close fails exactly the appends it
should, and never leaves an appender asleep.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.errors import JournalClosed, JournalIOError
from hybridq.journal import Durability, FileOps, JournalReader, JournalWriter, RecordId

THREADS = 16


class SlowOps(FileOps):
    """Counts data writes and fdatasyncs; makes them slow so that appenders pile up behind them."""

    def __init__(self, write_delay: float = 0.0, sync_delay: float = 0.0) -> None:
        self.write_delay = write_delay
        self.sync_delay = sync_delay
        self.writes = 0
        self.syncs = 0
        self.synced: set[int] = set()  # fds with an fdatasync since their last write
        self.lock = threading.Lock()

    def write(self, fd, data):
        with self.lock:
            self.writes += 1
        time.sleep(self.write_delay)
        return super().write(fd, data)

    def fdatasync(self, fd):
        time.sleep(self.sync_delay)
        super().fdatasync(fd)
        with self.lock:
            self.syncs += 1


def hammer(
    writer: JournalWriter, per_thread: int, payload: Callable[[int, int], bytes] | None = None
) -> tuple[dict[bytes, RecordId], list[BaseException]]:
    """``THREADS`` threads append ``per_thread`` records each; return the acked ids and the errors."""
    acked: dict[bytes, RecordId] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    make = payload or (lambda t, i: b"t%02d-%04d" % (t, i))

    def work(t: int) -> None:
        for i in range(per_thread):
            data = make(t, i)
            try:
                rid = writer.append(data)
            except (JournalIOError, JournalClosed) as exc:
                with lock:
                    errors.append(exc)
                continue
            with lock:
                acked[data] = rid

    pool = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(30)
        assert not t.is_alive(), "an appender never woke up"
    return acked, errors


def check_acked_records(journal_dir: Path, acked: dict[bytes, RecordId]) -> None:
    """Every acknowledged record is in the journal, once, where its record id says."""
    records = list(JournalReader(journal_dir).records())
    where = {r.payload: (r.writer_id, r.seq, r.segment_index, r.offset) for r in records}
    assert len(where) == len(records)  # no record twice
    for data, rid in acked.items():
        assert where[data] == (rid.writer_id, rid.seq, rid.segment, rid.offset), data
    by_segment: dict[tuple[str, int], list[int]] = {}
    for r in records:
        by_segment.setdefault((r.writer_id, r.segment_index), []).append(r.seq)
    for seqs in by_segment.values():
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous, in order


def test_appends_queued_behind_a_running_write_share_its_write(journal_dir: Path) -> None:
    ops = SlowOps(write_delay=0.002)
    with JournalWriter(journal_dir, fileops=ops) as writer:
        writer.append(b"warm-up")
        before = ops.writes
        acked, errors = hammer(writer, 10)
        # One appender writes for all that queued while its write(2) ran: before write
        # combining, every append made a write of its own (160 here).
        assert ops.writes - before <= THREADS * 10 // 3, ops.writes - before
    assert not errors
    assert len(acked) == THREADS * 10
    check_acked_records(journal_dir, acked)


def test_every_acknowledged_append_was_covered_by_an_fsync(journal_dir: Path) -> None:
    class Tracking(SlowOps):
        """Notes, per record, whether an fdatasync ran after it was written."""

        def __init__(self) -> None:
            super().__init__(sync_delay=0.001)
            self.written = 0
            self.durable = 0

        def write(self, fd, data):
            n = super().write(fd, data)
            with self.lock:
                self.written += 1
            return n

        def fdatasync(self, fd):
            with self.lock:
                covered = self.written
            super().fdatasync(fd)
            with self.lock:
                self.durable = max(self.durable, covered)

    ops = Tracking()
    with JournalWriter(journal_dir, fileops=ops) as writer:
        seen_durable: list[int] = []
        original = writer.append

        def append(data: bytes) -> RecordId:
            rid = original(data)
            seen_durable.append(ops.durable)
            return rid

        writer.append = append  # type: ignore[method-assign]
        acked, errors = hammer(writer, 20)
        # Each ack came after an fdatasync that started once its write was done.
        assert ops.durable == ops.written
    assert not errors
    assert len(acked) == THREADS * 20
    check_acked_records(journal_dir, acked)


def test_concurrent_appends_across_rotations_keep_every_chain_contiguous(journal_dir: Path) -> None:
    ops = SlowOps(write_delay=0.0005, sync_delay=0.001)
    with JournalWriter(journal_dir, fileops=ops, max_segment_bytes=4096) as writer:
        acked, errors = hammer(writer, 30, lambda t, i: b"t%02d-%04d-" % (t, i) + b"." * 60)
    assert not errors
    assert len(acked) == THREADS * 30
    assert len(list(journal_dir.glob("*.wal"))) > 10
    check_acked_records(journal_dir, acked)


def test_no_fsync_mode_with_concurrent_appends(journal_dir: Path) -> None:
    ops = SlowOps(write_delay=0.001)
    with JournalWriter(journal_dir, fileops=ops, durability=Durability.NO_FSYNC) as writer:
        writer.append(b"warm-up")
        before = ops.syncs
        acked, errors = hammer(writer, 10)
        assert ops.syncs == before
    assert not errors
    check_acked_records(journal_dir, acked)


class FailingWrites(SlowOps):
    """Every seventh data write fails with ENOSPC."""

    def __init__(self) -> None:
        super().__init__(write_delay=0.0005, sync_delay=0.001)
        self.data_writes = 0

    def write(self, fd, data):
        if len(data) != 64:  # not a segment header
            with self.lock:
                self.data_writes += 1
                fail = self.data_writes % 7 == 0
            if fail:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(fd, data)


def test_failed_writes_under_concurrency_fail_only_unacknowledged_appends(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir, fileops=FailingWrites())
    acked, errors = hammer(writer, 20)
    with contextlib.suppress(JournalIOError):
        writer.close()  # its seal may meet a failing write too
    assert errors, "no write failed"
    assert all(isinstance(e, JournalIOError) for e in errors)
    assert len(acked) + len(errors) == THREADS * 20
    check_acked_records(journal_dir, acked)


class FailingSyncs(SlowOps):
    """Every fifth data fdatasync fails with EIO."""

    def __init__(self) -> None:
        super().__init__(sync_delay=0.001)
        self.count = 0

    def fdatasync(self, fd):
        with self.lock:
            self.count += 1
            fail = self.count % 5 == 0
        if fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().fdatasync(fd)


def test_failed_fsyncs_under_concurrency_never_acknowledge_and_never_hang(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir, fileops=FailingSyncs())
    acked, errors = hammer(writer, 20)
    with contextlib.suppress(JournalIOError):
        writer.close()  # its seal may meet a failing fsync too
    assert errors, "no fsync failed"
    assert all(isinstance(e, JournalIOError) for e in errors)
    assert len(acked) + len(errors) == THREADS * 20
    check_acked_records(journal_dir, acked)


def test_close_while_appenders_are_queued_fails_them_cleanly(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir, fileops=SlowOps(write_delay=0.001, sync_delay=0.001))
    writer.append(b"warm-up")
    closer = threading.Timer(0.05, writer.close)
    closer.start()
    acked, errors = hammer(writer, 200)
    closer.join()
    assert errors, "close came after every append"
    assert all(isinstance(e, JournalClosed) for e in errors)
    check_acked_records(journal_dir, acked)


def test_a_queued_appender_interrupted_in_its_sleep_leaves_no_one_waiting(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # KeyboardInterrupt reaches a queued appender while it sleeps, before or after the writer
    # took its batch: it must leave the queue, or pass on the writer's role or the fsync's lead
    # it was given, so the other appenders still finish.
    from hybridq.journal import commit as writer_module

    budget = [12]
    budget_lock = threading.Lock()
    real_allocate = writer_module._allocate_lock

    class Interruptible:
        def __init__(self) -> None:
            self.lock = real_allocate()
            self.queued = sys._getframe(1).f_code.co_name == "_commit"
            self.calls = 0

        def acquire(self, *args, **kwargs) -> bool:
            self.calls += 1
            if self.queued and self.calls == 2:
                with budget_lock:
                    interrupt = budget[0] > 0
                    budget[0] -= interrupt
                if interrupt:
                    if budget[0] % 2 and self.lock.acquire(timeout=0.002):
                        return True  # woken in time: nothing to interrupt
                    raise KeyboardInterrupt
            return self.lock.acquire(*args, **kwargs)

        def release(self) -> None:
            self.lock.release()

    monkeypatch.setattr(writer_module, "_allocate_lock", Interruptible)
    monkeypatch.setattr(writer_module, "_WRITER_ROUNDS", 1)  # hand the role on often
    interrupted = []
    with JournalWriter(journal_dir, fileops=SlowOps(write_delay=0.001, sync_delay=0.001)) as writer:
        original = writer.append

        def append(data: bytes) -> RecordId:
            try:
                return original(data)
            except KeyboardInterrupt:
                interrupted.append(data)
                raise JournalIOError(str(journal_dir), "write", OSError(errno.EINTR, "interrupted")) from None

        writer.append = append  # type: ignore[method-assign]
        acked, errors = hammer(writer, 20)
    assert interrupted, "no appender was interrupted"
    assert len(errors) == len(interrupted)
    assert len(acked) + len(interrupted) == THREADS * 20
    check_acked_records(journal_dir, acked)
