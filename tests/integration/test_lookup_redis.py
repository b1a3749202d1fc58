"""Jobs by id and their results with real processes (issue 17 item 1).

A forwarder, a pool worker (``hybridq worker``) and a private redis-server: the worker's
completion event carries the task's return value, the forwarder keeps it in its ledger and its
lookup index, and ``fetch_job`` reads it back from the journal directory alone, after Redis
lost everything (FLUSHALL).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hybridq import JobFailed, JobWaitTimeout, Queue, fetch_job
from hybridq.testing.embedded import RedisServer

from tests.integration.test_worker_redis import Stack, redis_client, stack

__all__ = ["stack"]  # the fixture, used by this module's tests


def test_results_by_id_survive_a_redis_wipe(
    redis_server: RedisServer, stack: Stack, journal_dir: Path
) -> None:
    stack.forwarder(redis_server.url)
    stack.worker(redis_server.url)
    queue = Queue("default", journal_dir)
    job = queue.enqueue("tests.tasks.add", 2, 3)
    failing = queue.enqueue("tests.tasks.fail")
    first = queue.enqueue("tests.tasks.add", 20, 1, idempotency_key="order-7")
    later = queue.enqueue("tests.tasks.add", 20, 1, run_at=time.time() + 3600)
    assert job.wait(timeout=60) == 5
    with pytest.raises(JobFailed) as failed:
        failing.wait(timeout=60)
    assert failed.value.exc_info == "RuntimeError: this task always fails"
    assert first.wait(timeout=60) == 21
    with pytest.raises(JobWaitTimeout):
        later.wait(timeout=0.2)
    assert later.status == "scheduled"

    with redis_client(redis_server) as client:
        client.flushall()  # the results RQ kept (result_ttl) are gone; the ledger's are not
    again = queue.enqueue("tests.tasks.add", 20, 1, idempotency_key="order-7")
    found = fetch_job(job.id, journal=journal_dir)
    assert found is not None
    assert (found.status, found.result, found.attempt, found.exc_info) == ("finished", 5, 1, None)
    assert found.started_at is not None
    assert found.ended_at is not None
    assert found.enqueued_at <= found.started_at <= found.ended_at
    assert fetch_job("no-such-job", journal=journal_dir) is None
    failed_job = fetch_job(failing.id, journal=journal_dir)
    assert failed_job is not None
    assert (failed_job.status, failed_job.result) == ("failed", None)
    # A duplicate of a finished key: never pushed, it reports the original's result.
    assert again.wait(timeout=60) == 21
    duplicate = fetch_job(again.id, journal=journal_dir)
    assert duplicate is not None
    assert (duplicate.duplicate_of, duplicate.status, duplicate.result) == (first.id, "finished", 21)
