"""Issue 29: a producer's delayed jobs go to a chain of their own, so they pin no other segment.

A journal segment is deleted only once every job in it is finished, oldest first in each chain
(docs/reliability.md rule 8). A job delayed by an hour written among immediate ones used to keep
every later segment of its producer's chain for that hour (on main, the first test fails: the
main chain's sealed segments stay).
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from hybridq import JournalIOError, Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import Durability, JournalReader, JournalWriter, RecordId
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import RecordType
from hybridq.journal.reader import list_chains
from hybridq.ops.status import collect_status
from hybridq.producer import commit, writers
from hybridq.producer.calls import encode_envelopes
from hybridq.transport import MemoryTransport

from tests import tasks

SMALL_SEGMENTS = 64 << 10


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's main writers seal a segment past 64 KB (so 5,000 jobs fill many)."""
    monkeypatch.setattr(writers, "DEFAULT_MAX_SEGMENT_BYTES", SMALL_SEGMENTS)


def _drive(
    forwarder: Forwarder, transport: MemoryTransport, done: Callable[[], bool], timeout_s: float = 120.0
) -> None:
    completions = forwarder.completions
    assert completions is not None
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        forwarder.step()
        transport.work()
        completions.hurry(reconcile=False)
        completions.compactor.hurry()
        forwarder.step()


def test_a_job_delayed_an_hour_pins_none_of_the_immediate_jobs_segments(
    journal_dir: Path, small_segments: None
) -> None:
    queue = Queue(journal=journal_dir)
    jobs = []
    for start in range(0, 5_000, 100):
        jobs += queue.enqueue_many(queue.prepare(tasks.add, (i, i)) for i in range(start, start + 100))
        if start == 1_000:
            late = queue.enqueue(tasks.add, 0, 1, delay=3600)
    main_chain, delayed_chain = jobs[0].record.writer_id, late.record.writer_id
    assert main_chain != delayed_chain
    assert {job.record.writer_id for job in jobs} == {main_chain}
    assert len(list_chains(str(journal_dir))[main_chain]) > 10

    now = [time.time()]
    transport = MemoryTransport()
    forwarder = Forwarder(journal_dir, transport, reconcile_interval_s=3600.0, clock=lambda: now[0])
    forwarder.open()
    try:
        # Every immediate job runs; the main chain's sealed segments go (its open one stays).
        _drive(
            forwarder,
            transport,
            lambda: (
                collect_status(str(journal_dir))["pending"] == 1
                and len(list_chains(str(journal_dir))[main_chain]) == 1
            ),
        )
        chains = list_chains(str(journal_dir))
        assert chains[delayed_chain] == [0]
        assert late.id not in transport.executions

        now[0] += 3601.0  # the hour passed: it runs, once
        _drive(forwarder, transport, lambda: collect_status(str(journal_dir))["pending"] == 0)
        for _ in range(3):
            forwarder.step()
            transport.work()
    finally:
        forwarder.close()
    assert transport.executions[late.id] == 1
    assert sum(transport.executions.values()) == 5_001


