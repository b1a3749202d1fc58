"""``job.status`` ``started`` with real processes (issue 17 item 1).

A forwarder, a worker (the pool, and RQ's worker with hybridq's pipelined claim) and a private
redis-server: the claim script adds a started event to the forwarder's stream, and
``fetch_job`` reads ``started`` from the lookup index while the task runs, then ``finished``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hybridq import Queue, fetch_job
from hybridq.security.signing import ENV_KEY
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


def test_a_task_whose_runs_are_quick_stops_sending_started_events(
    redis_server: RedisServer, stack: Stack, journal_dir: Path
) -> None:
    """After STREAK quick runs in a worker process its claims send none (docs/worker.md)."""
    from hybridq.ledger.checkpoint import load_checkpoint
    from hybridq.protocol import keys
    from hybridq.worker.quick import STREAK

    jobs = 120
    queue = Queue("default", journal_dir)
    for i in range(jobs):
        queue.enqueue("tests.tasks.add", i, i)
    forwarder = stack.forwarder(redis_server.url)
    conn = redis_server.client()
    deadline = time.monotonic() + 30
    while conn.llen("rq:queue:default") < jobs:
        assert time.monotonic() < deadline, "the forwarder did not push the jobs"
        time.sleep(0.05)
    forwarder.terminate()  # the events stay in the stream, to be counted
    checkpoint = load_checkpoint(str(journal_dir))
    assert checkpoint is not None
    stream = keys.events(checkpoint.owner)
    stack.worker(redis_server.url)  # the pool: 2 processes here, each counting its own runs
    while time.monotonic() < deadline + 30:
        kinds = [_kind(fields) for _, fields in conn.xrange(stream)]
        if sum(1 for k in kinds if k != "started") >= jobs:
            break
        time.sleep(0.05)
    started = sum(1 for _, fields in conn.xrange(stream) if _kind(fields) == "started")
    outcomes = conn.xlen(stream) - started
    print(f"quick task: jobs={jobs} outcome_events={outcomes} started_events={started}")
    assert outcomes == jobs
    assert 1 <= started <= 4 * STREAK  # two processes, a few threads claiming before a run ends


def _kind(fields: dict[bytes, bytes]) -> str | None:
    kind = json.loads(fields[b"e"]).get("kind")  # the MAC, when signed, is a field beside it
    return kind if isinstance(kind, str) else None
