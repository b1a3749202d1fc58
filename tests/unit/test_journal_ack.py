"""What ``JournalIOError`` means (issue 12.4): a durable append is never reported failed, and a
failed one has an *unknown* outcome whose retry (same job id / idempotency key) runs once."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import JournalIOError
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import FileOps, JournalReader, JournalWriter
from hybridq.ops.status import collect_status
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport

from tests import tasks


class LaterBatchFailsDuringSync(FileOps):
    """While the first data fdatasync runs, another thread's append hits ENOSPC on write."""

    def __init__(self) -> None:
        self.writer: JournalWriter | None = None
        self.later: list[BaseException] = []
        self.fail_writes = False
        self.armed = False

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.fail_writes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(fd, data)

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)  # the first record is durable now
        if not self.armed:
            return
        self.armed = False
        self.fail_writes = True
        assert self.writer is not None
        writer = self.writer

        def later() -> None:
            try:
                writer.append(b"second")
            except BaseException as exc:
                self.later.append(exc)

        # Another thread's batch fails (and poisons the segment) before this fsync returns.
        thread = threading.Thread(target=later)
        thread.start()
        thread.join(5)
        self.fail_writes = False


def test_an_append_whose_fsync_succeeded_is_acknowledged_though_a_later_batch_failed(
    journal_dir: Path,
) -> None:
    ops = LaterBatchFailsDuringSync()
    with JournalWriter(journal_dir, fileops=ops) as writer:
        ops.writer = writer
        writer.append(b"warm-up")  # the segment exists; its header is synced
        ops.armed = True
        rid = writer.append(b"first")  # raised JournalIOError before the fix
        assert len(ops.later) == 1
        assert isinstance(ops.later[0], JournalIOError)
        assert ops.later[0].errno == errno.ENOSPC
        writer.append(b"third")  # goes on in a new chain
        assert rid.writer_id != writer.writer_id
    payloads = [r.payload for r in JournalReader(journal_dir).records()]
    assert sorted(payloads) == [b"first", b"third", b"warm-up"]


class FsyncFails(FileOps):
    """The next data fdatasync fails with EIO (after the bytes reached the page cache)."""

    def __init__(self) -> None:
        self.fail = False

    def fdatasync(self, fd: int) -> None:
        if self.fail:
            self.fail = False
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().fdatasync(fd)


def test_a_failed_fsync_leaves_the_outcome_unknown_and_a_retry_with_the_same_id_runs_once(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = FsyncFails()
    real_init = JournalWriter.__init__

    def init(self: JournalWriter, path: str, **kwargs: object) -> None:
        if os.path.basename(str(path)) == "journal":  # the producer's writer, not the ledger's
            kwargs["fileops"] = ops
        real_init(self, path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(JournalWriter, "__init__", init)
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 0, 0)
    ops.fail = True
    with pytest.raises(JournalIOError) as failed:
        queue.enqueue(tasks.add, 1, 1)
    # The record reached the file before its fsync failed: a reader (the forwarder) sees it.
    (job_id,) = failed.value.job_ids
    (key,) = failed.value.idempotency_keys
    assert key == job_id  # the default key is the job id
    assert job_id in b"".join(r.payload for r in JournalReader(journal_dir).records()).decode()
    # The documented retry: the same idempotency key (a new job id is fine).
    again = queue.enqueue(tasks.add, 1, 1, idempotency_key=key)
    assert again.id != job_id
    _close_writers()
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()
        transport.work()
        forwarder.step()
    # Both records of the 1+1 job were delivered, its task ran once; the other was a duplicate.
    assert sorted(transport.executions.values()) == [1, 1]
    assert set(transport.deliveries) >= {job_id, again.id}
    status = collect_status(str(journal_dir))
    assert (status["accepted"], status["pending"], status["duplicates_suppressed"]) == (3, 0, 1)


def test_a_failed_batch_names_every_job_it_held(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = Queue(journal=journal_dir)
    envs = [queue.prepare(tasks.add, (i, i)) for i in range(3)]

    def fail(self: JournalWriter, payloads: object, rtype: int = 1) -> list[object]:
        raise JournalIOError(str(journal_dir), "fsync", OSError(errno.EIO, "injected"))

    monkeypatch.setattr(JournalWriter, "append_many", fail)
    with pytest.raises(JournalIOError) as failed:
        queue.enqueue_many(envs)
    assert failed.value.job_ids == tuple(e.id for e in envs)
    assert failed.value.idempotency_keys == tuple(e.idempotency_key for e in envs)
    assert "outcome unknown" in str(failed.value)


class BlockFirstSyncFailLaterWrite(FileOps):
    """Data fdatasync #1 blocks until released; during #2 another thread's write hits ENOSPC."""

    def __init__(self) -> None:
        self.syncs = 0
        self.release = threading.Event()
        self.in_first = threading.Event()
        self.fail_writes = False
        self.later: Callable[[], None] | None = None

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.fail_writes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(fd, data)

    def fdatasync(self, fd: int) -> None:
        self.syncs += 1
        if self.syncs == 1:
            self.in_first.set()
            assert self.release.wait(10)
        super().fdatasync(fd)
        if self.syncs == 2 and self.later is not None:
            self.fail_writes = True
            thread = threading.Thread(target=self.later)
            thread.start()
            thread.join(5)
            self.fail_writes = False
            time.sleep(0.05)  # let the appender the failure woke look before this fsync returns


def test_appenders_waiting_on_an_fsync_in_flight_are_acknowledged_when_it_succeeds(
    journal_dir: Path,
) -> None:
    ops = BlockFirstSyncFailLaterWrite()
    results: dict[str, object] = {}
    with JournalWriter(journal_dir, fileops=ops) as writer:

        def append(name: str) -> None:
            try:
                results[name] = writer.append(name.encode())
            except JournalIOError as exc:
                results[name] = exc

        ops.later = lambda: append("failing")
        first = threading.Thread(target=append, args=("first",))
        first.start()
        assert ops.in_first.wait(5)  # "first" leads fsync #1, which blocks
        group = [threading.Thread(target=append, args=(name,)) for name in ("a", "b")]
        for t in group:
            t.start()  # both join the next generation: one leads fsync #2, one waits on it
        deadline = time.monotonic() + 5
        while writer._segment is not None and writer._segment.written_seq < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        time.sleep(0.1)  # both are waiting now
        ops.release.set()
        for t in (first, *group):
            t.join(10)
    assert isinstance(results["failing"], JournalIOError)
    # Before the fix the one waiting on fsync #2 raised, though fsync #2 covered its record.
    assert {name: type(r).__name__ for name, r in results.items() if name != "failing"} == {
        "first": "RecordId",
        "a": "RecordId",
        "b": "RecordId",
    }
    payloads = sorted(r.payload for r in JournalReader(journal_dir).records())
    assert payloads == [b"a", b"b", b"first"]
