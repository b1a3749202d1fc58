"""S22: a job the pool took ahead starts only on a claim that is still its own (issue 26).

A pool process takes jobs ahead of its threads. Each test has pool A (one process, one thread,
``--import tests.pool_ahead``: it takes ahead whatever runs) take a long job L and a short job Q
together, then takes the claim away while Q waits behind L: Redis restarted from an older
snapshot, A cut off from Redis past the lease, or a task holding A's GIL. A second pool runs what
the forwarder delivers again. Q must run once: before the fix, A ran it from its old claim once L
ended, after the ledger held it finished. Real processes and a real redis-server; the tasks
write an effects file (``tests.tasks``), which is what is counted.

Marked ``pool`` (about a minute and a half): ``scripts/test -m pool``.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.testing.embedded import RedisServer
from hybridq.testing.faultproxy import FaultProxy

from tests.integration.test_worker_pool import pool
from tests.integration.test_worker_redis import (
    LEASE_S,
    Stack,
    alive,
    read_effects,
    redis_client,
    stack,
    wait_line,
    wait_status,
)
from tests.support.processes import wait_until
from tests.support.redis import MakeRedisServer

__all__ = ["stack"]  # the fixture, used by this module's tests

pytestmark = pytest.mark.pool

#: Pool A: one process, one thread, taking ahead whatever runs.
AHEAD = ("--processes", "1", "--threads", "1", "--import", "tests.pool_ahead")


def runs(effects: Path) -> collections.Counter[str]:
    return collections.Counter(x.token for x in read_effects(effects) if x.kind == "start")


def queued(server: RedisServer) -> int:
    with redis_client(server) as client:
        return int(client.llen("rq:queue:default"))


def succeeded(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda s: bool(s["succeeded"] >= n)


def enqueue_l_and_q(queue: Queue, effects: Path, server: RedisServer, long_s: float) -> None:
    """L (``long_s``) then Q (short), both in the queue before pool A starts: taken together."""
    queue.enqueue("tests.tasks.traced", str(effects), "L", long_s)
    queue.enqueue("tests.tasks.traced", str(effects), "Q")
    wait_until(lambda: queued(server) == 2, what="L and Q pushed")


def both_done(journal: Path, env: dict[str, str], effects: Path, check: Callable[[], None]) -> None:
    """L and Q succeeded (pool B), A's own run of L ended; then long enough for A to start Q."""
    wait_status(journal, env, succeeded(2), what="L and Q", alive=check)
    wait_line(effects, "done", "L", timeout=30)
    time.sleep(LEASE_S * 2)  # where A started Q from its old claim


def test_a_job_taken_ahead_does_not_start_once_redis_came_back_from_a_snapshot(
    make_redis_server: MakeRedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    server = make_redis_server()
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    forwarder = stack.forwarder(server.url)
    wait_until(lambda: _epoch_set(server), what="the forwarder's epoch")
    with redis_client(server) as client:
        client.save()  # the snapshot Redis comes back from: the epoch, no job yet
    enqueue_l_and_q(queue, effects, server, long_s=6.0)
    a = pool(stack, server.url, *AHEAD)
    wait_line(effects, "start", "L")
    server.restart()  # SIGKILL, then the snapshot: neither L nor Q, nor A's claims
    b = pool(stack, server.url)  # runs what the forwarder's refill queues again
    both_done(journal_dir, subprocess_env, effects, alive(forwarder, b))  # A's L too: it lost its lease
    counted = runs(effects)
    assert counted["Q"] == 1, f"Q ran {counted['Q']} times: A started it on a claim Redis had lost"
    a.assert_alive()


def test_a_job_taken_ahead_does_not_start_after_its_worker_was_cut_off_past_the_lease(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    forwarder = stack.forwarder(redis_server.url)
    assert redis_server.port is not None
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        enqueue_l_and_q(queue, effects, redis_server, long_s=4.0)
        a = pool(stack, proxy.url, *AHEAD)
        wait_line(effects, "start", "L")
        proxy.blackhole()  # A alone is cut off, for longer than the lease and than L
        b = pool(stack, redis_server.url)
        both_done(journal_dir, subprocess_env, effects, alive(forwarder, b))  # A's L too, cut off
        proxy.blackhole(on=False)
        proxy.reset()
        time.sleep(LEASE_S * 2)  # and once it can reach Redis again
    counted = runs(effects)
    assert counted["Q"] == 1, f"Q ran {counted['Q']} times: A started it on a claim it had lost"
    a.assert_alive()


def test_a_task_holding_the_gil_past_its_lease_runs_once_and_so_does_the_job_beside_it(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The supervisor renews the lease of a task whose process cannot: G runs once (item 2)."""
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    forwarder = stack.forwarder(redis_server.url)
    queue.enqueue("tests.tasks.gil", str(effects), "G", 15)
    queue.enqueue("tests.tasks.traced", str(effects), "Q")
    wait_until(lambda: queued(redis_server) == 2, what="G and Q pushed")
    a = pool(stack, redis_server.url, *AHEAD)
    wait_line(effects, "start", "G")
    b = pool(stack, redis_server.url)  # running while A's process holds its GIL
    wait_status(
        journal_dir, subprocess_env, succeeded(2), timeout=60, what="G and Q", alive=alive(forwarder, a, b)
    )
    time.sleep(LEASE_S * 2)
    counted = runs(effects)
    assert counted["G"] == 1, f"G ran {counted['G']} times: its lease lapsed while it held the GIL"
    assert counted["Q"] == 1, f"Q ran {counted['Q']} times"
    assert next(x.pid for x in read_effects(effects) if x.token == "G") in a.children()


def _epoch_set(server: RedisServer) -> bool:
    with contextlib.closing(server.client()) as client:
        return bool(client.keys("hybridq:epoch:*"))


def test_a_job_polling_for_a_stuck_jobs_key_does_not_keep_its_process_from_exiting(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path
) -> None:
    """Review of i26-pool, item 4: X stuck past its timeout, Y (X's key) polling X's lease.

    The process is poisoned (it exits once its other jobs end, and X's lease lapses then), but
    Y's poll never ended: X's lease was renewed until the process exits. Y now gives up (not
    started: delivered again), the process exits, and X is delivered again.
    """
    effects = tmp_path / "effects.txt"
    journals = [journal_dir, tmp_path / "journal-b"]
    forwarders = [stack.forwarder(redis_server.url, journal=j) for j in journals]
    worker = pool(stack, redis_server.url, "--processes", "1", "--threads", "2")
    Queue("default", journals[0]).enqueue(
        "tests.tasks.stuck", str(effects), "X", idempotency_key="K", job_timeout=1
    )
    x = wait_line(effects, "start", "X", timeout=30)
    Queue("default", journals[1]).enqueue("tests.tasks.traced", str(effects), "Y", idempotency_key="K")
    again = wait_line(effects, "start", "X", attempt=2, timeout=1 + 2 + LEASE_S + 15)
    assert again.pid != x.pid, "delivered again once its process was gone"
    assert x.pid not in worker.children()
    assert "exiting for a fresh process" in worker.log()
    assert runs(effects)["Y"] == 0, "Y never started beside X"
    del forwarders
