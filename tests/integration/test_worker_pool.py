"""``hybridq worker``'s pool (its default): concurrency, isolation, timeouts, recycling, RQ's view.

Real processes, as in test_worker_redis.py: ``python -m hybridq forward --lease 2``, ``python -m
hybridq worker`` (the pool) and a private redis-server; tasks (``tests.tasks``) append fsync'd
lines to an effects file, so what ran is counted without trusting hybridq.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rq
from hybridq import Queue, Retry, failed_jobs
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import Delivery
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from rq.serializers import JSONSerializer

from tests.integration.test_worker_redis import (
    LEASE_S,
    Stack,
    alive,
    all_succeeded,
    duplicate_executions,
    read_effects,
    redis_client,
    stack,
    wait_line,
    wait_status,
)
from tests.support.processes import ForwarderProcess, WorkerProcess, wait_until

__all__ = ["stack"]  # the fixture, used by this module's tests


def pool(stack: Stack, redis_url: str, *options: str) -> WorkerProcess:
    """``python -m hybridq worker OPTIONS... default`` (the pool), once it listens."""
    worker = stack._start(
        [sys.executable, "-m", "hybridq", "worker", "--redis", redis_url, *options, "default"]
    )
    wait_until(lambda: "Listening on" in worker.log(), timeout=30, what="the pool to listen")
    return worker


@dataclass
class Setup:
    """What most tests here start with: an effects file, a forwarder, a pool, a queue."""

    effects: Path
    forwarder: ForwarderProcess
    worker: WorkerProcess
    queue: Queue


def setup(stack: Stack, server: RedisServer, journal_dir: Path, tmp_path: Path, *options: str) -> Setup:
    """A forwarder and ``hybridq worker OPTIONS...`` (the pool) on ``server``; a queue of ``journal_dir``."""
    forwarder = stack.forwarder(server.url)
    return Setup(
        tmp_path / "effects.txt", forwarder, pool(stack, server.url, *options), Queue("default", journal_dir)
    )


def starts_and_dones(effects: Path) -> tuple[collections.Counter[str], collections.Counter[str]]:
    lines = read_effects(effects)
    return (
        collections.Counter(x.token for x in lines if x.kind == "start"),
        collections.Counter(x.token for x in lines if x.kind == "done"),
    )


def test_the_pool_runs_a_process_per_core_and_jobs_concurrently_on_threads(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "8")
    effects, forwarder, worker, queue = run.effects, run.forwarder, run.worker, run.queue
    tokens = [f"t{i}" for i in range(8)]
    started = time.monotonic()
    for token in tokens:
        queue.enqueue("tests.tasks.traced", str(effects), token, 1.0)
    wait_status(journal_dir, subprocess_env, all_succeeded(8), what="8 jobs", alive=alive(forwarder, worker))
    took = time.monotonic() - started
    lines = read_effects(effects)
    assert {x.pid for x in lines} == set(worker.children()), "the jobs ran in the pool's one process"
    first_done = min(x.at for x in lines if x.kind == "done")
    overlapping = sum(1 for x in lines if x.kind == "start" and x.at < first_done)
    assert overlapping >= 4, f"only {overlapping} of 8 one-second jobs ran at once on 8 threads"
    assert took < 8, f"8 one-second jobs on 8 threads took {took:.1f} s"


def test_a_task_that_kills_its_process_costs_the_others_one_lease_at_most(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "4")
    effects, forwarder, worker, queue = run.effects, run.forwarder, run.worker, run.queue
    queue.enqueue("tests.tasks.traced", str(effects), "before", 0.5)
    victim = wait_line(effects, "start", "before").pid
    queue.enqueue("tests.tasks.crash", str(effects), "crash", retry=Retry(max_attempts=1))
    wait_line(effects, "start", "crash")
    crashed_at = time.time()
    tokens = [f"after-{i}" for i in range(6)]
    for token in tokens:
        queue.enqueue("tests.tasks.traced", str(effects), token)
    for token in [*tokens, "before"]:  # "before" ran beside the crash: delivered again
        wait_line(effects, "done", token, timeout=30)
    worker.assert_alive()  # the pool survived; it replaced the process
    assert "died (killed by signal 9)" in worker.log()
    assert victim not in worker.children()
    served = max(x.at for x in read_effects(effects) if x.kind == "done") - crashed_at
    assert served < LEASE_S * 3 + 10, f"the other jobs waited {served:.1f} s"
    _starts, dones = starts_and_dones(effects)
    assert all(dones[t] == 1 for t in [*tokens, "before"]), dones
    assert duplicate_executions(read_effects(effects)) == 0
    del forwarder


def test_a_task_past_its_timeout_fails_with_jobtimeoutexception_and_the_process_stays(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "2")
    effects, forwarder, worker, queue = run.effects, run.forwarder, run.worker, run.queue
    queue.enqueue("tests.tasks.spin", str(effects), "spin", job_timeout=1, retry=Retry(max_attempts=1))
    pid = wait_line(effects, "start", "spin").pid
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["failed"] == 1,
        what="the timeout",
        alive=alive(forwarder, worker),
    )
    assert status["succeeded"] == 0
    (failure,) = failed_jobs(str(journal_dir))
    assert "JobTimeoutException" in (failure.error or ""), failure.error
    assert "did not stop" not in (failure.error or "")
    assert worker.children() == [pid], "an exception stopped the task: its process keeps serving"


def test_a_task_stuck_past_its_timeout_runs_again_only_once_its_process_is_gone(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Nothing is recorded while the stuck thread may still act: no retry runs beside it."""
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "4")
    effects, forwarder, worker, queue = run.effects, run.forwarder, run.worker, run.queue
    retry = Retry(max_attempts=3, backoff_s=0.1, jitter=False)
    queue.enqueue("tests.tasks.stuck", str(effects), "stuck", job_timeout=1, retry=retry)
    pid = wait_line(effects, "start", "stuck").pid
    queue.enqueue("tests.tasks.traced", str(effects), "neighbour", 6.0)  # runs beside it, past it
    wait_line(effects, "start", "neighbour")
    pool(stack, redis_server.url, "--processes", "1")  # free to take a retry at once
    wait_line(effects, "done", "neighbour", timeout=30)
    wait_until(lambda: worker.children() and pid not in worker.children(), timeout=15, what="a fresh process")
    gone_at = time.time()
    assert "exiting for a fresh process" in worker.log()
    again = wait_line(effects, "start", "stuck", attempt=2, timeout=30)  # its lease lapsed: a lost run
    assert again.pid != pid
    assert again.at > gone_at - 0.5, "the next run started while the stuck one could still act"
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["succeeded"] == 1,
        what="the neighbour",
        alive=alive(forwarder, worker),
    )
    assert status["failed"] == 0, "no timeout recorded while the stuck thread ran"
    starts, dones = starts_and_dones(effects)
    assert (starts["neighbour"], dones["neighbour"]) == (1, 1), "its neighbour ran once, to its end"


