"""``Queue.enqueue_async`` / ``enqueue_many_async`` (issue 17 item 4): durable on return, never
blocking the event loop (the fsync is slowed through the journal's file-operations seam while a
heartbeat coroutine measures the loop's lag), shared fsyncs across coroutines, and bad input
refused before anything is written, as ``enqueue`` does.
"""

from __future__ import annotations

import asyncio
import errno
import json
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq import EnvelopeError, JournalIOError, NotSerializable, Queue, QueueFull, RecordTooLarge
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.fileops import FileOps

from tests import tasks

FSYNC_S = 0.3


class SlowFsync(FileOps):
    """An fdatasync that takes ``delay`` seconds (a slow disk); call ``fail_at`` raises EIO.

    Also records, when each fdatasync returns, how many bytes had been written before it began:
    what it made durable.
    """

    def __init__(self, delay: float = FSYNC_S, fail_at: int = 0) -> None:
        self.delay, self.fail_at = delay, fail_at
        self.written = 0
        self.durable = 0
        self.fdatasyncs = 0
        self._lock = threading.Lock()

    def write(self, fd: int, data: bytes | memoryview) -> int:
        n = super().write(fd, data)
        with self._lock:
            self.written += n
        return n

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            self.fdatasyncs += 1
            covered, call = self.written, self.fdatasyncs
        time.sleep(self.delay)
        if call == self.fail_at:
            raise OSError(errno.EIO, "Input/output error")
        super().fdatasync(fd)
        with self._lock:
            self.durable = max(self.durable, covered)


_writers: list[JournalWriter] = []


@pytest.fixture(autouse=True)
def _close_slow_writers() -> Iterator[None]:
    yield
    while _writers:
        _writers.pop().close()


def slow_queue(journal: Path, ops: SlowFsync, **options: Any) -> Queue:
    """A queue whose writer goes through ``ops``; its segment already exists (not timed)."""
    queue = Queue(journal=journal, **options)
    assert queue._appender is not None
    queue._appender._writers[0] = writer = JournalWriter(queue.journal, fileops=ops)
    _writers.append(writer)
    delay, fail_at, ops.delay, ops.fail_at = ops.delay, ops.fail_at, 0.0, 0
    writer.append(b"{}")  # creates the segment (a bare record, not a job)
    ops.delay, ops.fail_at, ops.fdatasyncs = delay, fail_at, 0
    return queue


def jobs_in(journal: Path) -> list[dict[str, Any]]:
    records = [json.loads(r.payload) for r in JournalReader(journal).records()]
    return [r for r in records if r]


async def max_lag(work: Coroutine[Any, Any, Any]) -> tuple[Any, float]:
    """Run ``work`` while a heartbeat sleeps 5 ms at a time; its result and the longest lag (s)."""
    lags: list[float] = []
    done = asyncio.Event()

    async def beat() -> None:
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - started - 0.005)

    beating = asyncio.create_task(beat())
    await asyncio.sleep(0.01)
    try:
        result = await work
    finally:
        done.set()
        await beating  # its last wake-up, late if the work held the loop, is counted too
    return result, max(lags)


