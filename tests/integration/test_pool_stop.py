"""S23: a pool process that stops as its jobs finish records every one of them (issue 26, item 2).

A process leaves on SIGTERM, ``--max-memory``, a job stuck past its timeout or its pool process
gone: it takes nothing more, lets its jobs finish, ends them and exits once none is pending. A job
that finished between the engine's last drain of its runner's ``done`` queue and its count of the
pending jobs was left unrecorded before the fix: its lease lapsed and it ran again. Here the
engine runs in this process and that moment is made to happen every time: the count waits for the
job to finish. Cheap (about a second per case).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import Delivery, keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Probe
from hybridq.transport.rq import RQTransport
from hybridq.worker import scripts
from hybridq.worker.engine import Engine
from hybridq.worker.perform import Performer
from hybridq.worker.run import release
from hybridq.worker.runner import Runner
from hybridq.worker.starter import Starter

from tests.integration.test_batch_scripts import take_one
from tests.support.processes import wait_until

QUEUE = "stop"
OWNER = "stop-owner"


def push_traced(
    url: str, effects: Path, token: str, sleep_s: float, key: str | None = None, lost: int = 0
) -> Envelope:
    transport = RQTransport(url)
    try:
        job_id = new_job_id(time.time())
        env = Envelope(
            id=job_id,
            func="tests.tasks.traced",
            args=(str(effects), token, sleep_s),
            queue=QUEUE,
            idempotency_key=key or job_id,
            created_at=time.time(),
        )
        transport.push([Delivery(env, OWNER, ("w", 0, 0), lease_s=2.0, lost=lost)])
    finally:
        transport.close()
    return env


def leave(engine: Engine, reason: str) -> None:
    if reason == "stopped":
        engine.stopping = True
    elif reason == "max-memory":
        engine.max_memory_mb = 1.0
    elif reason == "poisoned":
        engine.runner.poisoned = True
    else:  # its pool process gone
        engine.parent = -1


@pytest.mark.parametrize("reason", ["stopped", "max-memory", "poisoned", "parent-gone"])
def test_a_job_that_finishes_as_its_process_leaves_is_recorded(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reason: str
) -> None:
    effects = tmp_path / "effects.txt"
    env = push_traced(redis_server.url, effects, "T", 0.5)
    engine = Engine(redis_server.url, [QUEUE], threads=1, async_concurrency=1, name=f"stop-{os.getpid()}")
    runner = engine.runner
    real_leaving, real_pending = engine._leaving, runner.pending
    armed: list[bool] = []

    def leaving() -> str | None:
        if not armed and effects.exists() and "start T" in effects.read_text():
            leave(engine, reason)  # the job runs: the process is to leave now
            armed.append(True)
        return real_leaving()

    def pending() -> int:
        if armed:  # the count comes after the job finished, and after the engine's drain
            wait_until(lambda: runner.done.qsize() > 0 and real_pending() == 0, what="the job to end")
        return real_pending()

    monkeypatch.setattr(engine, "_leaving", leaving)
    monkeypatch.setattr(runner, "pending", pending)
    engine._connect()
    try:
        code: Any = engine._serve()
    finally:
        runner.close()
    assert code in (0, 3)
    assert "done T" in effects.read_text()
    with redis_server.client() as client:
        events = client.xrange(keys.events(OWNER))
        assert len(events) == 1, "the finished job's outcome was recorded before the exit"
        assert env.id.encode() in events[0][1][b"e"]
        assert client.get(keys.lease(env.key_id)) is None, "its lease freed, not left to lapse"


def test_a_job_run_alone_polling_a_busy_key_does_not_keep_a_stopped_process(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Review of i26-fix, item 4: SIGTERM while a job whose earlier run vanished polls its busy key.

    Such a job runs alone (``Engine._run_isolated``), whose wait did not tell the runner the
    process is leaving: the poll went on for as long as the key's holder renews its lease (here
    a minute), and the stopped process with it. It now gives the job up (delivered again).
    """
    effects = tmp_path / "effects.txt"
    env = push_traced(redis_server.url, effects, "Y", 0.0, key="K", lost=1)
    with redis_server.client() as client:
        client.set(keys.lease(env.key_id), "another run, renewed", px=60_000)
    engine = Engine(redis_server.url, [QUEUE], threads=1, async_concurrency=1, name=f"stop-{os.getpid()}")
    engine._connect()
    codes: list[Any] = []
    serving = threading.Thread(target=lambda: codes.append(engine._serve()), daemon=True)
    serving.start()
    try:
        wait_until(lambda: engine.runner.pending() > 0, what="the job to start alone")
        time.sleep(0.5)  # polling its key
        engine._stop(signal.SIGTERM, None)
        serving.join(timeout=5.0)
        stopped = not serving.is_alive()
    finally:
        with redis_server.client() as client:
            client.delete(keys.lease(env.key_id))  # before the fix: the poll claims it now, and ends
        serving.join(timeout=10.0)
        engine.runner.close()
    assert stopped, "the stopped process kept polling its isolated job's busy key"
    assert codes == [0]
    assert not effects.exists(), "Y did not start"


def test_a_job_given_up_after_an_earlier_claim_counts_as_a_vanished_run(redis_server: RedisServer) -> None:
    """Review of i26-fix, item 3: what docs/worker.md says of a job given up by a leaving process.

    Claimed at its start (the claim marks the job hash started), held up, its claim made again
    finds another run holding the key, and its process is leaving: given up, not run. The mark
    stays (the other run may be a delivery of this very run, whose vanishing must count), so
    once that lease is gone the forwarder's probe says ``orphaned`` (a ``lost`` entry, an attempt
    used), not ``stranded``: the docs said "taken, never started" before.
    """
    client, items = take_one(redis_server)
    item = items[0]
    conn = scripts.client(client)
    starter = Starter(conn, "w1", 120)
    performer = Performer(conn, starter=starter)
    runner = Runner(1, 1, performer.work, performer.work_async, performer.stuck)
    performer.runner = runner
    try:
        starter.exchange([], items, None)
        item.claimed_at -= 1.0  # held up since: made again before the call
        client.set(item.run.claim_keys[1], "another run", px=60_000)
        runner.leaving = True
        ran: list[int] = []
        item.run.func = lambda a, _b: ran.append(a)
        performer.work(item)
    finally:
        runner.close()
        release(item.run)
    assert item.dropped, "given up"
    assert ran == [], "not run"
    client.delete(item.run.claim_keys[1])  # the other run's lease lapsed
    transport = RQTransport(redis_server.url)
    try:
        env = item.run.d.envelope
        [verdict] = transport.probe([Probe(env.id, env.key_id, env.queue)], lease_s=0.0)
    finally:
        transport.close()
    assert verdict == "orphaned", verdict
