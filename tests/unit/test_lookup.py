"""Jobs by id and their results (issue 17 item 1), against the in-memory transport.

``MemoryTransport.forget()`` is a Redis FLUSHALL. The simulated worker reports results as the
worker does (the completion event carries the return value), so these check the forwarder's
side: the ledger keeps the result, the lookup index finds a job from its id alone.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import JobFailed, JobWaitTimeout, Queue, ResultNotKept, Retry, fetch_job, requeue
from hybridq.envelope.model import Envelope
from hybridq.journal.reader import list_chains
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import open_ledger_writer, read_ledger
from hybridq.lookup.index import LookupIndex
from hybridq.lookup.reads import RETENTION_S
from hybridq.protocol import RESULT_MAX_BYTES, StartedEvent
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder, settle, write_jobs


def add(env: Envelope, _attempt: int) -> Any:
    """The simulated task: ``tasks.add`` on the job's arguments."""
    return tasks.add(*env.args)


def boom(_env: Envelope, _attempt: int) -> Any:
    raise ValueError("no such order")


def test_fetch_job_by_id_alone_follows_the_job_to_its_result(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 2, 3)
    # No forwarder ever ran: no index; the journal has it.
    found = fetch_job(job.id, journal=journal_dir)
    assert found is not None
    assert found.id == job.id
    assert found.envelope.args == (2, 3)
    assert (found.status, found.get_status(), found.result, found.attempt) == ("queued", "accepted", None, 0)
    assert fetch_job("no-such-job", journal=journal_dir) is None
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    found = queue.fetch_job(job.id)
    assert found is not None
    assert (found.status, found.get_status(), found.result) == ("forwarded", "forwarded", None)
    assert transport.work(func=add) == 1
    forwarder.step()
    assert (found.status, found.get_status(), found.result, found.attempt) == ("finished", "finished", 5, 1)
    assert found.exc_info is None
    assert found.ended_at is not None
    assert found.enqueued_at == job.envelope.created_at
    assert found.wait(timeout=0) == 5
    # Redis loses everything: the result is the ledger's.
    transport.forget()
    settle(forwarder)
    forwarder.close()
    again = hybridq.fetch_job(job.id, journal=str(journal_dir))
    assert again is not None
    assert (again.status, again.result) == ("finished", 5)
    assert [e.result for _, e in read_ledger(str(journal_dir)) if e.kind == "done"] == [5]


def test_a_lookup_does_not_read_the_ledger(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=add)
    forwarder.step()
    forwarder.close()

    def no_scan(*_: object) -> None:
        raise AssertionError("read the whole ledger")

    monkeypatch.setattr("hybridq.job_ledger.read_ledger", no_scan)
    monkeypatch.setattr("hybridq.job_ledger.load_index", no_scan)
    found = fetch_job(job.id, journal=journal_dir)
    assert found is not None
    assert (found.status, found.result, found.duplicate_of, found.wait(1.0)) == ("finished", 2, None, 2)


def test_a_wait_that_times_out_says_when_no_forwarder_holds_the_journal(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    for wait in (job.wait, lambda timeout: asyncio.run(job.wait_async(timeout=timeout))):
        with pytest.raises(JobWaitTimeout) as timed_out:
            wait(timeout=0.01)
        assert timed_out.value.unattended == job.journal
        assert str(timed_out.value) == (
            f"job {job.id} still queued after 0.01 s: it is in the journal {job.journal}, which no "
            f"forwarder holds (start `hybridq forward --journal {job.journal}`; docs/forwarder.md)"
        )
    forwarder = make_forwarder(journal_dir, MemoryTransport())  # holds the journal's forwarder lock
    forwarder.step()
    with pytest.raises(JobWaitTimeout) as timed_out:
        job.wait(timeout=0.01)
    forwarder.close()
    assert timed_out.value.unattended is None
    assert str(timed_out.value) == f"job {job.id} still forwarded after 0.01 s"


def test_failures_retries_and_wait(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 1, retry=Retry(max_attempts=2, backoff_s=0.0, jitter=False))
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=boom)
    forwarder.step()
    assert (job.status, job.get_status(), job.attempt) == ("retrying", "retrying", 1)
    assert job.exc_info == "ValueError: no such order"
    with pytest.raises(JobWaitTimeout) as timed_out:
        job.wait(timeout=0.05)
    assert (timed_out.value.job_id, timed_out.value.status) == (job.id, "retrying")
    assert isinstance(timed_out.value, TimeoutError)
    settle(forwarder)  # the retry is due: delivered
    transport.work(func=boom)
    forwarder.step()
    forwarder.close()
    assert (job.status, job.get_status(), job.attempt, job.result) == ("failed", "failed", 2, None)
    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=1.0)
    assert failed.value.exc_info == "ValueError: no such order"
    assert str(failed.value) == f"job {job.id} failed: ValueError: no such order"
    # Requeued: the id names the new record, which starts afresh.
    requeue([job.id], journal=str(journal_dir))
    again = fetch_job(job.id, journal=journal_dir)
    assert again is not None
    assert again.envelope.requeue == 1
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert (again.status, again.attempt, again.exc_info) == ("forwarded", 0, None)
    transport.work(func=add)
    forwarder.step()
    forwarder.close()
    found = fetch_job(job.id, journal=journal_dir)
    assert found is not None
    assert (found.status, found.result) == ("finished", 2)


