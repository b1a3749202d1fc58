"""``job.status`` ``started`` with real processes (issue 17 item 1).

A forwarder, a worker (the pool, and RQ's worker with hybridq's pipelined claim) and a private
redis-server: the claim script adds a started event to the forwarder's stream, and
``fetch_job`` reads ``started`` from the lookup index while the task runs, then ``finished``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hybridq import Queue, fetch_job
from hybridq.signing import ENV_KEY
from hybridq.testing.embedded import RedisServer

from tests.integration.test_worker_redis import Stack, stack

__all__ = ["stack"]  # the fixture, used by this module's tests


@pytest.mark.parametrize("mode", ["pool", "rq", "pool-signed"])
def test_a_running_job_reads_started_then_finished(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if mode == "pool-signed":  # the started event carries a MAC, which the forwarder checks
        monkeypatch.setenv(ENV_KEY, "s" * 64)
        stack.env[ENV_KEY] = "s" * 64
    forwarder = stack.forwarder(redis_server.url)
    stack.worker(redis_server.url, rq=mode == "rq")
    trace = tmp_path / "trace"
    job = Queue("default", journal_dir).enqueue("tests.tasks.traced", str(trace), "t1", 4.0)
    deadline = time.monotonic() + 30
    seen: list[str] = []
    while time.monotonic() < deadline:
        found = fetch_job(job.id, journal=journal_dir)
        assert found is not None
        if not seen or seen[-1] != found.status:
            seen.append(found.status)
        if found.status == "started":
            break
        time.sleep(0.02)
    assert seen[-1] == "started", seen
    assert "done t1" not in (trace.read_text() if trace.exists() else "")  # it still runs
    assert found.attempt == 1
    assert found.started_at is not None
    assert found.enqueued_at <= found.started_at <= time.time()
    assert found.ended_at is None
    assert found.result is None
    assert found.wait(timeout=60) == "t1"
    assert (found.status, found.attempt) == ("finished", 1)
    assert found.ended_at is not None
    assert found.started_at <= found.ended_at
    assert "dropping" not in forwarder.log_path.read_text()  # no event refused or garbled
