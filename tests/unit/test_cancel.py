"""Cancellation (issue 17, item 6) against the in-memory transport, whose ``forget()`` is FLUSHALL.

A cancel is durable before it returns (a request file the forwarder takes into its ledger), a
queued or held job never runs, and the outcome ``cancelled`` lives in the ledger: Redis losing
its state does not bring the job back (docs/api.md, "Cancelling jobs").
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from hybridq import Queue, Retry, cancel, cancels, failed_jobs
from hybridq.cancels import cancel_dir
from hybridq.errors import RedisFull
from hybridq.journal import JournalWriter
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index
from hybridq.ops.status import collect_status
from hybridq.transport import MemoryTransport
from hybridq.transport.base import Delivery, Probe, PushResult

from tests import tasks
from tests.unit.test_completions import Clock, make_forwarder, settle


def states(results: list) -> list[str]:
    return [r.state for r in results]


def run_once(journal_dir: Path) -> MemoryTransport:
    """A forwarder's steps, the jobs run once, its steps again (the outcomes taken in), stopped."""
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    settle(forwarder)
    transport.work()
    settle(forwarder)
    forwarder.close()
    return transport


def test_a_queued_job_cancelled_before_the_forwarder_reads_it_never_runs(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    doomed = queue.enqueue(tasks.add, 1, 2)
    kept = queue.enqueue(tasks.add, 3, 4)
    assert doomed.cancel() == "requested"  # no forwarder running: the request waits on disk
    assert os.listdir(cancel_dir(str(journal_dir)))
    transport = run_once(journal_dir)
    assert doomed.id not in transport.deliveries
    assert transport.executions == {kept.id: 1}
    assert (doomed.get_status(), kept.get_status()) == ("cancelled", "finished")
    assert os.listdir(cancel_dir(str(journal_dir))) == []  # taken into the ledger
    status = collect_status(str(journal_dir))
    assert (status["pending"], status["cancelled"], status["failed"]) == (
        0,
        1,
        1,
    )  # failed: ended without success
    assert failed_jobs(str(journal_dir)) == []
    assert states(cancel([doomed.id], journal_dir)) == ["cancelled"]  # twice is fine


def test_a_pushed_job_is_taken_off_its_queue_and_a_worker_taking_it_anyway_runs_nothing(
    journal_dir: Path,
) -> None:
    queue = Queue(journal=journal_dir)
    taken, queued = queue.enqueue(tasks.add, 1, 2), queue.enqueue(tasks.add, 3, 4)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.take("default")  # a worker took the first, has not claimed it yet
    assert delivery is not None
    assert states(cancel([taken.id, queued.id], journal_dir)) == ["requested", "requested"]
    forwarder.step()
    assert transport.queues["default"] == []  # the queued one is off its queue
    transport.run(delivery)  # the claim finds the mark: nothing runs
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {}
    assert (taken.get_status(), queued.get_status()) == ("cancelled", "cancelled")


def test_a_held_job_never_runs(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    later = queue.enqueue(tasks.add, 1, 2, delay=dt.timedelta(hours=1))
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert later.get_status() == "scheduled"
    assert states(cancel([later.id], journal_dir)) == ["requested"]
    forwarder.step()
    assert forwarder.checkpoint.held == []
    forwarder.clock = lambda: 10**10  # its time comes
    settle(forwarder)
    forwarder.close()
    assert later.id not in transport.deliveries
    assert later.get_status() == "cancelled"


def test_a_redis_wipe_after_the_cancel_does_not_bring_the_job_back(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    job.cancel()
    settle(forwarder)
    assert job.get_status() == "cancelled"
    transport.forget()  # FLUSHALL: the mark and the queue entry are gone with everything else
    settle(forwarder, steps=10)  # the epoch check starts a refill pass
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert job.id not in transport.deliveries
    assert transport.executions == {}
    assert job.get_status() == "cancelled"


def test_a_running_job_is_settled_by_its_outcome_and_never_redelivered_after_a_wipe(
    journal_dir: Path,
) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.cancels.recheck_s = 0.0
    forwarder.step()
    delivery = transport.take("default")
    assert delivery is not None
    transport.leases.add(delivery.envelope.key_id)  # a worker runs it (holds its lease)
    job.cancel()
    settle(forwarder)
    assert job.get_status() == "forwarded"  # asked to stop; not settled while it runs
    assert collect_status(str(journal_dir))["cancels_pending"] == 1
    transport.forget()  # Redis loses everything, the run's lease with it
    settle(forwarder, steps=10)
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {}
    assert job.get_status() == "cancelled"


def test_cancelling_a_finished_failed_or_unknown_job_says_so_and_writes_nothing(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    ok, bad = queue.enqueue(tasks.add, 1, 2), queue.enqueue(tasks.fail)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=lambda env, _attempt: tasks.fail() if env.id == bad.id else None)
    settle(forwarder)
    forwarder.close()
    results = cancel([ok.id, bad.id, "no-such-job", ok.id], journal_dir)
    assert [(r.id, r.state) for r in results] == [
        (ok.id, "succeeded"),
        (bad.id, "failed"),
        ("no-such-job", "unknown"),
    ]
    assert all(r.message for r in results)
    assert not os.path.isdir(cancel_dir(str(journal_dir)))


def test_cancelling_many_unknown_ids_reads_the_listed_failures_once(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An id with no record left may be a listed failure (its segment compacted): that lookup
    is one query per cancel, not a read and decode of every listed failure per id."""
    queue = Queue(journal=journal_dir)
    bad = [queue.enqueue(tasks.fail) for _ in range(3)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=lambda _env, _attempt: tasks.fail())
    settle(forwarder)
    forwarder.close()
    statements: list[str] = []
    ask = cancels._ask

    def traced(path: str, wanted: list[str], locs: dict, index: LedgerIndex) -> list:
        index.keys._db.set_trace_callback(statements.append)
        return ask(path, wanted, {**locs, bad[0].id: []}, index)  # as if its segment were compacted

    monkeypatch.setattr(cancels, "_ask", traced)
    unknown = [f"no-such-job-{i}" for i in range(20)]
    results = cancel([bad[0].id, *unknown], journal_dir)
    assert states(results) == ["failed"] + ["unknown"] * 20
    assert len([s for s in statements if "failures" in s]) == 1


def test_a_run_outcome_beats_a_cancel_whatever_the_order() -> None:
    loc = ("w", 0, 64)
    cancelled = Entry("done", "j", loc, outcome="cancelled")
    succeeded = Entry("done", "j", loc, outcome="succeeded")
    failed = Entry("done", "j", loc, outcome="failed")
    for entries, outcome in (
        ([cancelled, succeeded], "succeeded"),
        ([succeeded, cancelled], "succeeded"),
        ([cancelled, failed], "failed"),
        ([failed, cancelled], "failed"),
    ):
        index = LedgerIndex()
        index.apply(Entry("cancel", "j", loc))
        for e in entries:
            index.apply(e)
        assert index.terminal[("w", 0)][64] == outcome
        assert index.cancels == {}
        assert sum(index.totals.values()) == 1
        assert (loc in index.failed) == (outcome == "failed")


def test_compaction_keeps_the_cancelled_count(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    envs = [queue.prepare(tasks.add, (i, i)) for i in range(60)]
    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        for start in range(0, 60, 10):  # tiny segments, so there is something to compact
            writer.append_many(e.to_bytes() for e in envs[start : start + 10])
    assert states(cancel([e.id for e in envs[:30]], journal_dir)) == ["requested"] * 30
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    settle(forwarder)
    transport.work()
    settle(forwarder)
    settle(forwarder)
    forwarder.close()
    compacted = load_compacted(str(journal_dir))
    assert compacted.cancelled > 0
    assert load_index(str(journal_dir), compacted).totals["cancelled"] + compacted.cancelled == 30
    status = collect_status(str(journal_dir))
    assert (status["cancelled"], status["succeeded"], status["pending"]) == (30, 30, 0)
    assert len(transport.executions) == 30


def test_a_cancel_between_a_redis_wipe_and_the_refill_is_not_pushed_again(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.forget()  # FLUSHALL before the forwarder noticed
    job.cancel()
    settle(forwarder, steps=10)  # the epoch check's refill pass, and the cancel
    transport.work()
    forwarder.close()
    assert job.id not in transport.deliveries, "the refill pushed a cancelled job again"
    assert transport.executions == {}
    assert job.get_status() == "cancelled"


def test_a_cancel_asked_while_the_job_runs_outlives_a_forwarder_restart(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.take("default")
    assert delivery is not None
    transport.kill(delivery)  # claimed, then its worker died: the lease is gone, no outcome
    transport.leases.add(delivery.envelope.key_id)  # ... but not yet when the cancel is looked at
    job.cancel()
    settle(forwarder)
    forwarder.close()
    assert job.get_status() == "forwarded"
    transport.leases.clear()  # the lease lapses
    forwarder = make_forwarder(journal_dir, transport)  # a new process: the request is in the ledger
    settle(forwarder, steps=10)  # an orphaned job would be delivered again; a cancelled one is not
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {}
    assert transport.runs[job.id] == 1, "delivered again after its worker vanished"
    assert job.get_status() == "cancelled"


def test_a_cancelled_job_whose_worker_vanished_is_not_delivered_again(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.add, 1, 2, retry=Retry(max_attempts=3, backoff_s=0.0, jitter=False))
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.take("default")
    assert delivery is not None
    transport.leases.add(delivery.envelope.key_id)  # running
    job.cancel()
    forwarder.cancels.recheck_s = 3600.0  # the cancel is not looked at again for a while
    settle(forwarder)
    transport.kill(delivery)  # its worker vanishes: orphaned, which reconcile would deliver again
    settle(forwarder, steps=10)
    assert transport.runs[job.id] == 1, "a cancelled job was delivered again"
    assert load_index(str(journal_dir), load_compacted(str(journal_dir))).lost == {}
    forwarder.cancels.recheck_s = 0.0
    settle(forwarder)
    forwarder.close()
    assert job.get_status() == "cancelled"


def test_a_cancelled_job_waiting_for_a_retry_is_not_retried(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    job = queue.enqueue(tasks.fail, retry=Retry(max_attempts=3, backoff_s=60.0, jitter=False))
    transport = MemoryTransport()
    clock = Clock()
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    forwarder.step()
    transport.work(func=lambda _env, _attempt: tasks.fail())
    settle(forwarder)  # attempt 1 failed: a retry in 60 s
    job.cancel()
    forwarder.cancels.recheck_s = 3600.0
    transport.down = True  # the cancel cannot be marked in Redis yet
    forwarder.step()
    transport.down = False
    clock.now += 120  # the retry is due
    settle(forwarder)
    assert transport.runs[job.id] == 1, "a cancelled job was retried"
    forwarder.cancels.recheck_s = 0.0
    settle(forwarder)
    forwarder.close()
    assert job.get_status() == "cancelled"
    assert failed_jobs(str(journal_dir)) == []


def test_status_counts_a_cancel_the_forwarder_has_not_taken_in_yet(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    job.cancel()
    job.cancel()  # twice: one job
    assert collect_status(str(journal_dir))["cancels_pending"] == 1
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    forwarder.step()
    forwarder.close()
    status = collect_status(str(journal_dir))
    assert (status["cancels_pending"], status["cancelled"], status["pending"]) == (0, 1, 0)


def test_doctor_fix_never_delivers_a_cancelled_job_again(tmp_path: Path) -> None:
    """A cancel taken into the ledger, not settled yet, then Redis lost its state: doctor --fix skips it.

    It pushed the job again with a fresh hash (no cancel mark) and a worker ran it (found in review).
    """
    from hybridq import cancel as cancel_jobs
    from hybridq.ops.doctor import diagnose
    from hybridq.testing import fake_stack

    effects = tmp_path / "ran.txt"
    with fake_stack(tmp_path / "j", allow="tests.tasks") as stack:
        job = stack.queue().enqueue("tests.tasks.record", str(effects), "ran")
        stack.forwarder.step()  # pushed
        assert cancel_jobs([job.id], stack.journal)[0].state == "requested"
        stack.forwarder.cancels.intake()  # in the ledger; not settled (Redis down, or a stop)
        stack.redis.flushall()
        report = diagnose(stack.journal, stack.transport, fix=True)
        assert report.fixed == 0
        stack.worker.work(burst=True, logging_level="WARNING")
    assert not effects.exists(), "the cancelled job ran"


def test_cancel_without_a_configured_journal_says_how_to_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As enqueue, fetch_job and failed_jobs do: no fallback to ./hybridq-journal in the working directory."""
    from hybridq.errors import ConfigError

    monkeypatch.delenv("HYBRIDQ_JOURNAL", raising=False)
    monkeypatch.chdir(tmp_path)
    Queue(journal=tmp_path / "hybridq-journal").enqueue(tasks.add, 1, 2)  # a journal that is not configured
    with pytest.raises(ConfigError, match="no journal configured"):
        cancel(["0190c3"])


def test_a_cancel_at_known_records_cancels_those_and_reads_no_journal(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cancel_at: the dashboard's bulk cancel, with the records' locations the lookup index holds."""
    from hybridq import cancels
    from hybridq.cancels import cancel_at, read_requests
    from hybridq.journal import JournalReader, RecordType

    queue = Queue(journal=journal_dir)
    doomed, kept = queue.enqueue(tasks.add, 1, 2), queue.enqueue(tasks.add, 3, 4)
    records = [r for r in JournalReader(str(journal_dir)).records() if r.rtype == RecordType.DATA]
    where = [(r.writer_id, r.segment_index, r.offset) for r in records]
    monkeypatch.setattr(cancels, "_records", lambda *_: pytest.fail("read the journal"))
    assert states(cancel_at([(doomed.id, where[0])], journal_dir)) == ["requested"]
    assert [jobs for _, jobs in read_requests(str(journal_dir))] == [[(doomed.id, where[0])]]
    run_once(journal_dir)
    assert (doomed.get_status(), kept.get_status()) == ("cancelled", "finished")
    assert states(cancel_at([(kept.id, where[1])], journal_dir)) == ["succeeded"]  # ended: nothing
    assert list(read_requests(str(journal_dir))) == []


class CutShortTransport(MemoryTransport):
    """Redis at its limit: a push is stored, then answered OOM (cut short); a cancel is refused."""

    full = False
    cancel_refused = False

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        result = super().push(jobs)
        if self.full:
            raise RedisFull("OOM command not allowed when used memory > 'maxmemory'.")
        return result

    def cancel(self, jobs: Sequence[Probe], *, key_ttl_s: float) -> list[bool]:
        if self.full or self.cancel_refused:
            raise RedisFull("OOM command not allowed when used memory > 'maxmemory'.")
        return super().cancel(jobs, key_ttl_s=key_ttl_s)


def test_a_cancel_the_backend_refused_is_not_settled_while_a_copy_may_be_there(journal_dir: Path) -> None:
    # A push cut short by OOM leaves the job in Redis and in the run table ("never pushed"); the
    # cancel's mark is refused too. Settled then, the copy in Redis would run a cancelled job.
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = CutShortTransport()
    transport.full = True
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.cancels.recheck_s = 0.0  # asked again at each step
    forwarder.step()
    assert job.id in transport.deliveries
    assert states(cancel([job.id], journal_dir)) == ["requested"]
    settle(forwarder, steps=3)
    assert job.get_status() != "cancelled"  # not settled: the mark did not reach Redis
    transport.full = False
    settle(forwarder, steps=3)
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {}
    assert job.get_status() == "cancelled"


def test_a_job_cancelled_before_it_is_read_is_not_pushed_while_its_mark_waits(journal_dir: Path) -> None:
    # The cancel waits for the backend to take its mark; the job must not be pushed meanwhile.
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    assert states(cancel([job.id], journal_dir)) == ["requested"]
    transport = CutShortTransport()
    transport.cancel_refused = True
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.cancels.recheck_s = 0.0
    settle(forwarder, steps=3)
    assert job.id not in transport.deliveries
    transport.cancel_refused = False
    settle(forwarder, steps=3)
    forwarder.close()
    assert job.id not in transport.deliveries
    assert job.get_status() == "cancelled"
