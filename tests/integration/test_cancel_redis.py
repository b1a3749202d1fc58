"""Cancellation with real processes (issue 17, item 6): ``hybridq forward --lease 2``, the pool
worker and a private redis-server, as in test_worker_pool.py. Tasks append fsync'd lines to an
effects file (tests.tasks), so what ran is counted without trusting hybridq.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hybridq import Queue, cancel, failed_jobs, requeue
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Probe
from hybridq.transport.rq import RQTransport

from tests.integration.test_worker_pool import Setup, pool, setup, starts_and_dones
from tests.integration.test_worker_protocol import deliver, envelope, events
from tests.integration.test_worker_redis import (
    Stack,
    alive,
    lines_of,
    redis_client,
    stack,
    wait_line,
    wait_status,
)
from tests.support.processes import wait_until
from tests.support.rqwork import Work

__all__ = ["stack"]  # the fixture, used by this module's tests


def cancelled(n: int):
    return lambda s: s.get("cancelled") == n and s["cancels_pending"] == 0


def test_a_running_cooperative_task_stops_with_cancelled(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    run: Setup = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "2")
    job = run.queue.enqueue("tests.tasks.cooperative", str(run.effects), "coop")
    wait_line(run.effects, "start", "coop")
    asked = time.monotonic()
    assert [r.state for r in cancel([job.id], journal_dir)] == ["requested"]
    status = wait_status(
        journal_dir, subprocess_env, cancelled(1), what="the cancel", alive=alive(run.forwarder, run.worker)
    )
    took = time.monotonic() - asked
    figures(f"CANCEL cooperative: settled {took:.2f} s after the request (lease 2 s)")
    assert (status["succeeded"], status["failed"], status["pending"]) == (
        0,
        1,
        0,
    )  # failed counts the cancelled job (ended without success)
    assert lines_of(run.effects, "stopped", "coop"), "the task saw the cancel and stopped itself"
    assert not lines_of(run.effects, "done", "coop")
    assert job.get_status() == "cancelled"
    assert failed_jobs(str(journal_dir)) == []
    assert took < 10, f"the cancel took {took:.1f} s to stop a cooperative task"
    assert [r.state for r in cancel([job.id], journal_dir)] == ["cancelled"]  # twice: fine


def test_a_task_ignoring_the_cancel_is_stopped_after_the_grace_and_the_pool_keeps_serving(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    run = setup(
        stack,
        redis_server,
        journal_dir,
        tmp_path,
        "--processes",
        "1",
        "--threads",
        "2",
        "--cancel-grace",
        "1",
    )
    job = run.queue.enqueue("tests.tasks.spin", str(run.effects), "spin")  # loops, never looks
    pid = wait_line(run.effects, "start", "spin").pid
    asked = time.monotonic()
    cancel([job.id], journal_dir)
    wait_status(
        journal_dir,
        subprocess_env,
        cancelled(1),
        what="the hard stop",
        alive=alive(run.forwarder, run.worker),
    )
    figures(f"CANCEL hard stop: settled {time.monotonic() - asked:.2f} s after the request (grace 1 s)")
    assert job.get_status() == "cancelled"
    assert "cancelled, still running after its grace period" in run.worker.log()
    after = run.queue.enqueue("tests.tasks.traced", str(run.effects), "after")
    wait_line(run.effects, "done", "after", timeout=30)
    assert after.get_status() in ("forwarded", "finished")
    assert run.worker.children() == [pid], "an exception stopped the task: its process keeps serving"
    assert failed_jobs(str(journal_dir)) == []


def test_a_queued_job_never_runs_and_a_redis_wipe_does_not_bring_it_back(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "1")
    run.queue.enqueue("tests.tasks.traced", str(run.effects), "blocker", 4.0)
    wait_line(run.effects, "start", "blocker")
    waiting = [run.queue.enqueue("tests.tasks.traced", str(run.effects), f"w{i}") for i in range(4)]
    # Some wait in Redis's queue, some were taken ahead by the pool (claimed, waiting for a thread).
    assert {r.state for r in cancel([j.id for j in waiting], journal_dir)} == {"requested"}
    wait_status(
        journal_dir, subprocess_env, cancelled(4), what="the cancels", alive=alive(run.forwarder, run.worker)
    )
    wait_line(run.effects, "done", "blocker", timeout=30)
    redis_server.flushall()  # Redis loses everything, the cancel marks with it
    late = run.queue.enqueue("tests.tasks.traced", str(run.effects), "late")
    wait_line(run.effects, "done", "late", timeout=30)
    pool(stack, redis_server.url, "--processes", "1")  # one more, to take anything brought back
    time.sleep(3)
    starts, _dones = starts_and_dones(run.effects)
    assert all(starts[f"w{i}"] == 0 for i in range(4)), starts
    assert [j.get_status() for j in waiting] == ["cancelled"] * 4
    wait_until(lambda: late.get_status() == "finished", timeout=30, what="the late job's outcome")


def test_an_async_task_ignoring_the_cancel_is_cancelled_after_the_grace(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--cancel-grace", "1")
    job = run.queue.enqueue("tests.tasks.atraced", str(run.effects), "asleep", 60.0)
    wait_line(run.effects, "start", "asleep")
    cancel([job.id], journal_dir)
    wait_status(
        journal_dir,
        subprocess_env,
        cancelled(1),
        what="the async stop",
        alive=alive(run.forwarder, run.worker),
    )
    assert job.get_status() == "cancelled"
    assert not lines_of(run.effects, "done", "asleep")
    assert failed_jobs(str(journal_dir)) == []


# -- the Redis side, step by step (RQ's SimpleWorker and hybridq's, as in test_worker_protocol) --


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def test_a_job_marked_cancelled_is_off_its_queue_and_a_worker_that_took_it_runs_nothing(
    transport: RQTransport, work: Work, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.txt"
    env = envelope("tests.tasks.record", args=(str(effects), "x"))
    deliver(transport, env)
    conn = transport.connection
    assert transport.cancel([Probe(env.id, env.key_id, env.queue)], key_ttl_s=60) == [False]
    assert conn.llen(keys.rq_queue("default")) == 0
    assert conn.hget(keys.rq_job(env.id), "status") == b"canceled"
    conn.rpush(keys.rq_queue("default"), env.id)  # a worker that had taken it anyway
    work(transport)
    assert not effects.exists(), "the claim found the mark: the task did not run"
    assert events(transport) == []  # the forwarder settles it; the worker reports nothing


def test_a_lease_renewal_sees_the_cancel_mark(transport: RQTransport) -> None:
    from hybridq.worker.scripts import renew_many

    env = envelope()
    deliver(transport, env)
    conn = transport.connection
    lease, job = keys.lease(env.key_id), keys.rq_job(env.id)
    conn.set(lease, "token", px=10_000)
    assert renew_many(conn, [(lease, "token", 10_000)], [job]) == [1]
    assert transport.cancel([Probe(env.id, env.key_id, env.queue)], key_ttl_s=60) == [True]  # running
    assert renew_many(conn, [(lease, "token", 10_000)], [job]) == [3]  # renewed, and cancelled
    assert renew_many(conn, [(lease, "other", 10_000)], [job]) == [2]
    assert renew_many(conn, [(lease, "token", 10_000)]) == [1]  # without job keys: as before


def test_under_rqs_worker_loop_a_cooperative_task_stops_with_cancelled(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``hybridq worker --rq``: a forked work-horse per job; its own lease renewal sees the cancel."""
    forwarder = stack.forwarder(redis_server.url)
    worker = stack.worker(redis_server.url, rq=True)
    effects = tmp_path / "effects.txt"
    job = Queue("default", journal_dir).enqueue("tests.tasks.cooperative", str(effects), "coop")
    wait_line(effects, "start", "coop")
    cancel([job.id], journal_dir)
    wait_status(journal_dir, subprocess_env, cancelled(1), what="the cancel", alive=alive(forwarder, worker))
    assert lines_of(effects, "stopped", "coop")
    assert job.get_status() == "cancelled"
    assert failed_jobs(str(journal_dir)) == []