def test_a_result_over_the_cap_is_not_kept_and_says_so(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    big, small = queue.enqueue(tasks.add, 1, 1), queue.enqueue(tasks.add, 2, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    huge = "x" * RESULT_MAX_BYTES  # its JSON has two quotes more
    transport.work(func=lambda env, _: huge if env.id == big.id else {"n": [1, 2]})
    forwarder.step()
    forwarder.close()
    assert small.result == {"n": [1, 2]}
    assert big.status == "finished"
    with pytest.raises(ResultNotKept) as not_kept:
        _ = big.result
    assert (not_kept.value.reason, not_kept.value.size) == ("too_large", RESULT_MAX_BYTES + 2)
    with pytest.raises(ResultNotKept):
        big.wait(1.0)


def test_an_event_from_an_older_worker_has_no_result(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=add)
    owner = forwarder.checkpoint.owner  # a worker of an earlier version sends no started event
    transport.events[owner] = [e for e in transport.events[owner] if not StartedEvent.is_one(e.body)]
    for event in transport.events[owner]:
        assert event.body is not None
        event.body.pop("result")  # what a worker of an earlier version sends
    forwarder.step()
    forwarder.close()
    assert job.status == "finished"
    with pytest.raises(ResultNotKept) as not_kept:
        _ = job.result
    assert not_kept.value.reason == "not_reported"
    # Another event of the job's success, with the result (a run whose success the outcome script
    # kept carries none; the run that stored it does): the index takes it.
    loc = (job.record.writer_id, job.record.segment, job.record.offset)
    with open_ledger_writer(str(journal_dir)) as ledger:
        ledger.append(
            Entry("done", job.id, loc, outcome="succeeded", at=1.0, result=2, result_kept=True).to_bytes()
        )
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    forwarder.close()
    assert job.result == 2


def test_a_suppressed_duplicate_reports_its_originals_result(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key="order-7")
    second = queue.enqueue(tasks.add, 1, 2, idempotency_key="order-7")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert second.status == "forwarded"
    transport.work(func=add)
    settle(forwarder)
    forwarder.close()
    found = fetch_job(second.id, journal=journal_dir)
    assert found is not None
    assert (found.duplicate_of, found.status, found.result, found.wait(1.0)) == (first.id, "finished", 3, 3)
    assert transport.executions == {first.id: 1}


def test_wait_async_does_not_block_the_loop(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 4, 4)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()

    async def main() -> tuple[Any, int]:
        ticks = 0

        async def finish_later() -> None:
            nonlocal ticks
            for _ in range(5):
                ticks += 1
                await asyncio.sleep(0.005)
            transport.work(func=add)
            forwarder.step()

        waiter = asyncio.ensure_future(job.wait_async(timeout=5.0))
        await finish_later()
        return await waiter, ticks

    assert asyncio.run(main()) == (8, 5)
    with pytest.raises(JobWaitTimeout):
        asyncio.run(queue.enqueue(tasks.add, 0, 0).wait_async(timeout=0.01))
    forwarder.close()


def test_the_index_is_rebuilt_from_the_journal_and_the_ledger(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(5)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=add)
    forwarder.step()
    forwarder.close()
    shutil.rmtree(journal_dir / "lookup")
    assert [j.status for j in jobs] == ["finished"] * 5  # no index: the slow path still answers
    (journal_dir / "lookup").mkdir()
    (journal_dir / "lookup" / "index.sqlite").write_bytes(b"not a database" * 100)
    monkeypatch.setattr("hybridq.lookup.index.BUILD_STEP", 2)  # a step reads two records
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert forwarder.lookup.building
    # Building: the ledger is read once the journal is; meanwhile the checkpoint's word.
    assert [j.status for j in jobs] == ["forwarded"] * 5
    for _ in range(3):
        forwarder.step()
    assert not forwarder.lookup.building
    forwarder.close()
    assert [json.dumps(fetch_job(j.id, journal=journal_dir).result) for j in jobs] == [  # type: ignore[union-attr]
        str(2 * i) for i in range(5)
    ]


def compacted_jobs(journal: Path, n: int) -> list[str]:
    """``n`` jobs of ``tasks.add`` that succeeded and whose journal segments were all compacted."""
    write_jobs(journal, n)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal, transport)
    forwarder.step()
    ids = sorted(transport.deliveries)
    transport.work(func=add)
    settle(forwarder)
    settle(forwarder)
    forwarder.close()
    assert list_chains(str(journal)) == {}  # every journal segment was compacted
    return ids


def test_a_job_is_found_after_compaction_for_the_retention_window(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hybridq.lookup.index.PRUNE_CHUNK", 7)  # the sweep takes several chunks
    ids = compacted_jobs(journal_dir, 40)
    found = fetch_job(ids[0], journal=journal_dir)
    assert found is not None
    assert (found.status, found.envelope.func, found.envelope.args) == ("finished", "tests.tasks.add", ())
    assert found.result in {2 * i for i in range(40)}  # its record is gone: the index keeps it
    assert found.ended_at is not None
    index = LookupIndex(str(journal_dir), clock=lambda: found.ended_at + RETENTION_S - 1)  # type: ignore[operator]
    index.open()
    assert index.prune(found.ended_at + RETENTION_S - 1) == 0  # type: ignore[operator]
    assert index.prune(found.ended_at + RETENTION_S + 1) == 40  # type: ignore[operator]
    index.close()
    assert fetch_job(ids[0], journal=journal_dir) is None


def test_a_duplicate_of_a_failed_job_fails_with_its_originals_error(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key="order-8")
    second = queue.enqueue(tasks.add, 1, 2, idempotency_key="order-8")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=boom)
    settle(forwarder)
    forwarder.close()
    assert (second.duplicate_of, second.status, second.get_status()) == (first.id, "failed", "failed")
    with pytest.raises(JobFailed) as failed:
        second.wait(1.0)
    assert failed.value.exc_info == "ValueError: no such order"


def test_the_completion_event_carries_a_success_result_up_to_the_cap() -> None:
    from hybridq.ledger.entries import parse_event
    from hybridq.protocol import CompletionEvent, Delivery

    envelope = Envelope("j1", "tests.tasks.add", "default", "j1", 1.0)
    d = Delivery(envelope, "owner1", ("w", 0, 64), 1)
    ok = {"outcome": "succeeded", "final": True, "attempt": 1, "result": {"n": [1, 2]}}
    event = CompletionEvent.of(d, ok, dup=False, at=2.0, started=1.5)
    body = event.to_json()
    assert (body["result"], body["started"]) == ({"n": [1, 2]}, 1.5)
    assert CompletionEvent.from_json(body) == event
    entry = parse_event("1-0", body, lambda: 3.0)
    assert (entry.result, entry.result_kept, entry.started) == ({"n": [1, 2]}, True, 1.5)
    assert Entry.from_bytes(entry.to_bytes()) == entry
    # None is a result too (kept), unlike no result at all (an older worker's event).
    none = CompletionEvent.of(d, {**ok, "result": None}, dup=False, at=2.0).to_json()
    assert "result" in none
    assert parse_event("1-0", none, lambda: 3.0).result_kept
    older = {k: v for k, v in none.items() if k != "result"}
    assert not parse_event("1-0", older, lambda: 3.0).result_kept
    # Over the cap: its size instead (the worker passes the JSON it made; else it is made here).
    text = '"' + "x" * RESULT_MAX_BYTES + '"'
    big = CompletionEvent.of(d, {**ok, "result": "x" * RESULT_MAX_BYTES}, dup=False, at=2.0, result_json=text)
    assert "result" not in big.to_json()
    assert big.to_json()["result_bytes"] == RESULT_MAX_BYTES + 2
    assert CompletionEvent.of(
        d, {**ok, "result": "é" * (RESULT_MAX_BYTES // 2)}, dup=False, at=2.0
    ).result_bytes
    # A failure carries none, and neither does the success the outcome script keeps from another run.
    failed = CompletionEvent.of(
        d, {"outcome": "failed", "final": True, "attempt": 1, "error": "E"}, dup=False, at=2.0
    )
    assert "result" not in failed.to_json()
    assert "result" not in event.kept_success_json()


def test_a_run_reported_after_a_settled_cancel_wins_in_the_index_as_in_the_ledger(tmp_path: Path) -> None:
    """The forwarder settled a cancel (no lease held) before it harvested the run's success.

    The ledger ranks succeeded > failed > cancelled in any order; the index kept the cancel: the
    job read ``cancelled`` for good and ``wait()`` raised JobFailed (found in review).
    """
    from hybridq.ledger.entries import Entry
    from hybridq.ledger.index import LedgerIndex
    from hybridq.lookup.index import LookupIndex
    from hybridq.lookup.store import _apply
    from hybridq.protocol import EntryKind

    journal = str(tmp_path / "j")
    job = Queue(journal=journal).enqueue("builtins.print", "x")
    index = LookupIndex(journal)
    index.open()
    try:
        index.catch_up()
        index.catch_up()
        loc = (job.record.writer_id, job.record.segment, job.record.offset)
        cancelled = Entry(EntryKind.DONE, job.id, loc, outcome="cancelled", at=1.0)
        succeeded = Entry(
            EntryKind.DONE,
            job.id,
            loc,
            outcome="succeeded",
            at=2.0,
            attempt=1,
            result={"v": 1},
            result_kept=True,
        )
        ledger = LedgerIndex()
        for entry in (cancelled, succeeded):
            ledger.apply(entry)
            with index._db:
                _apply(index._db, [entry])
        assert ledger.terminal[(loc[0], loc[1])][loc[2]] == "succeeded"
        fetched = hybridq.fetch_job(job.id, journal=journal)
        assert fetched is not None
        assert (fetched.status, fetched.result) == ("finished", {"v": 1})
    finally:
        index.close()