def run(work: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(work())


def test_enqueue_async_writes_what_enqueue_writes(journal_dir: Path) -> None:
    queue = Queue("emails", journal_dir)
    options: dict[str, Any] = {"job_timeout": 30, "description": "sum", "meta": {"a": 1}, "delay": 60}
    sync = queue.enqueue(tasks.add, 1, 2, idempotency_key="k1", **options)
    job = run(lambda: queue.enqueue_async(tasks.add, 1, 2, idempotency_key="k2", **options))
    first, second = jobs_in(journal_dir)
    assert second["id"] == job.id != sync.id
    assert (job.idempotency_key, job.queue, job.get_status()) == ("k2", "emails", "accepted")
    for rec in (first, second):
        del rec["id"], rec["key"], rec["created_at"], rec["run_at"]
    assert first == second


def test_enqueue_many_async_is_one_batch_and_returns_jobs_in_order(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    envelopes = [queue.prepare(tasks.add, (i, i)) for i in range(50)]
    jobs = run(lambda: queue.enqueue_many_async(envelopes))
    assert [j.id for j in jobs] == [e.id for e in envelopes] == [r["id"] for r in jobs_in(journal_dir)]
    assert run(lambda: queue.enqueue_many_async([])) == []


def test_enqueue_many_of_nothing_returns_no_jobs(journal_dir: Path) -> None:
    # It raised IndexError (ids[-1] of an empty batch).
    assert Queue(journal=journal_dir).enqueue_many([]) == []


def test_enqueue_async_returns_only_once_an_fsync_covers_the_record(journal_dir: Path) -> None:
    ops = SlowFsync(delay=0.1)
    queue = slow_queue(journal_dir, ops)

    async def enqueue() -> list[tuple[int, int]]:
        seen = []
        for i in range(3):
            await queue.enqueue_async(tasks.add, i, i)
            seen.append((ops.written, ops.durable))  # at the moment the call returned
        return seen

    for written, durable in run(enqueue):
        assert durable == written > 0


def test_twenty_coroutines_share_fsyncs_and_the_loop_keeps_running_while_one_is_slow(
    journal_dir: Path, figures: Callable[[str], None]
) -> None:
    ops = SlowFsync()
    queue = slow_queue(journal_dir, ops)

    async def twenty() -> list[Any]:
        return await asyncio.gather(*(queue.enqueue_async(tasks.add, i, i) for i in range(20)))

    started = time.perf_counter()
    jobs, lag = run(lambda: max_lag(twenty()))
    seconds = time.perf_counter() - started
    figures(
        f"enqueue_async 20 coroutines, fsync {FSYNC_S}s: max loop lag {lag * 1000:.1f} ms, fsyncs {ops.fdatasyncs}"
    )
    assert len({j.id for j in jobs}) == 20 == len(jobs_in(journal_dir))
    assert seconds >= FSYNC_S  # the fsync was slow, and they waited for it
    assert lag < 0.1  # the loop was not: a heartbeat every 5 ms kept running
    assert ops.fdatasyncs <= 2  # the first coroutine's commit, then all the others' together


def test_the_lag_test_catches_a_blocking_enqueue(journal_dir: Path, figures: Callable[[str], None]) -> None:
    # The measurement above can fail: the sync enqueue called in a coroutine holds the loop for
    # the whole fsync (issue 17: up to 137 ms under 20 requests).
    queue = slow_queue(journal_dir, SlowFsync())

    async def blocking() -> None:
        queue.enqueue(tasks.add, 1, 1)

    _, lag = run(lambda: max_lag(blocking()))
    figures(f"sync enqueue in a coroutine, fsync {FSYNC_S}s: max loop lag {lag * 1000:.1f} ms")
    assert lag >= FSYNC_S * 0.9


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda q: q.enqueue_async(lambda: None), EnvelopeError),
        (lambda q: q.enqueue_async(tasks.add, 1j), NotSerializable),  # a set is a tagged value now
        (lambda q: q.enqueue_async(tasks.add, 1, on_success="x"), EnvelopeError),
        (lambda q: q.enqueue_async(tasks.add, 1, job_id="no spaces"), EnvelopeError),
        (lambda q: q.enqueue_async(tasks.add, 1, job_timeout=-1), EnvelopeError),
        (lambda q: q.enqueue_async(tasks.add, "x" * (1 << 20)), RecordTooLarge),
        (lambda q: q.enqueue_many_async(["not an envelope"]), TypeError),
    ],
    ids=["lambda", "complex", "rq-option", "job-id", "timeout", "too-large", "not-envelope"],
)
def test_bad_input_raises_before_anything_is_written(
    journal_dir: Path, call: Callable[[Queue], Coroutine[Any, Any, Any]], error: type[Exception]
) -> None:
    queue = Queue(journal=journal_dir)
    with pytest.raises(error):
        run(lambda: call(queue))
    assert jobs_in(journal_dir) == []
    assert not queue._committers  # refused on the loop, before any commit was started


