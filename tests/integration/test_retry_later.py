"""``raise hybridq.RetryLater(seconds)`` with real processes (issue 16, item 3).

A forwarder (``--lease 2``), a worker in each mode (the pool, ``--rq``, ``--simple``, a plain
``rq worker --job-class hybridq.worker.Job``) and a private redis-server; the tasks
(``tests.tasks.not_yet``, ``not_until``) append a line per run with the attempt
``current_job()`` reports, so what ran is counted without trusting hybridq.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
from hybridq import Queue, Retry, failed_jobs
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.store import load_index
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.testing.rq_cli import RQ
from hybridq.transport.rq import RQTransport

from tests.integration.test_worker_protocol import OWNER, deliver, events
from tests.integration.test_worker_protocol import envelope as protocol_envelope
from tests.integration.test_worker_redis import (
    Stack,
    alive,
    lines_of,
    redis_client,
    rq_job,
    stack,
    wait_status,
)
from tests.support.processes import WorkerProcess, wait_until
from tests.support.rqwork import Work

__all__ = ["stack"]  # the fixture, used by this module's tests


def start_worker(stack: Stack, url: str, mode: str) -> WorkerProcess:
    """A worker of ``mode``: ``pool`` (``hybridq worker``), ``rq``, ``simple`` or ``plain`` (``rq worker``)."""
    if mode == "plain":
        args = [*RQ, "worker", "--serializer", "rq.serializers.JSONSerializer"]
        return stack._start([*args, "--job-class", "hybridq.worker.Job", "-u", url, "default"])
    mode_args = {"pool": ["--processes", "1"], "rq": ["--rq"], "simple": ["--simple"]}[mode]
    return stack._start([sys.executable, "-m", "hybridq", "worker", "--redis", url, *mode_args, "default"])


def waiting_later(journal: Path) -> int:
    """How many RetryLaters of the job waiting in the ledger came before its next run."""
    index = load_index(str(journal), load_compacted(str(journal)))
    return max((n for n, _ in index.later.values()), default=0)


@pytest.mark.parametrize("mode", ["pool", "rq", "simple", "plain"])
def test_retry_later_uses_no_attempt_in_every_worker_mode(
    mode: str,
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(redis_server.url)
    worker = start_worker(stack, redis_server.url, mode)
    queue = Queue("default", journal_dir)
    # One attempt: three RetryLaters, then success.
    queue.enqueue("tests.tasks.not_yet", str(effects), "A", 3, 0, 0.3, retry=Retry(max_attempts=1))
    # A retry policy with one failure-retry: three RetryLaters, a real failure, then success.
    queue.enqueue(
        "tests.tasks.not_yet",
        str(effects),
        "B",
        3,
        1,
        0.3,
        retry=Retry(max_attempts=2, backoff_s=0.3, jitter=False),
    )
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["succeeded"] == 2,
        what="both jobs to succeed",
        alive=alive(forwarder, worker),
    )
    assert (status["failed"], status["retrying"], status["pending"]) == (0, 0, 0)
    assert [x.attempt for x in lines_of(effects, "run", "A")] == [1, 1, 1, 1]
    assert [x.attempt for x in lines_of(effects, "ok", "A")] == [1]
    assert [x.attempt for x in lines_of(effects, "run", "B")] == [1, 1, 1, 1, 2]
    assert [x.attempt for x in lines_of(effects, "ok", "B")] == [2]
    with redis_client(redis_server) as client:
        assert client.zcard("rq:failed:default") == 0
    if mode != "plain":  # a plain rq worker shows RQ's own log lines only
        log = worker.log()
        assert log.count("RetryLater") == 6, log
        assert log.count("Traceback") <= 1, log  # B's one real failure (RQ logs its traceback)


def test_retry_later_past_its_deadline_fails_for_good(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(redis_server.url)
    worker = start_worker(stack, redis_server.url, "pool")
    queue = Queue("default", journal_dir)
    job = queue.enqueue(
        "tests.tasks.not_until",
        str(effects),
        "D",
        str(tmp_path / "never"),
        0.5,
        2.0,
        retry=Retry(max_attempts=3),
    )
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["failed"] == 1,
        what="the job to fail for good",
        alive=alive(forwarder, worker),
    )
    assert (status["succeeded"], status["retrying"]) == (0, 0)
    runs = lines_of(effects, "run", "D")
    assert {x.attempt for x in runs} == {1}, runs
    assert 2 <= len(runs) <= 6, runs  # every 0.5 s (plus overheads) for 2 s, plus one at the deadline
    (failure,) = failed_jobs(str(journal_dir))
    assert failure.id == job.id
    assert failure.attempts == 1
    assert "RetryLaterExpired" in (failure.error or ""), failure.error
    assert "deadline of 2 s" in (failure.error or ""), failure.error
    assert job.get_status() == "failed"


@pytest.mark.parametrize("mode", ["pool", "rq"])
def test_a_flushall_and_a_worker_kill_while_a_job_waits_in_retry_later_do_not_lose_it(
    mode: str,
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    effects = tmp_path / "effects.txt"
    switch = tmp_path / "committed"
    forwarder = stack.forwarder(redis_server.url)
    worker = start_worker(stack, redis_server.url, mode)
    queue = Queue("default", journal_dir)
    job = queue.enqueue(
        "tests.tasks.not_until", str(effects), "F", str(switch), 4.0, retry=Retry(max_attempts=1)
    )
    wait_until(functools.partial(waiting_later, journal_dir), timeout=30, what="the RetryLater in the ledger")
    assert job.get_status() == "retrying"
    worker.kill()  # SIGKILL, with its children
    redis_server.flushall()  # every key: the queue, the stored outcome, the epoch
    switch.write_text("yes")
    worker = start_worker(stack, redis_server.url, mode)
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["succeeded"] == 1,
        what="the job to run again after the wipe and succeed",
        alive=alive(forwarder, worker),
    )
    assert status["failed"] == 0
    assert [x.attempt for x in lines_of(effects, "run", "F")] == [1, 1]
    assert [x.attempt for x in lines_of(effects, "ok", "F")] == [1]
    assert job.get_status() == "finished"


def test_a_copy_of_a_run_that_said_retry_later_reports_it_again_without_failing(
    redis_server: RedisServer, tmp_path: Path, work: Work
) -> None:
    """Under RQ's SimpleWorker and hybridq's: the run is finished in RQ, never in its failed registry;
    a copy delivered again (its event was lost) reports the RetryLater again and runs nothing."""
    transport = RQTransport(redis_server.url)
    try:
        effects = tmp_path / "effects.txt"
        env = protocol_envelope(
            "tests.tasks.not_until", args=(str(effects), "S", str(tmp_path / "never"), 5.0)
        )
        deliver(transport, env)
        work(transport)
        [event] = events(transport)
        assert (event["outcome"], event["final"], event["attempt"], event["later"]) == ("later", False, 1, 1)
        assert event["retry_delay"] == 5.0
        assert rq_job(redis_server, env.id).get_status() == "finished"
        assert transport.connection.zcard("rq:failed:default") == 0
        transport.connection.delete(keys.events(OWNER))  # the completion event is lost
        deliver(transport, env, attempt=1, replace=True)  # what the forwarder does after the grace
        work(transport)
        [again] = events(transport)
        assert (again["outcome"], again["later"], again["retry_delay"]) == ("later", 1, 5.0)
        assert len(lines_of(effects, "run", "S")) == 1  # the copy ran nothing
        assert rq_job(redis_server, env.id).get_status() == "finished"
        assert transport.connection.zcard("rq:failed:default") == 0
    finally:
        transport.close()


def test_an_async_task_says_retry_later_on_the_pools_event_loop(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(redis_server.url)
    worker = start_worker(stack, redis_server.url, "pool")
    Queue("default", journal_dir).enqueue(
        "tests.tasks.not_yet_async", str(effects), "C", 2, retry=Retry(max_attempts=1)
    )
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["succeeded"] == 1,
        what="the async job to succeed",
        alive=alive(forwarder, worker),
    )
    assert status["failed"] == 0
    assert [x.attempt for x in lines_of(effects, "run", "C")] == [1, 1, 1]
    assert worker.log().count("said RetryLater") == 2
