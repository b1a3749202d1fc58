"""``hybridq.RetryLater``: "not yet, try again in N s", without using an attempt (issue 16, item 3).

The worker's side (what a run that raised it stores and reports), the wire (deliveries and events
carry how many RetryLaters came before, and since when), the ledger (a ``retry`` entry that uses
no attempt; replayed in any order) and the forwarder's schedule, against the in-memory transport.
The same with real processes is tests/integration/test_retry_later.py.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import Queue, Retry, failed_jobs
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.errors import RetryLater, RetryLaterExpired
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.state import ForwarderState
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.entries import Entry, parse_event
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index
from hybridq.ops.status import collect_status
from hybridq.protocol import CompletionEvent, Delivery
from hybridq.transport import MemoryTransport
from hybridq.worker.run import Run, conclude

from tests import tasks
from tests.unit.test_completions import Clock, make_forwarder, settle


def envelope(**overrides: Any) -> Envelope:
    fields: dict[str, Any] = {
        "id": new_job_id(),
        "func": "tests.tasks.add",
        "queue": "default",
        "idempotency_key": "key",
        "created_at": 1.5,
        "args": (1, 2),
        "retry": Retry(max_attempts=2, backoff_s=2.0, jitter=False),
    }
    fields.update(overrides)
    return Envelope(**fields)


# -- the exception ------------------------------------------------------------------------------


def test_retry_later_is_exported_and_checks_its_arguments() -> None:
    assert "RetryLater" in hybridq.__all__
    assert hybridq.RetryLater is RetryLater
    later = RetryLater(2.5, "order 7 is not committed yet", deadline_s=60)
    assert (later.seconds, later.deadline_s, later.reason) == (2.5, 60.0, "order 7 is not committed yet")
    assert RetryLater(0).deadline_s == hybridq.errors.RETRY_LATER_DEADLINE_S
    for bad in (-1, math.nan, math.inf, 86400.5, "5", None, True):
        with pytest.raises(ValueError, match="RetryLater: seconds must be"):
            RetryLater(bad)  # type: ignore[arg-type]
    for bad in (0, -5, math.nan, math.inf, 7 * 86400 + 1):
        with pytest.raises(ValueError, match="RetryLater: deadline_s must be"):
            RetryLater(1, deadline_s=bad)


# -- the worker's side: what a run that raised it stores ----------------------------------------


def _run(d: Delivery) -> Run:
    return Run.new(d.to_json(), d, tasks.add)


def _stored(run: Run) -> dict[str, Any]:
    assert run.finish is not None
    body: dict[str, Any] = json.loads(run.finish[1][1])
    return body


def test_a_run_that_says_retry_later_stores_a_later_outcome_and_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = Delivery(envelope(), "owner1", ("w", 0, 64), 1)
    run = _run(d)
    with caplog.at_level(logging.DEBUG, logger="hybridq"):
        value, error = conclude(run, None, RetryLater(3, "not committed"))
    assert (value, error) == (None, None)  # RQ records the run finished: nothing in its failed registry
    stored = _stored(run)
    assert stored["outcome"] == "later"
    assert stored["final"] is False
    assert (stored["retry_delay"], stored["later"]) == (3, 1)
    event = json.loads(run.finish[1][3])  # type: ignore[index]
    assert (event["outcome"], event["retry_delay"], event["later"], event["attempt"]) == ("later", 3, 1, 1)
    records = [r for r in caplog.records if r.name.startswith("hybridq")]
    assert [r.levelno for r in records] == [logging.INFO], caplog.text
    assert "RetryLater" in records[0].getMessage()
    assert "not committed" in records[0].getMessage()
    assert "no attempt used" in records[0].getMessage()
    assert "Traceback" not in caplog.text


def test_retry_later_past_its_deadline_fails_the_job_for_good() -> None:
    # Two earlier RetryLaters, the first 100 s ago; this one's deadline is 60 s from it.
    d = Delivery(envelope(), "owner1", ("w", 0, 64), 3, later=2, later_since=1.0)
    run = _run(d)
    _, error = conclude(run, None, RetryLater(5, deadline_s=60))
    assert isinstance(error, RetryLaterExpired)
    stored = _stored(run)
    assert (stored["outcome"], stored["final"]) == ("failed", True)
    assert "deadline" in stored["error"]
    assert "failed for good" in stored["error"]


def test_the_last_wait_ends_at_the_deadline() -> None:
    since = time.time() - 50
    run = _run(Delivery(envelope(), "owner1", ("w", 0, 64), 2, later=1, later_since=since))
    _, error = conclude(run, None, RetryLater(30, deadline_s=60))
    assert error is None
    stored = _stored(run)
    assert stored["later"] == 2
    assert stored["later_since"] == since
    assert 9 <= stored["retry_delay"] <= 10  # not 30: one more try at the deadline


def test_retry_later_keeps_the_attempt_number_and_the_budget() -> None:
    # Wire attempt 4 after 3 RetryLaters is the job's attempt 1: its failure is not final.
    d = Delivery(envelope(), "owner1", ("w", 0, 64), 4, later=3, later_since=1e12)
    run = _run(d)
    _, error = conclude(run, None, RuntimeError("boom"))
    assert isinstance(error, RuntimeError)
    stored = _stored(run)
    assert (stored["outcome"], stored["final"]) == ("failed", False)
    event = CompletionEvent.of(d, stored, dup=False, at=1.0)
    assert event.retry_delay == 2.0  # Retry(backoff_s=2) after the job's attempt 1, not attempt 4


# -- the wire and the ledger --------------------------------------------------------------------


def test_deliveries_and_events_carry_the_retry_laters_before_them() -> None:
    env = envelope()
    d = Delivery(env, "owner1", ("w", 0, 64), 3, later=2, later_since=12.5)
    assert Delivery.from_json(json.loads(json.dumps(d.to_json()))) == d
    assert "later" not in Delivery(env, "o", ("w", 0, 64), 1).to_json()  # unchanged for other jobs
    body = {
        "id": env.id,
        "loc": ["w", 0, 64],
        "queue": "default",
        "outcome": "later",
        "final": False,
        "retry_delay": 4.0,
        "attempt": 3,
        "dup": False,
        "error": None,
        "at": 20.0,
        "later": 3,
        "later_since": 12.5,
    }
    event = CompletionEvent.from_json(body)
    assert (event.later, event.later_since, event.terminal) == (3, 12.5, False)
    assert event.to_json() == body
    entry = parse_event("1-0", body, lambda: 100.0)
    assert (entry.kind, entry.attempt, entry.run_at, entry.later, entry.later_since) == (
        "retry",
        3,
        104.0,
        3,
        12.5,
    )
    assert Entry.from_bytes(entry.to_bytes()) == entry


def test_the_ledger_folds_retry_laters_in_any_order() -> None:
    loc = ("w", 0, 64)
    first = Entry("retry", "j", loc, attempt=1, run_at=10.0, later=1, later_since=5.0)
    second = Entry("retry", "j", loc, attempt=2, run_at=20.0, later=2, later_since=5.0)
    failure = Entry("retry", "j", loc, attempt=3, run_at=30.0, later=2, later_since=5.0)
    for order in ([first, second, failure], [failure, second, first], [second, failure, first]):
        index = LedgerIndex()
        for entry in order:
            index.apply(entry)
        assert index.retries[loc] == (30.0, 3)
        assert index.later[loc] == (2, 5.0)
    index.apply(Entry("done", "j", loc, outcome="succeeded", attempt=4))
    assert loc not in index.later


def test_the_forwarder_delivers_the_next_run_with_the_retry_laters_counted(journal_dir: Path) -> None:
    state = ForwarderState(str(journal_dir), ForwarderConfig())
    loc = ("w", 0, 64)
    state.index.apply(Entry("retry", "j", loc, attempt=2, run_at=1.0, later=2, later_since=7.0))
    d = state.delivery(envelope(), loc, 3)
    assert (d.attempt, d.later, d.later_since) == (3, 2, 7.0)


# -- the whole path, with the in-memory transport -----------------------------------------------


def test_retry_later_uses_no_attempt_and_the_job_keeps_its_one_failure_retry(journal_dir: Path) -> None:
    clock = Clock()
    job = Queue(journal=journal_dir).enqueue(
        tasks.add, 1, 2, retry=Retry(max_attempts=2, backoff_s=10, jitter=False)
    )
    transport = MemoryTransport()
    transport.clock = clock
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    forwarder.step()
    seen: list[int] = []

    def task(_env: Envelope, attempt: int) -> int:
        seen.append(attempt)
        if len(seen) <= 3:
            raise RetryLater(5, "not yet")
        if len(seen) == 4:
            raise RuntimeError("a real failure")
        return 3

    for _ in range(3):
        assert transport.work(func=task) == 1
        settle(forwarder)
        assert transport.queues["default"] == []  # not due for 5 s
        assert job.get_status() == "retrying"
        clock.now += 5
        settle(forwarder)
    assert transport.work(func=task) == 1  # the failure: its retry waits the policy's 10 s
    settle(forwarder)
    clock.now += 10
    settle(forwarder)
    assert transport.work(func=task) == 1
    settle(forwarder)
    forwarder.close()
    assert seen == [1, 1, 1, 1, 2]  # three RetryLaters used no attempt; the failure used one
    status = collect_status(str(journal_dir))
    assert (status["succeeded"], status["failed"], status["retrying"]) == (1, 0, 0)
    assert job.get_status() == "finished"
    assert failed_jobs(str(journal_dir)) == []


def test_retry_later_past_its_deadline_is_listed_as_failed_with_the_reason(journal_dir: Path) -> None:
    clock = Clock()
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    transport.clock = clock
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    forwarder.step()
    runs = 0

    def task(_env: Envelope, _attempt: int) -> None:
        nonlocal runs
        runs += 1
        raise RetryLater(10, "never committed", deadline_s=25)

    while transport.work(func=task):
        settle(forwarder)
        clock.now += 10
        settle(forwarder)
    forwarder.close()
    assert runs == 4  # at 0, 10, 20 and 25 s (the last wait ends at the deadline)
    assert job.get_status() == "failed"
    (failure,) = failed_jobs(str(journal_dir))
    assert failure.attempts == 1
    assert "RetryLaterExpired" in (failure.error or "")
    assert "deadline of 25 s" in (failure.error or "")
    assert "never committed" in (failure.error or "")


def test_a_redis_wipe_while_a_job_waits_in_retry_later_loses_nothing(journal_dir: Path) -> None:
    clock = Clock()
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2, retry=Retry(max_attempts=1))
    transport = MemoryTransport()
    transport.clock = clock
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    forwarder.step()
    seen: list[int] = []

    def task(_env: Envelope, attempt: int) -> int:
        seen.append(attempt)
        if len(seen) == 1:
            raise RetryLater(30)
        return 3

    transport.work(func=task)
    settle(forwarder)
    forwarder.close()
    transport.forget()  # FLUSHALL, and the forwarder restarts: the schedule is in the ledger
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    settle(forwarder)
    assert transport.queues.get("default", []) == []
    clock.now += 30
    settle(forwarder)
    assert transport.work(func=task) == 1
    settle(forwarder)
    forwarder.close()
    assert seen == [1, 1]
    assert job.get_status() == "finished"
    index = load_index(str(journal_dir), load_compacted(str(journal_dir)))
    assert index.later == {}


def test_a_job_that_says_retry_later_too_often_fails_for_good() -> None:
    from hybridq.errors import RETRY_LATER_MAX_TIMES

    attempt = RETRY_LATER_MAX_TIMES + 1
    d = Delivery(envelope(), "o", ("w", 0, 64), attempt, later=RETRY_LATER_MAX_TIMES, later_since=time.time())
    run = _run(d)
    _, error = conclude(run, None, RetryLater(0, "spinning"))
    assert isinstance(error, RetryLaterExpired)
    assert f"more than {RETRY_LATER_MAX_TIMES} times (last: spinning)" in str(error)
    assert _stored(run)["final"] is True


def test_arguments_changed_out_of_range_fail_the_attempt_like_a_bug() -> None:
    run = _run(Delivery(envelope(), "owner1", ("w", 0, 64), 1))
    later = RetryLater(1)
    later.seconds = -3
    _, error = conclude(run, None, later)
    assert isinstance(error, ValueError)
    assert "RetryLater: seconds must be" in str(error)
    stored = _stored(run)
    assert (stored["outcome"], stored["final"]) == ("failed", False)  # Retry(max_attempts=2): retried
