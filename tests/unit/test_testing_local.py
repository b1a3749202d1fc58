"""hybridq.testing's LocalQueue: eager mode and drain(), through the public API (docs/testing.md)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import RetryLater, current_job
from hybridq.errors import NotAllowed, NotSerializable, RetryLaterExpired
from hybridq.testing import LocalQueue, eager

SEEN: list[Any] = []


@pytest.fixture(autouse=True)
def _clear_seen() -> None:
    SEEN.clear()


@hybridq.task(queue="mail")
def send(user: int, tags: Any = None) -> dict[str, Any]:
    job = current_job()
    assert job is not None
    SEEN.append((job.id, job.idempotency_key, job.attempt, job.max_attempts, job.queue, job.func))
    return {"user": user, "tags": tags}


@hybridq.task(retry=hybridq.Retry(max_attempts=3, backoff_s=30))
def flaky(fail_times: int) -> str:
    job = current_job()
    assert job is not None
    SEEN.append(job.attempt)
    if job.attempt <= fail_times:
        raise ValueError(f"attempt {job.attempt} failed")
    return f"ok at {job.attempt}"


READY: set[str] = set()


@hybridq.task()
def when_ready(name: str) -> str:
    job = current_job()
    assert job is not None
    SEEN.append(job.attempt)
    if name not in READY:
        raise RetryLater(10, f"{name} not ready", deadline_s=60)
    return name


@hybridq.task()
def fan_out(n: int) -> int:
    for i in range(n):
        send.delay(i)
    return n


@hybridq.task()
async def async_double(x: int) -> int:
    await asyncio.sleep(0)
    job = current_job()
    assert job is not None
    return x * 2 + job.attempt - 1


def plain_function(x: int) -> int:  # not a @hybridq.task: the worker needs an allow prefix
    return x


def test_eager_runs_the_task_at_delay_with_current_job_set() -> None:
    with eager() as local:
        job = send.enqueue_call((7,), {"tags": ("a", "b")}, idempotency_key="welcome:7")
    assert job.status == "finished"
    # Through the (tagged) JSON round trip, as a worker gets it: the tuple stays a tuple.
    assert job.result == {"user": 7, "tags": ("a", "b")}
    assert [(job.id, "welcome:7", 1, 1, "mail", "tests.unit.test_testing_local.send")] == SEEN
    assert local.jobs == [job]
    assert current_job() is None  # reset after the run


def test_eager_queue_enqueue_without_any_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYBRIDQ_JOURNAL", raising=False)
    queue = hybridq.Queue("mail")  # no journal: fine under hybridq.testing
    with eager():
        job = queue.enqueue(send, 3)
    assert job.result == {"user": 3, "tags": None}
    assert list(tmp_path.iterdir()) == []


def test_eager_refuses_a_non_serializable_argument_at_enqueue() -> None:
    with eager() as local, pytest.raises(NotSerializable):
        send.delay(object())
    assert local.jobs == []
    assert SEEN == []


def test_eager_refuses_what_production_refuses() -> None:
    with eager(), pytest.raises(hybridq.EnvelopeError):
        hybridq.Queue().enqueue(send, 1, ttl=5)  # an RQ option hybridq does not support


def test_eager_propagates_a_failure_after_the_last_attempt() -> None:
    with eager() as local, pytest.raises(ValueError, match="attempt 3 failed"):
        flaky.delay(5)
    assert SEEN == [1, 2, 3]  # Retry(max_attempts=3): retried at once, no backoff waited
    (job,) = local.failed
    assert job.attempt == 3
    assert job.exc_info is not None
    assert "ValueError: attempt 3 failed" in job.exc_info


def test_eager_without_propagate_keeps_the_failure_on_the_job() -> None:
    with eager(propagate=False):
        job = flaky.delay(5)
    assert job.status == "failed"
    assert isinstance(job.exception, ValueError)
    with pytest.raises(ValueError, match="attempt 3 failed"):
        job.wait()


def test_eager_retries_until_success() -> None:
    with eager():
        job = flaky.delay(2)
    assert (job.status, job.result, job.attempt) == ("finished", "ok at 3", 3)


def test_eager_runs_jobs_a_task_enqueues_inline() -> None:
    with eager() as local:
        parent = fan_out.delay(3)
    assert parent.result == 3
    assert [j.result["user"] for j in local.jobs[1:]] == [0, 1, 2]


def test_drain_runs_jobs_only_when_asked() -> None:
    with LocalQueue() as local:
        job = send.delay(1)
        assert job.status == "queued"
        assert job.get_status() == "accepted"
        assert SEEN == []
        assert local.drain() == 1
    assert job.status == "finished"
    assert job.wait() == {"user": 1, "tags": None}


def test_drain_honours_retry_policies() -> None:
    with LocalQueue() as local:
        ok = flaky.delay(1)
        bad = flaky.delay(9)
        assert local.drain() == 2 + 3
    assert (ok.status, ok.attempt) == ("finished", 2)
    assert local.failed == [bad]
    assert bad.attempt == 3
    assert isinstance(bad.exception, ValueError)


def test_retry_later_runs_again_on_a_later_drain_without_using_an_attempt() -> None:
    READY.clear()
    with LocalQueue() as local:
        job = when_ready.delay("report")
        start = local.clock
        assert local.drain() == 1  # said RetryLater: not run again in this drain
        assert job.status == "retrying"
        assert local.drain() == 1  # still not ready
        assert local.clock == pytest.approx(start + 10)  # the fake clock moved by its wait
        READY.add("report")
        assert local.drain() == 1
    assert job.status == "finished"
    assert job.result == "report"
    assert SEEN == [1, 1, 1]  # RetryLater used no attempt
    assert job.runs == 3


def test_retry_later_fails_for_good_past_its_deadline_on_the_fake_clock() -> None:
    READY.clear()
    with LocalQueue() as local:
        job = when_ready.delay("never")
        drains = 0
        while job.status != "failed":
            local.drain()
            drains += 1
            assert drains < 20
    assert isinstance(job.exception, RetryLaterExpired)
    assert drains == 7  # runs at 0, 10, ..., 60 s on the fake clock: at the 60 s deadline, expired


def test_an_explicit_idempotency_key_makes_a_duplicate_that_never_runs() -> None:
    with LocalQueue() as local:
        first = send.enqueue_call((1,), idempotency_key="k")
        second = send.enqueue_call((2,), idempotency_key="k")
        assert local.drain() == 1
    assert second.duplicate_of == first.id
    assert second.result == first.result == {"user": 1, "tags": None}
    assert second.runs == 0


def test_async_tasks_run_including_from_an_async_test() -> None:
    with eager():
        assert async_double.delay(4).result == 8

    async def from_a_loop() -> Any:
        with eager():
            return async_double.delay(5).result

    assert asyncio.run(from_a_loop()) == 10


def test_the_worker_allowlist_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDQ_ALLOW", raising=False)
    queue = hybridq.Queue()
    with eager(), pytest.raises(NotAllowed, match=r"--allow tests\.unit\.test_testing_local"):
        queue.enqueue(plain_function, 1)
    with eager(allow="tests.unit"):  # as hybridq worker --allow tests.unit
        assert queue.enqueue(plain_function, 1).result == 1


def test_a_result_json_cannot_hold_is_stored_as_its_repr() -> None:
    with eager():
        job = hybridq.Queue().enqueue("tests.unit.test_testing_local.make_complex")
    assert job.result == "(1+2j)"


def test_a_tagged_result_comes_back_of_its_type() -> None:
    with eager():
        job = hybridq.Queue().enqueue("tests.unit.test_testing_local.make_set")
    assert job.result == {1}


def make_set() -> set[int]:
    return {1}


def make_complex() -> complex:
    return 1 + 2j


def test_the_mode_ends_with_the_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDQ_JOURNAL", str(tmp_path / "journal"))
    with LocalQueue() as outer:
        with eager() as inner:
            send.delay(1)
        send.delay(2)
    assert [len(inner.jobs), len(outer.jobs)] == [1, 1]
    job = hybridq.Queue("mail").enqueue(send, 3)  # the journal again
    assert type(job) is hybridq.Job
    assert os.path.isdir(tmp_path / "journal")


def test_eager_enqueue_many_runs_every_job_before_raising_the_first_failure() -> None:
    queue = hybridq.Queue()
    with eager() as local, pytest.raises(ValueError, match="attempt 1 failed"):  # no Retry given
        queue.enqueue_many([queue.prepare(flaky, (9,)), queue.prepare(send, (1,))])
    assert [j.status for j in local.jobs] == ["failed", "finished"]


def test_with_a_signing_key_jobs_are_signed_and_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq.security.signing import ENV_KEY_FILE

    key = tmp_path / "keys"
    key.write_text("k" * 64 + "\n")
    key.chmod(0o600)
    monkeypatch.setenv(ENV_KEY_FILE, str(key))
    with eager():
        job = send.delay(5)
    assert job.envelope.signature is not None
    assert job.result == {"user": 5, "tags": None}


def test_a_result_with_neither_json_nor_repr_finishes_the_job() -> None:
    with eager():
        job = hybridq.Queue().enqueue("tests.unit.test_testing_local.make_huge_int")
    assert job.result == "<int: no JSON form and no repr()>"


def make_huge_int() -> int:
    return 10**5000