def test_a_job_waiting_for_a_thread_keeps_its_lease(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """A job the pool took ahead (up to twice its threads) waits longer than the lease: not lost."""
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "1")
    tokens = ["a", "b", "c"]
    for token in tokens:
        run.queue.enqueue("tests.tasks.traced", str(run.effects), token, LEASE_S * 2)
    wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(3),
        what="3 jobs",
        timeout=60,
        alive=alive(run.forwarder, run.worker),
    )
    starts, dones = starts_and_dones(run.effects)
    assert starts == dones == collections.Counter(tokens), (starts, dones)
    assert "vanished" not in run.worker.log()


def test_a_plain_rq_job_waits_until_nothing_else_runs_in_its_process(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """RQ's code runs it in the main thread: meanwhile no job that finished would be ended."""
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "2")
    run.queue.enqueue("tests.tasks.traced", str(run.effects), "first", 2.0)
    wait_line(run.effects, "start", "first")
    with redis_client(redis_server) as client:
        rq_queue = rq.Queue("default", connection=client, serializer=JSONSerializer)
        rq_queue.enqueue("tests.tasks.traced", str(run.effects), "plain")
    plain = wait_line(run.effects, "start", "plain", timeout=30)
    first_done = wait_line(run.effects, "done", "first")
    assert plain.at >= first_done.at, "RQ's code ran while a pool job was still running"