def test_under_rqs_worker_loop_rqs_stop_job_command_ends_a_cancelled_job(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """No grace-period stop under ``--rq``: RQ's stop-job command kills the work-horse by hand."""
    from rq.command import send_stop_job_command

    forwarder = stack.forwarder(redis_server.url)
    worker = stack.worker(redis_server.url, rq=True)
    effects = tmp_path / "effects.txt"
    job = Queue("default", journal_dir).enqueue("tests.tasks.spin", str(effects), "spin")
    wait_line(effects, "start", "spin")
    cancel([job.id], journal_dir)
    time.sleep(1.5)  # the forwarder marked it; the task ignores the mark
    with redis_client(redis_server) as client:
        send_stop_job_command(client, job.id)
    wait_status(journal_dir, subprocess_env, cancelled(1), what="the cancel", alive=alive(forwarder, worker))
    assert job.get_status() == "cancelled"
    assert failed_jobs(str(journal_dir)) == []


def test_a_cancel_mark_no_cancel_asked_for_fails_the_job_for_requeue_instead_of_ending_it(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Issue 27 (MEDIUM): ``HSET rq:job:ID hybridq_cancel 1`` by a Redis writer stopped a running
    job, and its worker's genuine ``cancelled`` event ended it for good (not listed, not
    requeueable). The forwarder settles ``cancelled`` only for a cancel it holds: this one is
    recorded failed, listed with why, and a requeue runs it to the end."""
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "2")
    job = run.queue.enqueue("tests.tasks.cooperative", str(run.effects), "forged", 3.0)
    wait_line(run.effects, "start", "forged")
    with redis_client(redis_server) as client:  # a Redis writer, not hybridq cancel
        client.hset(keys.rq_job(job.id), "hybridq_cancel", "1")
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["failed"] == 1 and s["pending"] == 0,
        what="the stopped job's outcome",
        alive=alive(run.forwarder, run.worker),
    )
    assert status["cancelled"] == 0
    assert lines_of(run.effects, "stopped", "forged"), "the worker stopped it (the mark is in Redis)"
    assert job.get_status() == "failed"
    [failed] = failed_jobs(str(journal_dir))
    assert failed.id == job.id
    assert "no cancel was asked for" in (failed.error or "")
    assert "forged cancel mark" in run.forwarder.log()
    [again] = requeue([job.id], str(journal_dir))
    wait_line(run.effects, "done", "forged", timeout=60)
    wait_until(lambda: again.get_status() == "finished", timeout=30, what="the requeued job's outcome")


def test_a_cancel_marks_a_job_in_a_redis_over_its_maxmemory(transport: RQTransport) -> None:
    # A push cut short by an OOM reply can leave a copy in a full Redis: the mark must reach it.
    env = envelope("tests.tasks.add", args=(1, 2))
    deliver(transport, env)
    conn = transport.connection
    policy = conn.config_get("maxmemory-policy")["maxmemory-policy"]
    conn.config_set("maxmemory-policy", "noeviction")
    conn.config_set("maxmemory", 1)  # over the limit: a plain write is refused
    try:
        assert transport.cancel([Probe(env.id, env.key_id, env.queue)], key_ttl_s=60) == [False]
    finally:
        conn.config_set("maxmemory", 0)
        conn.config_set("maxmemory-policy", policy)
    assert conn.hget(keys.rq_job(env.id), "hybridq_cancel") == b"1"
    assert conn.llen(keys.rq_queue("default")) == 0
