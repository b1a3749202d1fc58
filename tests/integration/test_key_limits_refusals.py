"""A claim's refusal replayed (or forged, signing off) for a run that goes on: the limits tier.

The reviewer's reproductions of issue 30's refusal path (docs/forwarder.md, "Limits per key"):
someone who may write the owner's event stream adds a refusal for a running attempt, and the
forwarder takes the job back into its run table. Neither its retry's backoff nor a cancel may
be cut short by that (``hybridq.forwarder.refusals``). Signing off here: with signing on, the
forwarder believes only a refusal the worker signed (``tests/unit/test_refusals.py``), and a
genuine one replayed lands here. About 25 s in all (``-m limits``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hybridq import Queue, Retry, cancel
from hybridq.protocol import StartedEvent, keys
from hybridq.protocol.delivery import Delivery
from hybridq.testing.embedded import RedisServer

from tests.integration.test_worker_pool import pool
from tests.integration.test_worker_redis import Stack, lines_of, redis_client, stack, wait_line
from tests.support.rqwork import job_data

__all__ = ["stack"]  # the fixture, used by this module's tests


def refuse_while_running(redis_server: RedisServer, job_id: str) -> None:
    """Add a refusal of the job's current delivery (its started event with ``r``), as a writer could."""
    with redis_client(redis_server) as conn:
        raw = conn.hget(keys.rq_job(job_id), "data")
        d = Delivery.from_json(job_data(raw)[2][0])
        body = StartedEvent.of(d, time.time()).to_json()
        conn.xadd(keys.events(d.owner), {"e": json.dumps(body), "r": "limited: concurrency"})


@pytest.mark.limits
def test_a_refusal_of_a_running_attempt_leaves_its_retry_to_its_backoff(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path
) -> None:
    stack.forwarder(redis_server.url, "--limit", "k=concurrency:1")
    effects = tmp_path / "effects.txt"
    job = Queue("default", journal_dir).enqueue(
        "tests.tasks.traced_fail",
        str(effects),
        "R",
        3.0,
        limit_key="k",
        retry=Retry(max_attempts=2, backoff_s=120.0, jitter=False),
    )
    pool(stack, redis_server.url, "--processes", "1", "--threads", "2")
    wait_line(effects, "start", "R", timeout=30)
    refuse_while_running(redis_server, job.id)
    failed = wait_line(effects, "done", "R", timeout=30)
    time.sleep(max(0.0, failed.at + 5.0 - time.time()))  # before: the retry started 0.03 s after
    assert len(lines_of(effects, "start", "R")) == 1, "the retry ran before its 120 s backoff"


@pytest.mark.limits
def test_a_cancel_after_a_refusal_of_a_running_attempt_waits_for_the_run(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path
) -> None:
    stack.forwarder(redis_server.url, "--limit", "k=concurrency:1")
    effects = tmp_path / "effects.txt"
    job = Queue("default", journal_dir).enqueue("tests.tasks.traced", str(effects), "C", 6.0, limit_key="k")
    pool(stack, redis_server.url, "--processes", "1", "--threads", "2")
    wait_line(effects, "start", "C", timeout=30)
    refuse_while_running(redis_server, job.id)
    time.sleep(1.5)  # a step or two: the job is taken back into the run table
    cancel([job.id], journal_dir)
    seen, deadline = set(), time.monotonic() + 30
    while not lines_of(effects, "done", "C"):
        assert time.monotonic() < deadline, "the task never ended"
        seen.add(job.status)  # before: "cancelled" a second after, while the task ran on
        time.sleep(0.1)
    assert "cancelled" not in seen, f"settled cancelled while its run went on: {seen}"
