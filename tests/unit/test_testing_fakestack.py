"""hybridq.testing.fake_stack: the real forwarder, RQ and worker on fakeredis, in one process."""

from __future__ import annotations

from pathlib import Path

import hybridq
from hybridq import RetryLater, current_job
from hybridq.testing import fake_stack

READY: set[str] = set()
ATTEMPTS: list[int] = []


@hybridq.task(queue="mail")
def welcome(user: int) -> list[object]:
    job = current_job()
    assert job is not None
    return [user, job.attempt, job.queue]


@hybridq.task(retry=hybridq.Retry(max_attempts=3, backoff_s=60, jitter=False))
def flaky(fail_times: int) -> str:
    job = current_job()
    assert job is not None
    ATTEMPTS.append(job.attempt)
    if job.attempt <= fail_times:
        raise ValueError(f"attempt {job.attempt} failed")
    return "ok"


@hybridq.task()
def when_ready(name: str) -> str:
    if name not in READY:
        raise RetryLater(30, f"{name} not ready")
    return name


def test_a_job_goes_through_forwarder_rq_and_worker(tmp_path: Path) -> None:
    with fake_stack(tmp_path / "journal", queues=["mail", "default"]) as stack:
        job = welcome.delay(7)
        status = stack.run()
        assert stack.result(job.id) == [7, 1, "mail"]
        assert job.get_status() == "finished"
    assert (status["accepted"], status["succeeded"], status["pending"]) == (1, 1, 0)


def test_retries_and_failures_reach_the_ledger(tmp_path: Path) -> None:
    ATTEMPTS.clear()
    with fake_stack(tmp_path / "journal") as stack:
        ok = flaky.delay(1)
        bad = flaky.delay(9)
        status = stack.run()  # the 60 s backoffs are skipped on the forwarder's clock
        assert ok.get_status() == "finished"
        assert bad.get_status() == "failed"
        (failure,) = hybridq.failed_jobs()
    assert failure.id == bad.id
    assert failure.attempts == 3
    assert "attempt 3 failed" in (failure.error or "")
    assert sorted(ATTEMPTS) == [1, 1, 2, 2, 3]
    assert (status["succeeded"], status["failed"]) == (1, 1)


def test_retry_later_runs_again(tmp_path: Path) -> None:
    READY.clear()
    with fake_stack(tmp_path / "journal") as stack:
        job = when_ready.delay("x")
        stack.forwarder.step()
        stack.worker.work(burst=True, logging_level="WARNING")
        stack.forwarder.step()
        assert job.get_status() == "retrying"
        READY.add("x")
        stack.run()
        assert stack.result(job.id) == "x"


def test_a_redis_wipe_is_recovered_from(tmp_path: Path) -> None:
    with fake_stack(tmp_path / "journal", queues=["mail"]) as stack:
        job = welcome.delay(3)
        stack.forwarder.step()  # pushed to RQ ...
        stack.redis.flushall()  # ... and lost with Redis's memory
        status = stack.run()
        assert stack.result(job.id) == [3, 1, "mail"]
    assert (status["succeeded"], status["pending"]) == (1, 0)
