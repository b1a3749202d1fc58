"""Priorities and fair keys through real processes (issue 30): redis-server, ``hybridq forward``
and a ``hybridq worker``, runs counted from the effects file the task writes, in run order
(tests/backlog_tasks.py).

Default run (about 15 s together): a priority-9 job enqueued behind 5,000 waiting jobs starts
within one window's drain; after a ``FLUSHALL`` the run table's order holds (the priority jobs
run right after the window Redis lost and got back); with ``--fair-key 'tenant:*'``, a tenant
with 10 jobs finishes while one with 3,000 is still draining. The 100,000-job scene is the
priority tier (``-m priority``: tests/integration/test_priority_tier.py).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path

import redis
from hybridq import Queue, stats
from hybridq.forwarder.selector import AGE_EVERY
from hybridq.testing.embedded import RedisServer

from tests.integration.test_worker_redis import Stack, stack

__all__ = ["stack"]  # the fixture, used by this module's tests

TASK = "tests.backlog_tasks.mark"


def enqueue(journal: Path, effects: Path, tokens: list[str], **options: object) -> None:
    queue = Queue("default", journal)
    for start in range(0, len(tokens), 1000):
        queue.enqueue_many(
            queue.prepare(TASK, [str(effects), t], **options) for t in tokens[start : start + 1000]
        )  # type: ignore[arg-type]


def ran(effects: Path) -> list[str]:
    """The tokens in the order their runs wrote them."""
    return effects.read_text().split() if effects.exists() else []


def backlog(journal: Path) -> int:
    """Jobs waiting in the run table, as the forwarder's last stats snapshot says."""
    detail = stats(journal, redis_url=None, outbox=None)["queue_detail"].get("default", {})
    return int(detail.get("backlog") or 0)


