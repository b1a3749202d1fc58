"""Outcomes, retries, redelivery and compaction, against the in-memory transport.

The simulated worker of :class:`MemoryTransport` follows the worker's idempotency rules; these
tests check the forwarder's side: what reaches the ledger, what is delivered again, what is
never run twice, and which segments may go.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hybridq import Job, Queue, Retry, failed_jobs, requeue
from hybridq.envelope.model import Envelope
from hybridq.errors import HybridqError, QueueFull, RedisFull
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.reader import list_chains, read_record_at
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index
from hybridq.ops.status import collect_status
from hybridq.transport import MemoryTransport
from hybridq.transport.base import Delivery, PushResult

from tests import tasks


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_forwarder(journal: Path, transport: MemoryTransport, **kwargs: object) -> Forwarder:
    kwargs.setdefault("backoff_initial_s", 0.001)
    kwargs.setdefault("backoff_max_s", 0.002)
    kwargs.setdefault("reconcile_interval_s", 0.0)
    kwargs.setdefault("lease_s", 0.0)  # reconcile jobs however recently they were forwarded
    forwarder = Forwarder(journal, transport, **kwargs)  # type: ignore[arg-type]
    forwarder.open()
    return forwarder


def settle(forwarder: Forwarder, steps: int = 5) -> None:
    """Step until a reconcile pass has run to its end (it advances one batch per step)."""
    assert forwarder.completions is not None
    for _ in range(steps):
        forwarder.completions.hurry()
        forwarder.step()


def status(journal: Path) -> dict[str, int]:
    out = collect_status(str(journal))
    return {k: out[k] for k in ("accepted", "succeeded", "failed", "pending", "duplicates_suppressed")}


def test_outcomes_reach_the_ledger_and_status_counts_them(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(20):
        queue.enqueue(tasks.add, i, i)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert transport.work() == 20
    forwarder.step()
    forwarder.close()
    assert transport.events == {forwarder.checkpoint.owner: []}  # acknowledged after the ledger
    assert status(journal_dir) == {
        "accepted": 20,
        "succeeded": 20,
        "failed": 0,
        "pending": 0,
        "duplicates_suppressed": 0,
    }


def test_a_flushed_redis_does_not_rerun_finished_jobs_but_redelivers_the_rest(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(10)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(limit=4)
    forwarder.step()  # harvested: 4 jobs are durably terminal
    transport.forget()  # FLUSHALL: results, events, queues, the epoch: all gone
    settle(forwarder)
    assert sorted(transport.queues["default"]) == sorted(j.id for j in jobs[4:])
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert all(transport.executions.get(j.id, 0) == 1 for j in jobs)
    assert status(journal_dir)["succeeded"] == 10


def test_a_job_whose_worker_died_is_delivered_again_with_the_next_attempt(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.take("default")
    assert delivery is not None
    transport.kill(delivery)  # the lease is gone, no outcome
    settle(forwarder)
    again = transport.deliveries[job.id]
    assert again.attempt == 2
    assert transport.queues["default"] == [job.id]
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert status(journal_dir)["succeeded"] == 1


def test_a_job_that_keeps_killing_its_worker_fails_for_good(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, max_lost=3)
    forwarder.step()
    for _ in range(3):
        delivery = transport.take("default")
        assert delivery is not None
        transport.kill(delivery)
        settle(forwarder)
    forwarder.close()
    assert transport.queues["default"] == []
    [failed] = failed_jobs(str(journal_dir))
    assert failed.id == job.id
    assert "vanished 3 times" in (failed.error or "")


def test_retries_follow_the_durable_schedule_and_survive_a_redis_restart(journal_dir: Path) -> None:
    clock = Clock()
    job = Queue(journal=journal_dir).enqueue(
        tasks.add, 1, 2, retry=Retry(max_attempts=3, backoff_s=10, jitter=False)
    )
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    forwarder.step()
    attempts: list[int] = []

    def flaky(env: Envelope, attempt: int) -> None:
        attempts.append(attempt)
        if attempt < 3:
            raise RuntimeError(f"attempt {attempt} fails")

    transport.work(func=flaky)
    settle(forwarder)
    assert transport.queues["default"] == []  # not due for 10 s
    forwarder.close()
    transport.forget()  # Redis restarts empty, the forwarder too: the schedule is in the ledger
    clock.now += 10
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    settle(forwarder)
    assert transport.deliveries[job.id].attempt == 2
    transport.work(func=flaky)
    settle(forwarder)
    clock.now += 20  # the second delay doubles
    settle(forwarder)
    transport.work(func=flaky)
    settle(forwarder)
    forwarder.close()
    assert attempts == [1, 2, 3]
    assert status(journal_dir)["succeeded"] == 1


def test_a_job_out_of_attempts_is_listed_and_can_be_requeued(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2, retry=Retry(max_attempts=2, backoff_s=0))
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()

    def boom(env: Envelope, attempt: int) -> None:
        raise ValueError("boom")

    for _ in range(2):
        transport.work(func=boom)
        settle(forwarder)
    [failed] = failed_jobs(str(journal_dir))
    assert (failed.id, failed.attempts, failed.error) == (job.id, 2, "ValueError: boom")
    assert status(journal_dir)["failed"] == 1
    with pytest.raises(HybridqError, match="not a failed job"):
        requeue(["nope", job.id], str(journal_dir))
    [again] = requeue([job.id], str(journal_dir))
    assert again.id == job.id
    assert failed_jobs(str(journal_dir)) == []
    settle(forwarder)
    assert transport.queues["default"] == [job.id]
    transport.work()
    settle(forwarder)
    forwarder.close()
    counts = status(journal_dir)
    assert (counts["accepted"], counts["succeeded"], counts["failed"], counts["pending"]) == (2, 1, 1, 0)


def test_one_idempotency_key_runs_once_and_both_jobs_report_it(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key="order-7")
    second = queue.enqueue(tasks.add, 1, 2, idempotency_key="order-7")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {first.id: 1}
    assert second.id not in transport.executions
    assert status(journal_dir) == {
        "accepted": 2,
        "succeeded": 2,
        "failed": 0,
        "pending": 0,
        "duplicates_suppressed": 1,
    }


def test_ledger_replay_order_does_not_matter() -> None:
    loc = ("w", 0, 64)
    entries = [
        Entry("retry", "j", loc, attempt=1, run_at=5.0),
        Entry("lost", "j", loc, attempt=2),
        Entry("done", "j", loc, outcome="succeeded", attempt=3),
        Entry("done", "j", loc, outcome="succeeded", attempt=3, dup=True, event_id="e1"),
        Entry("done", "j", loc, outcome="succeeded", attempt=3, dup=True, event_id="e1"),
    ]
    forward, backward = LedgerIndex(), LedgerIndex()
    for e in entries:
        forward.apply(e)
    for e in reversed(entries):
        backward.apply(e)
    for index in (forward, backward):
        assert index.is_terminal(loc)
        assert index.retries == {}
        assert index.dups == {("w", 0): 1}  # a replayed event is counted once


def fail_zero(env: Envelope, attempt: int) -> None:
    """The simulated task: fails for good on the job whose first argument is 0."""
    if env.args[0] == 0:
        raise ValueError("zero")


def write_jobs(journal: Path, n: int, *, segment_bytes: int = 4096) -> None:
    """``n`` jobs through a writer with tiny segments (so there is something to compact)."""
    queue = Queue(journal=journal)
    with JournalWriter(journal, max_segment_bytes=segment_bytes) as writer:
        for start in range(0, n, 10):  # a batch never spans segments: write small ones
            writer.append_many(
                queue.prepare(tasks.add, (i, i)).to_bytes() for i in range(start, min(n, start + 10))
            )


def test_compaction_deletes_finished_segments_and_keeps_the_counts(journal_dir: Path) -> None:
    write_jobs(journal_dir, 400)
    before = sum(len(i) for i in list_chains(str(journal_dir)).values())
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(limit=200)
    settle(forwarder)
    settle(forwarder)
    middle = sum(len(i) for i in list_chains(str(journal_dir)).values())
    assert 0 < middle < before  # only the segments whose every job finished
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert list_chains(str(journal_dir)) == {}  # a closed writer's chain is sealed: all gone
    assert status(journal_dir) == {
        "accepted": 400,
        "succeeded": 400,
        "failed": 0,
        "pending": 0,
        "duplicates_suppressed": 0,
    }
    assert load_compacted(str(journal_dir)).accepted == 400
    assert load_index(str(journal_dir), load_compacted(str(journal_dir))).terminal == {}


def test_compaction_keeps_a_segment_with_one_unfinished_job(journal_dir: Path) -> None:
    write_jobs(journal_dir, 100)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    first = transport.take("default")
    assert first is not None  # taken, never finished: its segment must stay
    transport.work()
    settle(forwarder)
    forwarder.close()
    [indices] = list_chains(str(journal_dir)).values()
    assert indices[0] == first.loc[1]
    assert os.path.exists(journal_dir)


def test_job_status_follows_the_ledger(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    good = queue.enqueue(tasks.add, 1, 2)
    bad = queue.enqueue(tasks.add, "x", 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert (good.get_status(), bad.get_status()) == ("forwarded", "forwarded")

    def run(env: Envelope, attempt: int) -> int:
        return int(env.args[0]) + int(env.args[1])

    transport.work(func=run)
    forwarder.step()
    forwarder.close()
    assert (good.get_status(), bad.get_status()) == ("finished", "failed")


def test_capacity_frees_up_as_jobs_finish(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir, capacity=5)
    for i in range(5):
        queue.enqueue(tasks.add, i, i)
    with pytest.raises(QueueFull):
        queue.enqueue(tasks.add, 9, 9)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(limit=3)
    forwarder.step()  # harvests, and publishes the terminal count in the checkpoint
    forwarder.close()
    assert queue._appender is not None
    assert queue._appender.pending is not None
    queue._appender.pending._refreshed = -1e9  # as if refresh_s had passed
    for i in range(3):
        queue.enqueue(tasks.add, i, i)
    with pytest.raises(QueueFull):
        queue.enqueue(tasks.add, 9, 9)


def test_record_ids_locate_their_records(journal_dir: Path) -> None:
    payloads = [b"a" * n for n in (1, 50, 7)]
    with JournalWriter(journal_dir) as writer:
        ids = [writer.append(b"first"), *writer.append_many(payloads)]
    for rid, payload in zip(ids, [b"first", *payloads], strict=True):
        assert read_record_at(str(journal_dir), rid.writer_id, rid.segment, rid.offset).payload == payload


def test_a_failure_stays_listed_and_requeueable_after_its_segments_are_compacted(journal_dir: Path) -> None:
    write_jobs(journal_dir, 100)

    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=fail_zero)
    settle(forwarder)
    forwarder.close()
    forwarder = make_forwarder(journal_dir, transport)  # a new run: compacts the old ledger chain
    settle(forwarder)
    assert list_chains(str(journal_dir)) == {}
    ledger_chains = list_chains(str(journal_dir / "ledger"))
    assert list(ledger_chains) == [forwarder.completions._writer.writer_id]  # type: ignore[union-attr]
    [failed] = failed_jobs(str(journal_dir))
    assert failed.error == "ValueError: zero"
    # The forwarder's own list (rows of ledger-keys.sqlite) keeps it too, across a restart.
    assert [e.job_id for e in forwarder.state.index.failed.values()] == [failed.id]
    forwarder.close()
    forwarder = make_forwarder(journal_dir, transport)
    assert [e.job_id for e in forwarder.state.index.failed.values()] == [failed.id]
    [job] = requeue([failed.id], str(journal_dir))
    settle(forwarder)
    transport.work()
    settle(forwarder)
    assert len(forwarder.state.index.failed) == 0
    forwarder.close()
    assert failed_jobs(str(journal_dir)) == []
    counts = status(journal_dir)
    assert (counts["accepted"], counts["succeeded"], counts["failed"], counts["pending"]) == (101, 100, 1, 0)
    assert job.get_status() == "finished"


def test_a_lost_checkpoint_does_not_push_finished_jobs_again(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(10)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(limit=6)
    settle(forwarder)
    forwarder.close()
    (journal_dir / "forwarder.state").unlink()  # an operator "resets" the forwarder
    transport.forget()
    forwarder = make_forwarder(journal_dir, transport)
    settle(forwarder)
    forwarder.close()
    assert sorted(transport.queues["default"]) == sorted(j.id for j in jobs[6:])


def test_a_finished_job_whose_event_was_lost_is_recorded_without_running_again(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    assert forwarder.completions is not None
    forwarder.completions.done_grace_s = 0.0
    forwarder.step()
    transport.work()
    transport.events.clear()  # the completion stream was evicted: the outcome is stored, no event
    settle(forwarder)  # seen "done" twice: delivered again
    assert transport.queues["default"] == [job.id]
    transport.work()  # finds the stored outcome: a suppressed duplicate, not a second run
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {job.id: 1}
    counts = status(journal_dir)
    assert (counts["succeeded"], counts["pending"], counts["duplicates_suppressed"]) == (1, 0, 1)


def test_a_retry_whose_event_was_lost_still_happens(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2, retry=Retry(max_attempts=2, backoff_s=0))
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    assert forwarder.completions is not None
    forwarder.completions.done_grace_s = 0.0
    forwarder.step()
    attempts: list[int] = []

    def fail_first(env: Envelope, attempt: int) -> None:
        attempts.append(attempt)
        if attempt == 1:
            raise RuntimeError("first")

    transport.work(func=fail_first)
    transport.events.clear()  # attempt 1's failure is stored, its event is lost
    settle(forwarder)  # "done" twice: attempt 1 delivered again, found stale, reported again
    transport.work(func=fail_first)
    settle(forwarder)  # now the forwarder knows: attempt 2 is due
    transport.work(func=fail_first)
    settle(forwarder)
    forwarder.close()
    assert attempts == [1, 2]
    assert job.get_status() == "finished"


def test_a_success_beats_a_failure_in_any_order() -> None:
    loc = ("w", 0, 64)
    failed = Entry("done", "j", loc, outcome="failed", attempt=5, error="worker vanished")
    succeeded = Entry("done", "j", loc, outcome="succeeded", attempt=5)
    for order in ([failed, succeeded], [succeeded, failed]):
        index = LedgerIndex()
        for entry in order:
            index.apply(entry)
        assert index.terminal == {("w", 0): {64: "succeeded"}}
        assert index.failed == {}
        assert index.terminal_count == 1


def test_a_failed_job_still_says_failed_after_its_segment_is_compacted(journal_dir: Path) -> None:
    write_jobs(journal_dir, 30)

    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    first = transport.deliveries[transport.queues["default"][0]]
    transport.work(func=fail_zero)
    settle(forwarder)
    forwarder.close()
    assert list_chains(str(journal_dir)) == {}
    from hybridq.job import Job
    from hybridq.journal.writer import RecordId

    job = Job(first.envelope, RecordId(first.loc[0], 1, first.loc[1], first.loc[2]), str(journal_dir))
    assert job.get_status() == "failed"


def test_compaction_forgets_chains_that_are_gone(journal_dir: Path) -> None:
    write_jobs(journal_dir, 50)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert list_chains(str(journal_dir)) == {}
    assert forwarder.checkpoint.positions == {}
    assert load_compacted(str(journal_dir)).through == {}
    assert status(journal_dir)["succeeded"] == 50


def test_consistent_reads_again_when_a_compaction_got_in_the_way(journal_dir: Path) -> None:
    from hybridq.ledger.compacted import Compacted, consistent, save_compacted

    journal_dir.mkdir(mode=0o700)
    save_compacted(str(journal_dir), Compacted())
    calls: list[int] = []

    def read(compacted: Compacted) -> int:
        calls.append(compacted.accepted)
        if len(calls) == 1:
            save_compacted(str(journal_dir), Compacted(accepted=10))  # the forwarder compacts...
            raise FileNotFoundError("segment gone")  # ...under this reader's feet
        return compacted.accepted

    assert consistent(str(journal_dir), read) == 10
    assert calls == [0, 10]


def test_without_nudges_the_forwarder_polls_instead_of_spinning(journal_dir: Path) -> None:
    import threading
    import time

    forwarder = make_forwarder(journal_dir, MemoryTransport(), idle_timeout_s=0.2)
    assert forwarder.waits.listener is not None
    forwarder.waits.listener.close()
    forwarder.waits.listener = None  # as when another process holds the nudge socket's name
    steps = 0
    original = forwarder.step

    def counted() -> int:
        nonlocal steps
        steps += 1
        return original()

    forwarder.step = counted  # type: ignore[method-assign]
    runner = threading.Thread(target=forwarder.run)
    runner.start()
    time.sleep(1.0)
    forwarder.stop()
    runner.join(timeout=5)
    forwarder.close()
    assert not runner.is_alive()
    assert steps <= 10  # about one per idle timeout (0.2 s), not thousands


def test_a_job_whose_worker_died_before_starting_it_keeps_its_attempt(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.take("default")
    assert delivery is not None
    transport.kill(delivery, started=False)  # dequeued, then the worker died: the task never ran
    settle(forwarder)
    assert transport.queues["default"] == [job.id]
    assert transport.deliveries[job.id].attempt == 1  # no attempt was used
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert status(journal_dir)["succeeded"] == 1


def test_status_reports_pending_per_queue_and_ages(journal_dir: Path) -> None:
    a = Queue("a", journal=journal_dir)
    b = Queue("b", journal=journal_dir)
    a.enqueue_many([a.prepare(tasks.add, (i, i)) for i in range(3)])
    b.enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work("a", limit=1)
    forwarder.step()
    forwarder.close()
    late = b.enqueue(tasks.add, 2, 2)  # accepted after the forwarder stopped: not forwarded
    out = collect_status(str(journal_dir))
    assert out["queues"] == {"a": 2, "b": 2}
    assert out["not_yet_forwarded"] == 1
    assert 0 <= out["forwarding_lag_s"] <= out["oldest_pending_age_s"] < 60
    assert late.get_status() == "accepted"


def test_redis_back_from_an_older_snapshot_runs_no_finished_job_again(journal_dir: Path) -> None:
    """S16 with the in-memory transport: queue entries restored from a snapshot are fenced."""
    queue = Queue(journal=journal_dir)
    done = [queue.enqueue(tasks.add, i, i) for i in range(8)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    later = [queue.enqueue(tasks.add, i, i) for i in range(2)]
    forwarder.step()
    snapshot = transport.snapshot()  # all 10 queued
    assert transport.work(limit=8) == 8
    forwarder.step()
    assert status(journal_dir)["succeeded"] == 8

    transport.restore(snapshot)
    # Before the forwarder has looked: the restart (a run id not the epoch's) fences every claim.
    assert transport.work(limit=3) == 3
    assert transport.executions == {job.id: 1 for job in done}
    forwarder.maintenance.check_epoch()  # what the forwarder does once a second: a new generation
    assert forwarder.checkpoint.generation == 1
    settle(forwarder)  # the refill purges finished copies, requeues the rest
    assert forwarder.completions is not None
    assert forwarder.completions.purged >= 5  # the finished copies still queued
    transport.work()
    settle(forwarder)
    assert transport.executions == {job.id: 1 for job in done + later}
    assert status(journal_dir)["succeeded"] == 10

    # A stale copy that escaped the purge is refused by the generation alone.
    stale = snapshot["deliveries"][done[0].id]
    transport.run(stale)
    assert transport.executions[done[0].id] == 1
    forwarder.close()


def test_events_for_finished_jobs_are_counted_and_logged(
    journal_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.deliveries[job.id]
    transport.work()
    forwarder.step()
    assert forwarder.completions is not None
    assert forwarder.completions.late_events == 0
    transport.results.clear()  # the job runs again: its outcome lands on a terminal job
    transport.run(delivery)
    forwarder.step()
    assert forwarder.completions.late_events == 1
    assert "holds as finished" in caplog.text
    forwarder.close()


@pytest.mark.parametrize(
    ("entry", "raw"),
    [
        (
            Entry("done", "j1", ("w", 1, 2), outcome="succeeded", at=1.5, queue="q", event_id="1-0"),
            b'{"t":"done","id":"j1","loc":["w",1,2],"n":1,"o":"succeeded","q":"q","ev":"1-0","at":1.5}',
        ),
        (
            Entry(
                "retry", "j\u00e9", ("w", 0, 9), attempt=2, error="boom", run_at=7.0, dup=True, job={"a": [1]}
            ),
            (
                b'{"t":"retry","id":"j\\u00e9","loc":["w",0,9],"n":2,"err":"boom","run_at":7.0,"job":{"a":[1]},'
                b'"dup":true,"at":0.0}'
            ),
        ),
    ],
)
def test_ledger_entries_keep_their_encoding(entry: Entry, raw: bytes) -> None:
    """The bytes of a ledger record (what older versions read back), and the round trip."""
    assert entry.to_bytes() == raw
    assert Entry.from_bytes(raw) == entry


def test_a_refill_after_redis_lost_everything_does_not_idle_between_batches(journal_dir: Path) -> None:
    """The refill pass goes on at once: no idle wait (here 30 s) between its batches of 1,000."""
    import threading
    import time

    queue = Queue(journal=journal_dir)
    for start in range(0, 2500, 500):
        queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(start, start + 500)])
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, idle_timeout_s=30.0)
    forwarder.step()
    assert len(transport.queues["default"]) == 2500
    transport.forget()  # FLUSHALL: nothing left in Redis, no worker will send an event to wake it
    forwarder.maintenance.next_epoch_check = 0.0
    thread = threading.Thread(target=forwarder.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10.0
        while len(transport.queues.get("default", [])) < 2500 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(transport.queues.get("default", [])) == 2500, "the refill idled between batches"
    finally:
        forwarder.stop()
        thread.join(timeout=40)
        forwarder.close()


def test_a_retry_already_pushed_does_not_keep_the_forwarder_awake(journal_dir: Path) -> None:
    """The idle wait counts only retries still to push: a pushed one waits for its worker.

    It spun at 20 Hz (a 50 ms wait, two scans of every retry a turn) while any pushed retry was
    outstanding, the usual state with RetryLater (found in review).
    """
    clock = Clock()
    Queue(journal=journal_dir).enqueue(
        tasks.add, 1, 2, retry=Retry(max_attempts=3, backoff_s=10, jitter=False)
    )
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, clock=clock, idle_timeout_s=7.0)

    def boom(env: Envelope, attempt: int) -> None:
        raise RuntimeError("boom")

    waits: list[float] = []
    forwarder._sleep = waits.append  # type: ignore[method-assign]
    if forwarder.waits.listener is not None:
        forwarder.waits.listener.wait = waits.append  # type: ignore[method-assign]
    try:
        forwarder.step()
        transport.work(func=boom)
        settle(forwarder)
        forwarder._wait()
        assert waits[-1] == 7.0  # the retry is due in 10 s: the idle timeout comes first
        clock.now += 10
        settle(forwarder)  # the retry is pushed; nothing left to do until its worker reports
        assert transport.queues["default"]
        forwarder._wait()
        assert waits[-1] == 7.0
    finally:
        forwarder.close()


class FullTransport(MemoryTransport):
    """Redis at its maxmemory: every push is refused with OOM while ``full``."""

    full = False

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        if self.full:
            raise RedisFull("OOM command not allowed when used memory > 'maxmemory'.")
        return super().push(jobs)


def vanished_while_full(journal_dir: Path, **options: Any) -> tuple[Job, FullTransport, Forwarder]:
    """A job whose worker vanished; its `lost` entry written, its next attempt refused (OOM)."""
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2, **options)
    transport = FullTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.take("default")
    assert delivery is not None
    transport.kill(delivery)
    transport.full = True
    settle(forwarder, steps=12)
    return job, transport, forwarder


def test_a_vanish_whose_next_attempt_redis_refused_is_counted_once(journal_dir: Path) -> None:
    # The `lost` entry is written, then Redis refuses the next attempt (OOM): that delivery is
    # pushed again before the pass moves on, not dropped, and the next passes (which find the
    # job orphaned still) do not count another vanish each: five would fail a job that ran once.
    job, transport, forwarder = vanished_while_full(journal_dir)
    assert failed_jobs(str(journal_dir)) == []
    transport.full = False
    settle(forwarder)
    assert transport.deliveries[job.id].attempt == 2
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert status(journal_dir)["succeeded"] == 1


def test_the_attempt_a_restarted_forwarder_pushes_for_an_earlier_vanish_is_counted_on_its_key(
    journal_dir: Path,
) -> None:
    # The `lost` entry is written, Redis refuses the next attempt (OOM), and the forwarder
    # stops: its successor pushes that attempt as "the same vanish", a new copy on its limit
    # key's queued count, which the key gate must be told of.
    job, transport, forwarder = vanished_while_full(journal_dir, limit_key="k")
    forwarder.close()
    transport.full = False
    forwarder = make_forwarder(journal_dir, transport)
    counted: list[str] = []
    forwarder.completions.reconciler.sent = lambda ds: counted.extend(d.envelope.id for d in ds)
    settle(forwarder)
    assert transport.deliveries[job.id].attempt == 2
    assert counted == [job.id], "the next attempt's copy was not counted"
    forwarder.close()