def test_max_jobs_and_max_memory_replace_processes(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run = setup(
        stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "1", "--max-jobs", "3"
    )
    effects, forwarder, worker, queue = run.effects, run.forwarder, run.worker, run.queue
    for i in range(7):
        queue.enqueue("tests.tasks.traced", str(effects), f"j{i}")
    wait_status(journal_dir, subprocess_env, all_succeeded(7), what="7 jobs", alive=alive(forwarder, worker))
    pids = collections.Counter(x.pid for x in read_effects(effects) if x.kind == "done")
    assert len(pids) >= 3, pids
    assert max(pids.values()) <= 3, pids
    worker.kill()

    hogs = pool(stack, redis_server.url, "--processes", "1", "--threads", "1", "--max-memory", "150")
    for i in range(3):
        queue.enqueue("tests.tasks.hog", str(effects), f"hog{i}", 200)
    wait_status(journal_dir, subprocess_env, all_succeeded(10), what="3 hogs", alive=alive(forwarder, hogs))
    hog_pids = {x.pid for x in read_effects(effects) if x.token.startswith("hog")}
    assert len(hog_pids) >= 2, f"the hogs' process was replaced: {hog_pids}"
    assert "(--max-memory 150)" in hogs.log()


def test_async_tasks_run_concurrently_on_the_event_loop(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    run = setup(
        stack,
        redis_server,
        journal_dir,
        tmp_path,
        "--processes",
        "1",
        "--threads",
        "1",
        "--async-concurrency",
        "20",
    )
    effects, forwarder, worker, queue = run.effects, run.forwarder, run.worker, run.queue
    ids = [queue.enqueue("tests.tasks.atraced", str(effects), f"a{i}", 1.0).id for i in range(20)]
    queue.enqueue(
        "tests.tasks.atraced", str(effects), "late", 5.0, job_timeout=1, retry=Retry(max_attempts=1)
    )
    wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["succeeded"] == 20 and s["failed"] == 1,
        what="20 async jobs and a timeout",
        alive=alive(forwarder, worker),
    )
    lines = read_effects(effects)
    first_done = min(x.at for x in lines if x.kind == "done")
    overlapping = sum(1 for x in lines if x.kind == "start" and x.at < first_done)
    assert overlapping >= 10, f"only {overlapping} of 20 one-second async jobs ran at once"
    assert all(x.attempt == 1 for x in lines), "current_job() is set inside an async task"
    (failure,) = failed_jobs(str(journal_dir))
    assert "JobTimeoutException" in (failure.error or "")
    with redis_client(redis_server) as client:
        job = rq.job.Job.fetch(ids[0], connection=client, serializer=JSONSerializer)
        assert job.return_value() == "a0"


def test_rq_sees_pool_jobs_as_its_own_and_plain_rq_jobs_share_the_queue(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Jobs stay RQ jobs: statuses, registries, results, executions; a plain RQ job runs too."""
    run = setup(
        stack, redis_server, journal_dir, tmp_path, "--processes", "1", "--threads", "4", "--name", "pw"
    )
    effects, forwarder, worker, queue = run.effects, run.forwarder, run.worker, run.queue
    slow = queue.enqueue("tests.tasks.traced", str(effects), "slow", 3.0).id
    wait_line(effects, "start", "slow")
    with redis_client(redis_server) as client:
        started = rq.registry.StartedJobRegistry("default", connection=client)
        # Its execution's records: at its process's next turn (at most about 0.5 s after the start).
        wait_until(lambda: started.get_job_ids() == [slow], timeout=5, what="the started registry")
        job = rq.job.Job.fetch(slow, connection=client, serializer=JSONSerializer)
        assert job.get_status() == "started"
        assert job.worker_name
        assert job.worker_name.startswith("pw.0.")
        workers = rq.Worker.all(connection=client)
        assert [w.name for w in workers] == [job.worker_name]
        plain = rq.Queue("default", connection=client, serializer=JSONSerializer).enqueue(
            "tests.tasks.add", 2, 3
        )
    ok = queue.enqueue("tests.tasks.add", 1, 2).id
    bad = queue.enqueue("tests.tasks.fail", retry=Retry(max_attempts=1)).id
    wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["succeeded"] == 2 and s["failed"] == 1,
        what="the jobs",
        alive=alive(forwarder, worker),
    )
    with redis_client(redis_server) as client:

        def get(job_id: str) -> rq.job.Job:
            return rq.job.Job.fetch(job_id, connection=client, serializer=JSONSerializer)

        wait_until(lambda: get(plain.id).get_status() == "finished", timeout=10, what="the plain RQ job")
        assert get(plain.id).return_value() == 5
        assert get(ok).get_status() == "finished"
        assert get(ok).return_value() == 3
        assert get(slow).get_status() == "finished"
        assert get(slow).ended_at is not None
        failed_job = get(bad)
        assert failed_job.get_status() == "failed"
        result = failed_job.latest_result()
        assert result is not None
        assert "this task always fails" in (result.exc_string or "")
        assert set(rq.registry.FinishedJobRegistry("default", connection=client).get_job_ids()) >= {ok, slow}
        assert rq.registry.FailedJobRegistry("default", connection=client).get_job_ids() == [bad]
        assert rq.registry.StartedJobRegistry("default", connection=client).get_job_ids() == []
        assert not client.keys("rq:execution:*"), "every execution ended"
        stats: dict[str, Any] = {w.name: w for w in rq.Worker.all(connection=client)}
        (w,) = stats.values()
        assert w.successful_job_count >= 3
        assert w.failed_job_count >= 1


def test_one_jobs_failure_in_a_batch_is_not_anothers(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Jobs queued before the pool starts go in batches; each ends as its own task did."""
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(redis_server.url)
    queue = Queue("default", journal_dir)
    kinds = ["ok" if i % 3 else "bad" for i in range(30)]
    for i, kind in enumerate(kinds):
        if kind == "ok":
            queue.enqueue("tests.tasks.traced", str(effects), f"ok{i}")
        else:
            queue.enqueue("tests.tasks.fail", retry=Retry(max_attempts=1))
    with redis_client(redis_server) as client:
        wait_until(lambda: client.llen("rq:queue:default") == 30, what="30 queued jobs")
    worker = pool(stack, redis_server.url, "--processes", "1", "--threads", "8")
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["pending"] == 0 and s["accepted"] == 30,
        what="every job",
        alive=alive(forwarder, worker),
    )
    assert status["succeeded"] == kinds.count("ok")
    assert status["failed"] == kinds.count("bad")
    _starts, dones = starts_and_dones(effects)
    assert all(n == 1 for n in dones.values())
    assert len(dones) == kinds.count("ok")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_pools_processes_stop_when_the_pool_process_is_killed(
    redis_server: RedisServer, stack: Stack
) -> None:
    """A supervisor's SIGKILL of the pool leaves no orphan taking jobs."""
    worker = pool(stack, redis_server.url, "--processes", "2")
    children: list[int] = wait_until(
        lambda: worker.children() if len(worker.children()) == 2 else [], what="2 processes"
    )
    worker.proc.kill()
    worker.proc.wait()
    wait_until(lambda: not any(_running(pid) for pid in children), timeout=15, what="the orphans to stop")


def test_with_scheduler_runs_rqs_scheduler_for_plain_rq_jobs(redis_server: RedisServer, stack: Stack) -> None:
    """``--with-scheduler`` is RQ's: a plain RQ job scheduled on the queue is queued, then run."""
    import datetime as dt

    worker = pool(stack, redis_server.url, "--processes", "1", "--with-scheduler")
    with redis_client(redis_server) as client:
        rq_queue = rq.Queue("default", connection=client, serializer=JSONSerializer)
        job = rq_queue.enqueue_in(dt.timedelta(seconds=1), "tests.tasks.add", 20, 22)
        assert job.get_status() == "scheduled"
        wait_until(lambda: job.get_status(refresh=True) == "finished", timeout=30, what="the scheduled job")
        assert job.return_value() == 42
    worker.assert_alive()


def test_the_pool_stays_subscribed_to_its_command_channel(redis_server: RedisServer) -> None:
    """The pool's subscription outlives the call that made it: a shutdown command sent any time after is heard.

    It was lost when sent between the pool's first two turns: redis-py closed the subscription's
    connection with the client object that made it, and resubscribed a turn later (CI failure).
    """
    import gc
    import json

    from hybridq.worker.pool import PoolOptions, _Pool

    pool_ = _Pool(["default"], redis_server.url, PoolOptions(processes=1), burst=False, name="w-sub")
    pool_._commands()  # subscribes
    gc.collect()
    with redis_client(redis_server) as client:
        assert client.pubsub_numsub("rq:pubsub:w-sub") == [(b"rq:pubsub:w-sub", 1)]
        assert client.publish("rq:pubsub:w-sub", json.dumps({"command": "shutdown"})) == 1
    wait_until(lambda: pool_._commands() or pool_.commanded, timeout=5, what="the command")
    assert pool_.stopping == 1
    pool_.pubsub.close()


def test_async_tasks_are_awaited_by_rqs_loop_too(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """``--rq``, ``--simple`` and a plain ``rq worker`` run an ``async def`` task on an event loop of its own.

    They called it and stored the coroutine's repr() as its result: the task never ran.
    """
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(redis_server.url)
    worker = stack.worker(redis_server.url, simple=True)
    queue = Queue("default", journal_dir)
    job = queue.enqueue("tests.tasks.atraced", str(effects), "a1", 0.1)
    wait_status(
        journal_dir, subprocess_env, all_succeeded(1), what="the async job", alive=alive(forwarder, worker)
    )
    assert [x.token for x in read_effects(effects) if x.kind == "done"] == ["a1"]
    with redis_client(redis_server) as client:
        assert rq.job.Job.fetch(job.id, connection=client, serializer=JSONSerializer).return_value() == "a1"


def test_a_job_that_must_run_alone_sharing_a_key_with_one_beside_it_does_not_deadlock(
    redis_server: RedisServer, stack: Stack, tmp_path: Path
) -> None:
    """Issue 26, item 3: it was claimed ahead, and its neighbour polled for that lease forever.

    I (a run of it vanished before: it runs alone) and Y share an idempotency key and are taken
    together; Z comes later. Before the fix, I held the key's lease while it waited for the
    process to empty, and Y, polling for that lease in a thread, kept it from emptying.
    """
    effects = tmp_path / "effects.txt"

    def delivery(token: str, key: str, *, lost: int = 0, sleep_s: float = 0.0) -> Delivery:
        job_id = new_job_id(time.time())
        env = Envelope(
            id=job_id,
            func="tests.tasks.traced",
            args=(str(effects), token, sleep_s),
            queue="default",
            idempotency_key=key,
            created_at=time.time(),
        )
        return Delivery(env, "deadlock-owner", ("w", 0, 0), lease_s=LEASE_S, lost=lost)

    transport = RQTransport(redis_server.url)
    try:
        transport.push([delivery("I", "K", lost=1), delivery("Y", "K", sleep_s=1.0)])
        pool(stack, redis_server.url, "--processes", "1", "--threads", "2")
        wait_until(
            lambda: {"done I", "done Y"} & {" ".join(line.split()[:2]) for line in _lines(effects)},
            timeout=30,
            what="a run for the key K",
        )
        transport.push([delivery("Z", "Z")])
        wait_line(effects, "done", "Z", timeout=30)
    finally:
        transport.close()
    starts, _dones = starts_and_dones(effects)
    assert starts["Y"] + starts["I"] == 1, f"one run for the key K: {starts}"


def test_a_pool_started_before_redis_waits_quietly_then_serves(
    make_redis_server: Any, stack: Stack, tmp_path: Path
) -> None:
    """Issue 27: its processes died with tracebacks, again and again, backing off to 30 s."""
    server = make_redis_server(start=False)  # its port chosen, nothing listening yet
    worker = stack._start([sys.executable, "-m", "hybridq", "worker", "--redis", server.url, "default"])
    time.sleep(6.0)
    log = worker.log()
    assert "Traceback" not in log, log[-3000:]
    assert "died" not in log, log[-3000:]
    said = [line for line in log.splitlines() if "Redis unavailable" in line]
    assert len(said) == 1, f"one line says it waits for Redis: {said}"
    server.start()
    effects = tmp_path / "effects.txt"
    transport = RQTransport(server.url)
    try:
        env = Envelope(
            id=new_job_id(time.time()),
            func="tests.tasks.record",
            args=(str(effects), "after"),
            queue="default",
            idempotency_key="after",
            created_at=time.time(),
        )
        transport.push([Delivery(env, "early-owner", ("w", 0, 0), lease_s=LEASE_S)])
        wait_until(lambda: effects.exists() and "after" in effects.read_text(), timeout=30, what="the job")
    finally:
        transport.close()
    worker.assert_alive()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_pool_process_freezes_what_it_inherited_and_collects_less_often(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """About 35 µs of a no-op job's ~260 went to the collector (docs/benchmarks.md)."""
    run = setup(stack, redis_server, journal_dir, tmp_path, "--processes", "1")
    out = tmp_path / "gc.txt"
    run.queue.enqueue("tests.tasks.gc_pace", str(out))
    wait_status(
        journal_dir, subprocess_env, all_succeeded(1), what="1 job", alive=alive(run.forwarder, run.worker)
    )
    threshold, frozen = map(int, out.read_text().split())
    assert threshold >= 10_000
    assert frozen > 1_000, "the modules imported before the fork are frozen"