def small_waiting(journal: Path) -> int:
    """Jobs of the limit key ``tenant:small`` in the run table (read from its file, not a snapshot)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{journal}/runs/runs.sqlite?mode=ro", uri=True)) as db:
            return int(db.execute("SELECT count(*) FROM runs WHERE lkey = 'tenant:small'").fetchone()[0])
    except sqlite3.OperationalError:  # not created yet
        return 0


def wait_for(check: object, timeout_s: float, *procs: object, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        for proc in procs:
            proc.assert_alive()  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.02)


def jump_scene(
    stack: Stack, server: RedisServer, tmp_path: Path, n: int, *, window: int
) -> tuple[int, int, float]:
    """``n`` priority-0 jobs drain through a ``window``-job window; a priority-9 job comes in.

    Returns (jobs that ran between its enqueue and its run, jobs still waiting when it ran, the
    seconds from its enqueue to its run).
    """
    effects = tmp_path / "effects"
    enqueue(stack.journal, effects, [f"t{i}" for i in range(n)])
    stack.env["HYBRIDQ_ALLOW"] = "tests.backlog_tasks"
    forwarder = stack.forwarder(server.url, "--window-min", str(window // 2), "--window-max", str(window))
    client = redis.Redis.from_url(server.url)
    wait_for(lambda: client.llen("rq:queue:default") >= window // 2, 120, forwarder, what="the window")
    # Read and indexed, all of them: they wait in the run table (a job is ordered once read).
    wait_for(lambda: backlog(stack.journal) >= n - window, 300, forwarder, what="the indexing")
    worker = stack.worker(server.url)
    wait_for(lambda: len(ran(effects)) >= 2 * window, 120, forwarder, worker, what="the drain")
    before = len(ran(effects))
    at_enqueue = time.monotonic()
    enqueue(stack.journal, effects, ["p9"], priority=9)
    wait_for(lambda: "p9" in ran(effects), 60, forwarder, worker, what="the priority-9 job")
    took = time.monotonic() - at_enqueue
    order = ran(effects)
    at = order.index("p9")
    assert len(set(order)) == len(order)  # each ran once
    return at - before, n - at, took


def check_jump(
    stack: Stack, server: RedisServer, tmp_path: Path, figures: object, *, n: int, window: int
) -> None:
    """The scene, and its bound: behind the priority-9 job, what was in Redis (at most a window),
    what a refill pushed before the forwarder read it (at most a window), what the pool had taken
    ahead; never the backlog still waiting."""
    between, left, took = jump_scene(stack, server, tmp_path, n, window=window)
    assert between <= 2 * window + 200, between
    assert left > n - 4 * window - 1000, left
    figures(  # type: ignore[operator]
        f"priority 9 behind {n:,} waiting (window {window}): started after {between} others, {took:.2f} s"
    )


def test_a_priority_9_job_jumps_a_5000_job_backlog(
    redis_server: RedisServer, stack: Stack, tmp_path: Path, figures: object
) -> None:
    check_jump(stack, redis_server, tmp_path, figures, n=5000, window=200)


def test_after_flushall_the_refill_keeps_the_priority_order(
    redis_server: RedisServer, stack: Stack, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    enqueue(stack.journal, effects, [f"t{i}" for i in range(1000)])
    enqueue(stack.journal, effects, [f"p{i}" for i in range(50)], priority=9)
    stack.env["HYBRIDQ_ALLOW"] = "tests.backlog_tasks"
    forwarder = stack.forwarder(redis_server.url, "--window-min", "100", "--window-max", "100")
    client = redis.Redis.from_url(redis_server.url)
    wait_for(lambda: client.llen("rq:queue:default") == 100, 60, forwarder, what="the window")
    time.sleep(0.5)  # everything read and indexed; no worker: the window stays as it is
    client.flushall()
    wait_for(lambda: client.llen("rq:queue:default") == 100, 60, forwarder, what="the refill")
    worker = stack.worker(redis_server.url, simple=True)  # one job at a time: the queue's order
    wait_for(lambda: sum(t.startswith("p") for t in ran(effects)) == 50, 60, forwarder, worker, what="p9s")
    order = ran(effects)
    last = max(i for i, t in enumerate(order) if t.startswith("p"))
    # The window Redis lost and got back (100 priority-0 jobs), the 50 priority-9 jobs in their
    # order, and one in ten of each refill's picks the oldest waiting (the aging rule: at most
    # two refills of a 100-job window): not the 900 behind. Without priorities the last p would
    # be the 1,050th job to run.
    assert [t for t in order if t.startswith("p")] == [f"p{i}" for i in range(50)]
    assert last < 100 + 50 + 2 * 100 // AGE_EVERY, (last, " ".join(order[100 : last + 1]))
    older = sorted(int(t[1:]) for t in order[:last] if t.startswith("t"))
    assert older == list(range(len(older)))  # the priority-0 ones that went: the oldest, in order
    assert len(set(order)) == len(order)


def test_a_small_tenant_finishes_while_a_big_one_drains(
    redis_server: RedisServer, stack: Stack, tmp_path: Path, figures: object
) -> None:
    effects = tmp_path / "effects"
    enqueue(stack.journal, effects, [f"big{i}" for i in range(3000)], limit_key="tenant:big")
    enqueue(stack.journal, effects, [f"small{i}" for i in range(10)], limit_key="tenant:small")
    stack.env["HYBRIDQ_ALLOW"] = "tests.backlog_tasks"
    forwarder = stack.forwarder(
        redis_server.url, "--window-min", "50", "--window-max", "100", "--fair-key", "tenant:*"
    )
    # Every job read before the worker starts: on a busy machine the refill could otherwise push
    # big jobs for turns before the small ones were read (the bound below would not hold).
    wait_for(lambda: small_waiting(stack.journal) == 10, 60, forwarder, what="the small tenant's jobs read")
    # One job at a time, from the head of the list: the run order is the order the forwarder
    # pushed, which is what fairness is about. A pool takes up to 4 jobs per thread ahead in
    # each process and runs them as its threads get the CPU: under load it ran the last small
    # job 171st and 173rd where a 100-job refill had pushed it 150th at the latest.
    worker = stack.worker(redis_server.url, simple=True)
    done = lambda: sum(t.startswith("small") for t in ran(effects)) == 10  # noqa: E731
    wait_for(done, 60, forwarder, worker, what="the small tenant")
    # The refill deletes the rows it pushed once Redis has the jobs (docs/reliability.md): the
    # worker can run them before that commit lands, and stats() keeps a count 10 s per process.
    wait_for(lambda: small_waiting(stack.journal) == 0, 30, forwarder, what="the small tenant's rows deleted")
    shown = stats(stack.journal)["fair_keys"]  # per fair key, from the run table's lanes
    assert "tenant:small" not in shown, "none of its jobs waits"
    assert shown["tenant:big"]["waiting"] > 1000
    assert shown["tenant:big"]["running"] is None  # not a limit key: its runs are counted nowhere
    order = ran(effects)
    last = max(i for i, t in enumerate(order) if t.startswith("small"))
    # Round robin, pushed in the order the lanes were visited: what went before the last small
    # job is the first window (the big tenant's, read first and pushed as read: the window's
    # floor, 50, no drain seen yet), a big job per turn, and the aging rule's share (one in
    # AGE_EVERY of what the refills took, the oldest: big ones). Sorted by age, a refill (25 to
    # 100 jobs) pushed its big ones first and the small ones at its tail: 74th-106th.
    assert last < 50 + 2 * 10 + 2 * 10 // AGE_EVERY, (last, " ".join(order[: last + 1]))
    assert len(set(order)) == len(order)
    figures(f"fair keys: the 10-job tenant done after {last + 1} runs, the other with 3,000 waiting")  # type: ignore[operator]
