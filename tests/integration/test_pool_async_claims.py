"""An ``async def`` task's claim in the pool: proven in the step that calls the task, outside its timeout.

An ``async def`` task is claimed by its coroutine on the event loop, and a claim that is stale by
then is made again on an executor thread (:mod:`hybridq.worker.perform`). The event loop can be
held up after that (a coroutine that blocks it), and the claim made again can wait long (a busy
key, Redis away): neither may start the task on a gone claim, or count against its timeout.
A real redis-server; the performer runs the coroutine on a loop of the test's own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.worker import scripts
from hybridq.worker.perform import Performer
from hybridq.worker.run import release
from hybridq.worker.runner import Taken
from hybridq.worker.starter import Starter

from tests.integration.test_batch_scripts import OWNER, take_one


def claimed_ahead(server: RedisServer) -> tuple[Any, Performer, Taken, list[int]]:
    """The one job pushed to ``server``, claimed by a START, an ``async def`` task that notes its calls.

    The claim is stale (its coroutine held up since): it is made again before the task's call.
    """
    client, items = take_one(server)
    conn = scripts.client(client)
    starter = Starter(conn, "w1", 120)
    starter.exchange([], items, None)
    item = items[0]
    assert item.run.claim_reply[0] == 0, "claimed"
    ran: list[int] = []

    async def task(a: int, b: int) -> int:
        ran.append(a)
        return a + b

    item.run.func = task
    item.claimed_at -= 1.0  # sent a second ago (0: never sent)
    return client, Performer(conn, starter=starter), item, ran


def test_an_async_tasks_timeout_does_not_count_the_wait_for_its_claim(redis_server: RedisServer) -> None:
    """Review of i26-fix, item 2: the claim made again polls a busy key longer than the task's timeout.

    Before the fix it was made inside the task's ``asyncio.wait_for``: the run was recorded failed
    (``JobTimeoutException``, an attempt used) though the task was never called.
    """
    client, performer, item, ran = claimed_ahead(redis_server)
    item.timeout = 1.0
    client.set(item.run.claim_keys[1], "another run", px=1500)  # lost meanwhile; another holds it 1.5 s
    try:
        asyncio.run(performer.work_async(item))
    finally:
        release(item.run)
    assert ran == [0], f"not called: {item.ok=} {item.rq_value=}"
    assert item.ok, "recorded failed: its timeout counted the wait for its claim"


def test_an_async_task_does_not_start_when_the_loop_is_held_up_after_its_claim_was_made_again(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of i26-fix, item 1: the claim made again, then the loop held up while the claim goes.

    A coroutine blocks the loop (0.2 s) right after the claim made again returned; meanwhile the
    lease is gone and the forwarder's epoch generation is raised (Redis back from a snapshot).
    Before the fix, nothing looked at the claim again: the task was called.
    """
    client, performer, item, ran = claimed_ahead(redis_server)
    run_id = client.info("server")["run_id"]
    client.set(keys.epoch(OWNER), f"0:{run_id}:token")
    loop: list[asyncio.AbstractEventLoop] = []

    def held_up() -> None:
        time.sleep(0.2)  # a coroutine blocking the loop
        client.delete(item.run.claim_keys[1])
        client.set(keys.epoch(OWNER), f"1:{run_id}:token")

    real = Performer._claimed

    def claimed(self: Performer, it: Taken, **kw: Any) -> bool | None:
        answer = real(self, it, **kw)
        if kw.get("again") and answer and not loop[1:]:
            loop.append(loop[0])
            loop[0].call_soon_threadsafe(held_up)  # runs before the coroutine resumes
        return answer

    monkeypatch.setattr(Performer, "_claimed", claimed)

    async def main() -> None:
        loop.append(asyncio.get_running_loop())
        await performer.work_async(item)

    try:
        asyncio.run(main())
    finally:
        release(item.run)
    assert loop[1:], "the claim was made again"
    assert ran == [], "called on a claim gone while the loop was held up"