def test_a_group_commit_mixing_delayed_and_immediate_calls_is_two_appends(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    near = time.time() + 30  # under DELAYED_CHAIN_S: the main chain

    async def main() -> list[list[object]]:
        calls = [
            queue.enqueue_many_async([queue.prepare(tasks.add, (i, 0), delay=3600 if i % 2 else None)])
            for i in range(20)
        ]
        mixed = queue.enqueue_many_async(
            [queue.prepare(tasks.add, (1, 1), delay=3600), queue.prepare(tasks.add, (2, 2))]
        )
        soon = queue.enqueue_many_async([queue.prepare(tasks.add, (3, 3), run_at=near)])
        return list(await asyncio.gather(*calls, mixed, soon))

    results = asyncio.run(main())
    chain_of = [{job.record.writer_id for job in jobs} for jobs in results]  # type: ignore[attr-defined]
    assert all(len(c) == 1 for c in chain_of)
    main_chain, delayed_chain = chain_of[0].pop(), chain_of[1].pop()
    assert main_chain != delayed_chain
    assert [c.pop() for c in chain_of[2:20]] == [main_chain, delayed_chain] * 9
    assert chain_of[20] == {main_chain}  # a mixed call stays one append, in the main chain
    assert chain_of[21] == {main_chain}  # 30 s away is not delayed enough
    written = {r.writer_id for r in JournalReader(journal_dir).records()}
    assert written == {main_chain, delayed_chain}
    delayed_writer = writers.shared_writer(str(journal_dir), delayed=True)
    assert delayed_writer.writer_id == delayed_chain
    assert delayed_writer.max_segment_bytes == writers.DELAYED_SEGMENT_BYTES  # a trickle: small segments


class FailingFsync(FileOps):
    """Every fdatasync fails with EIO (a disk that lost the writes)."""

    def fdatasync(self, fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")


def test_a_failed_delayed_append_fails_its_own_calls_not_the_immediate_ones(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    assert queue._appender is not None
    failing = queue._appender._writers[1] = JournalWriter(str(journal_dir), fileops=FailingFsync())

    async def main() -> list[object]:
        calls = [
            queue.enqueue_many_async([queue.prepare(tasks.add, (i, 0), delay=3600 if i % 2 else None)])
            for i in range(10)
        ]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    try:
        results = asyncio.run(main())
    finally:
        failing.close()
    immediate, delayed = results[0::2], results[1::2]
    assert all(isinstance(jobs, list) and len(jobs) == 1 for jobs in immediate)
    assert all(isinstance(err, JournalIOError) for err in delayed)
    named = [err.job_ids for err in delayed]  # type: ignore[union-attr]
    assert all(len(ids) == 1 for ids in named)
    assert len({ids[0] for ids in named}) == 5  # each call's error names its own job


class Interrupted(BaseException):
    """Not an ``Exception``: what the group commit used to raise to every call of the group."""


class InterruptedWriter(JournalWriter):
    def append_many(self, payloads: Iterable[bytes], rtype: int = RecordType.DATA) -> list[RecordId]:
        raise Interrupted


def test_a_base_exception_on_the_delayed_append_leaves_the_durable_calls_their_jobs(
    journal_dir: Path,
) -> None:
    """The main chain's append was acknowledged first: its call is durable and gets its jobs;
    the exception is the delayed call's outcome only (it was raised to both before the fix)."""
    queue = Queue(journal=journal_dir)
    assert queue._appender is not None
    interrupted = queue._appender._writers[1] = InterruptedWriter(str(journal_dir))
    now = encode_envelopes([queue.prepare(tasks.add, (1, 1))])
    later = encode_envelopes([queue.prepare(tasks.add, (2, 2), delay=3600)])
    try:
        outcomes = queue._commit([now, later])
    finally:
        interrupted.close()
    jobs, error = outcomes
    assert isinstance(jobs, list)
    assert [job.id for job in jobs] == [now[0][0].id]
    assert isinstance(error, Interrupted)
    assert len(list(JournalReader(journal_dir).records())) == 1  # the immediate call's record


def test_a_forked_childs_delayed_chain_is_its_own(journal_dir: Path, tmp_path: Path) -> None:
    queue = Queue(journal=journal_dir)
    parent = (queue.enqueue(tasks.add, 1, 1), queue.enqueue(tasks.add, 2, 2, delay=3600))
    report = tmp_path / "child"
    pid = os.fork()
    if pid == 0:  # the child: write both chains, report their ids
        code = 1
        try:
            child = (queue.enqueue(tasks.add, 3, 3), queue.enqueue(tasks.add, 4, 4, delay=3600))
            report.write_text(" ".join(job.record.writer_id for job in child))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    child_chains = report.read_text().split()
    parent_chains = [job.record.writer_id for job in parent]
    assert len(set(child_chains + parent_chains)) == 4
    again = queue.enqueue(tasks.add, 5, 5, delay=3600)  # the parent goes on in its own
    assert again.record.writer_id == parent_chains[1]
    by_chain: dict[str, int] = {}
    for record in JournalReader(journal_dir).records():
        by_chain[record.writer_id] = by_chain.get(record.writer_id, 0) + 1
    assert by_chain == {parent_chains[0]: 1, parent_chains[1]: 2, child_chains[0]: 1, child_chains[1]: 1}


def test_a_delayed_writer_that_cannot_open_gives_its_calls_capacity_back(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening the delayed chain's writer is one more fd (EMFILE): each failed call's reservation
    used to stay taken, until the queue refused everything (fails before the fix)."""
    real = commit.shared_writer

    def failing(journal: str, durability: Durability, *, delayed: bool = False) -> JournalWriter:
        if delayed:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(journal, durability)

    monkeypatch.setattr(commit, "shared_writer", failing)
    queue = Queue(journal=journal_dir, capacity=5)
    for _ in range(5):
        with pytest.raises(OSError, match="Too many open files"):
            queue.enqueue(tasks.add, 1, 1, delay=3600)
    monkeypatch.setattr(commit, "shared_writer", real)
    assert queue.enqueue(tasks.add, 2, 2).get_status() == "accepted"  # QueueFull before
    assert queue.enqueue(tasks.add, 3, 3, delay=3600).get_status() == "accepted"