def test_a_full_queue_refuses_the_async_call_alone(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir, capacity=3)

    async def two_calls() -> list[Any]:
        calls = [
            queue.enqueue_many_async([queue.prepare(tasks.add, (c, i)) for i in range(2)]) for c in range(2)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    accepted, refused = sorted(run(two_calls), key=lambda o: isinstance(o, BaseException))
    assert isinstance(refused, QueueFull)
    assert [j.id for j in accepted] == [r["id"] for r in jobs_in(journal_dir)]


def test_a_failed_fsync_fails_every_call_of_its_commit_each_naming_its_own_jobs(journal_dir: Path) -> None:
    ops = SlowFsync(delay=0.0, fail_at=1)
    queue = slow_queue(journal_dir, ops)

    async def three() -> list[Any]:
        calls = [queue.enqueue_async(tasks.add, i, i, idempotency_key=f"k{i}") for i in range(3)]
        return await asyncio.gather(*calls, return_exceptions=True)

    failed = run(three)
    assert ops.fdatasyncs == 1  # one commit for the three calls
    assert [type(e) for e in failed] == [JournalIOError] * 3
    assert [e.idempotency_keys for e in failed] == [("k0",), ("k1",), ("k2",)]
    assert all(len(e.job_ids) == 1 and e.job_ids[0] in str(e) for e in failed)
    assert len({e.job_ids for e in failed}) == 3


def test_a_call_cancelled_before_its_commit_writes_nothing(journal_dir: Path) -> None:
    ops = SlowFsync(delay=0.2)
    queue = slow_queue(journal_dir, ops)

    async def cancel_the_second() -> str:
        first = asyncio.create_task(queue.enqueue_async(tasks.add, 1, 1))
        await asyncio.sleep(0.05)  # its commit is waiting for the slow fsync
        second = asyncio.create_task(queue.enqueue_async(tasks.add, 2, 2))
        await asyncio.sleep(0.01)  # queued behind it
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        return (await first).id

    first_id = run(cancel_the_second)
    assert [r["id"] for r in jobs_in(journal_dir)] == [first_id]


def test_one_queue_serves_one_event_loop_after_another(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(3):
        run(lambda i=i: queue.enqueue_async(tasks.add, i, i))
    assert len(jobs_in(journal_dir)) == 3


def test_coroutines_and_threads_share_one_journal(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    threads = [
        threading.Thread(target=lambda: [queue.enqueue(tasks.add, 0, i) for i in range(20)]) for _ in range(4)
    ]

    async def coroutines() -> None:
        async def one(c: int) -> None:
            for i in range(20):
                await queue.enqueue_async(tasks.add, c, i)

        await asyncio.gather(*(one(c) for c in range(1, 5)))

    for t in threads:
        t.start()
    run(coroutines)
    for t in threads:
        t.join()
    assert len({r["id"] for r in jobs_in(journal_dir)}) == 160


def test_without_a_journal_enqueue_async_raises_config_error_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYBRIDQ_JOURNAL", raising=False)
    queue = Queue("default")
    with pytest.raises(ConfigError, match="HYBRIDQ_JOURNAL"):
        run(lambda: queue.enqueue_async(tasks.add, 1, 2))
    assert list(tmp_path.iterdir()) == []
    assert not queue._committers


def test_hybridq_testing_takes_enqueue_async_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridq.testing import eager

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYBRIDQ_JOURNAL", raising=False)
    queue = Queue("default")
    with eager() as local:
        job = run(lambda: queue.enqueue_async(tasks.add, 1, 2))
    assert [(j.id, j.status, j.result) for j in local.jobs] == [(job.id, "finished", 3)]
    assert list(tmp_path.iterdir()) == []


def test_a_call_cancelled_before_its_commit_started_writes_nothing(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)

    async def cancel_at_once() -> None:
        call = asyncio.create_task(queue.enqueue_async(tasks.add, 1, 1))
        await asyncio.sleep(0)  # it has submitted; the commit is due after the ready callbacks
        call.cancel()  # its future is cancelled now, its coroutine sees it after the commit started
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.2)

    run(cancel_at_once)
    assert jobs_in(journal_dir) == []
