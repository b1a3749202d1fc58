"""Queues over several Redis instances (--redis-for): one forwarder, two redis-servers, real processes.

Queue ``alpha`` lives on the first Redis (the default, ``--redis``), ``beta`` on the second
(``--redis-for beta=URL``). Jobs run ``tests.tasks.record``, which appends its token to an
effects file (fsync'd), so runs are counted without trusting hybridq. The second Redis alone is
hit by each fault in turn: FLUSHALL, a restart from an older snapshot (its queue entries of
finished jobs come back), a restart empty, an outage (the forwarder waits, then goes on). Each
time: no job lost, none run twice, and the first Redis's queue is untouched (the same entries,
in the same order).

Figure line: ``SHARDS <case>: jobs=N runs=N re-runs=0 lost=0``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer

from tests.support.processes import ForwarderProcess, run_status, wait_until
from tests.support.redis import MakeRedisServer


@pytest.fixture
def forwarders() -> Iterator[list[ForwarderProcess]]:
    procs: list[ForwarderProcess] = []
    yield procs
    for proc in procs:
        proc.kill()


def hybridq(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridq", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def burst(env: dict[str, str], cwd: Path, first: RedisServer, second: RedisServer, queue: str) -> None:
    """``hybridq worker --burst --simple --redis FIRST --redis-for beta=SECOND QUEUE``."""
    done = hybridq(
        env,
        cwd,
        "worker",
        "--burst",
        "--simple",
        "--redis",
        first.url,
        "--redis-for",
        f"beta={second.url}",
        queue,
    )
    assert done.returncode == 0, done.stderr


def runs(effects: Path) -> Counter[str]:
    try:
        return Counter(effects.read_text(encoding="utf-8").split())
    except FileNotFoundError:
        return Counter()


def entries(server: RedisServer, queue: str) -> list[bytes]:
    with contextlib.closing(server.client()) as client:
        return list(client.lrange(f"rq:queue:{queue}", 0, -1))


def succeeded(journal: Path, env: dict[str, str]) -> int:
    status: dict[str, Any] = run_status(journal, env)
    return int(status["succeeded"])


def enqueue(journal: Path, effects: Path, queue: str, tokens: list[str]) -> None:
    q = Queue(queue, journal)
    q.enqueue_many([q.prepare("tests.tasks.record", (str(effects), t)) for t in tokens])


def check(case: str, effects: Path, expected: list[str]) -> None:
    counted = runs(effects)
    reruns = sum(n - 1 for n in counted.values())
    lost = len(set(expected) - set(counted))
    print(f"SHARDS {case}: jobs={len(expected)} runs={sum(counted.values())} re-runs={reruns} lost={lost}")
    assert counted == Counter(expected), counted


def test_two_redis_each_fault_of_one_loses_nothing_reruns_nothing_and_spares_the_other(
    tmp_path: Path,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    make_redis_server: MakeRedisServer,
    forwarders: list[ForwarderProcess],
) -> None:
    first, second = make_redis_server(), make_redis_server()
    env, effects = subprocess_env, tmp_path / "effects.txt"
    ensure_journal_dir(journal_dir)
    forwarder = ForwarderProcess(
        journal_dir,
        first.url,
        env=env,
        log_path=tmp_path / "forwarder.log",
        # A long lease: a reconcile pass would find lost jobs only after it; the epoch fence
        # must (within about a second).
        extra_args=("--lease", "60", "--redis-for", f"beta={second.url}"),
    )
    forwarders.append(forwarder)
    expected: list[str] = []

    # Jobs of both queues, each on its own Redis; the second one snapshotted with its 10 queued.
    a1, b1 = [f"a1-{i}" for i in range(10)], [f"b1-{i}" for i in range(10)]
    enqueue(journal_dir, effects, "alpha", a1)
    enqueue(journal_dir, effects, "beta", b1)
    expected += a1 + b1
    wait_until(
        lambda: len(entries(first, "alpha")) == 10 and len(entries(second, "beta")) == 10, what="pushed"
    )
    assert entries(first, "beta") == []
    assert entries(second, "alpha") == []
    with contextlib.closing(second.client()) as client:
        client.save()
    # A worker of beta follows it to the second Redis; one given both queues is refused.
    mixed = hybridq(
        env,
        tmp_path,
        "worker",
        "--burst",
        "--redis",
        first.url,
        "--redis-for",
        f"beta={second.url}",
        "alpha",
        "beta",
    )
    assert mixed.returncode == 1
    assert "one worker per Redis" in mixed.stderr
    assert len(mixed.stderr.strip().splitlines()) == 1
    burst(env, tmp_path, first, second, "alpha")
    burst(env, tmp_path, first, second, "beta")
    wait_until(lambda: succeeded(journal_dir, env) == 20, what="outcomes harvested from both")
    check("both", effects, expected)

    # FLUSHALL of the second while jobs of both wait: the second's are queued again, the
    # first's queue is not touched.
    a2, b2 = [f"a2-{i}" for i in range(10)], [f"b2-{i}" for i in range(10)]
    enqueue(journal_dir, effects, "alpha", a2)
    enqueue(journal_dir, effects, "beta", b2)
    expected += a2 + b2
    wait_until(
        lambda: len(entries(first, "alpha")) == 10 and len(entries(second, "beta")) == 10, what="pushed"
    )
    alpha_before = entries(first, "alpha")
    second.flushall()
    wait_until(lambda: len(entries(second, "beta")) == 10, timeout=10, what="the second Redis refilled")
    assert entries(first, "alpha") == alpha_before
    burst(env, tmp_path, first, second, "beta")
    burst(env, tmp_path, first, second, "alpha")
    wait_until(lambda: succeeded(journal_dir, env) == 40, what="outcomes harvested")
    check("flushall", effects, expected)

    # The second restarts from its older snapshot: the 10 finished b1 jobs are queued there
    # again. A worker at once (before the forwarder looked) and after its refill run none.
    a3 = [f"a3-{i}" for i in range(5)]
    enqueue(journal_dir, effects, "alpha", a3)
    expected += a3
    wait_until(lambda: len(entries(first, "alpha")) == 5, what="pushed")
    alpha_before = entries(first, "alpha")
    second.kill()
    second.start()
    assert len(entries(second, "beta")) == 10
    burst(env, tmp_path, first, second, "beta")
    wait_until(lambda: entries(second, "beta") == [], timeout=10, what="the finished jobs' copies purged")
    burst(env, tmp_path, first, second, "beta")
    assert entries(first, "alpha") == alpha_before
    check("older snapshot", effects, expected[:-5])

    # Restarted empty (no dump): jobs queued there are queued again.
    b4 = [f"b4-{i}" for i in range(10)]
    enqueue(journal_dir, effects, "beta", b4)
    expected += b4
    wait_until(lambda: len(entries(second, "beta")) == 10, what="pushed")
    second.kill()
    os.unlink(Path(second.log_path).parent / "dump.rdb")
    second.start()
    wait_until(lambda: len(entries(second, "beta")) == 10, timeout=10, what="the second Redis refilled")
    assert entries(first, "alpha") == alpha_before
    burst(env, tmp_path, first, second, "beta")
    burst(env, tmp_path, first, second, "alpha")
    wait_until(lambda: succeeded(journal_dir, env) == 55, what="outcomes harvested")
    check("restart empty", effects, expected)
    forwarder.assert_alive()

    # status and doctor cover both instances.
    out = hybridq(
        env,
        tmp_path,
        "status",
        "--json",
        "--journal",
        str(journal_dir),
        "--redis",
        first.url,
        "--redis-for",
        f"beta={second.url}",
    )
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["succeeded"] == 55
    assert status["redis"]["up"] is True
    assert [(i["queues"], i["up"]) for i in status["redis_instances"]] == [(["*"], True), (["beta"], True)]
    assert status["redis_instances"][1]["queued"] == {"beta": 0}
    doc = hybridq(
        env,
        tmp_path,
        "doctor",
        "--json",
        "--journal",
        str(journal_dir),
        "--redis",
        first.url,
        "--redis-for",
        f"beta={second.url}",
    )
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert json.loads(doc.stdout)["healthy"] is True
    second.kill()
    down = hybridq(
        env,
        tmp_path,
        "status",
        "--json",
        "--journal",
        str(journal_dir),
        "--redis",
        first.url,
        "--redis-for",
        f"beta={second.url}",
    )
    assert json.loads(down.stdout)["redis_instances"][1]["up"] is False
    doc = hybridq(
        env,
        tmp_path,
        "doctor",
        "--journal",
        str(journal_dir),
        "--redis",
        first.url,
        "--redis-for",
        f"beta={second.url}",
    )
    assert doc.returncode == 1, doc.stderr
    assert len(doc.stderr.strip().splitlines()) == 1, doc.stderr

    # While the second is down the forwarder waits as a whole (one checkpoint), alive; back, it
    # goes on: the jobs of both queues enqueued meanwhile run once.
    a5, b5 = [f"a5-{i}" for i in range(3)], [f"b5-{i}" for i in range(3)]
    enqueue(journal_dir, effects, "beta", b5)
    enqueue(journal_dir, effects, "alpha", a5)
    expected += a5 + b5
    time.sleep(1.5)
    forwarder.assert_alive()
    second.start()
    wait_until(lambda: len(entries(second, "beta")) == 3, timeout=15, what="pushed after the outage")
    burst(env, tmp_path, first, second, "beta")
    burst(env, tmp_path, first, second, "alpha")
    wait_until(lambda: succeeded(journal_dir, env) == 61, what="outcomes harvested")
    check("one down, then back", effects, expected)
    forwarder.assert_alive()


def test_moving_a_queue_between_two_kept_redis_runs_each_job_once_and_leaves_nothing_behind(
    tmp_path: Path,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    make_redis_server: MakeRedisServer,
    forwarders: list[ForwarderProcess],
) -> None:
    """{beta: second, gamma: second} -> {gamma: second}: beta moves to the first Redis.

    Figure line: ``SHARDS move: jobs=N runs=N re-runs=0 lost=0``.
    """
    first, second = make_redis_server(), make_redis_server()
    env, effects = subprocess_env, tmp_path / "effects.txt"
    ensure_journal_dir(journal_dir)
    old_map = ("--redis-for", f"beta={second.url}", "--redis-for", f"gamma={second.url}")
    new_map = ("--redis-for", f"gamma={second.url}")

    def forward(name: str, redis_for: tuple[str, ...]) -> ForwarderProcess:
        # A long lease: the reconcile pass (a lease later) is not what moves the jobs.
        proc = ForwarderProcess(
            journal_dir,
            first.url,
            env=env,
            log_path=tmp_path / name,
            extra_args=("--lease", "60", *redis_for),
        )
        forwarders.append(proc)
        return proc

    def work(queue: str, redis_for: tuple[str, ...]) -> None:
        done = hybridq(
            env, tmp_path, "worker", "--burst", "--simple", "--redis", first.url, *redis_for, queue
        )
        assert done.returncode == 0, done.stderr

    old = forward("forwarder-old.log", old_map)
    finished = [f"done-{i}" for i in range(6)]
    enqueue(journal_dir, effects, "beta", finished)
    wait_until(lambda: len(entries(second, "beta")) == 6, what="pushed")
    work("beta", old_map)
    wait_until(lambda: succeeded(journal_dir, env) == 6, what="outcomes harvested")
    waiting, other = [f"wait-{i}" for i in range(6)], [f"gamma-{i}" for i in range(3)]
    enqueue(journal_dir, effects, "beta", waiting)
    enqueue(journal_dir, effects, "gamma", other)
    wait_until(
        lambda: len(entries(second, "beta")) == 6 and len(entries(second, "gamma")) == 3, what="pushed"
    )
    with contextlib.closing(second.client()) as client:
        # Copies of two finished jobs queued again (as a lagging replica or a snapshot brings back).
        done_ids = [
            key.decode().removeprefix("rq:job:")
            for key in client.scan_iter("rq:job:*")
            if client.hget(key, "status") == b"finished"
        ][:2]
        for job_id in done_ids:
            client.hset(f"rq:job:{job_id}", "status", "queued")
            client.rpush("rq:queue:beta", job_id)
    old.terminate()  # stopped as an operator does (SIGTERM: its checkpoint saved)

    forward("forwarder-new.log", new_map)
    wait_until(
        lambda: entries(second, "beta") == [] and len(entries(first, "beta")) == 6,
        timeout=15,
        what="beta's jobs moved to the first Redis",
    )
    work("beta", old_map)  # a worker still on the old map: nothing of beta is left there
    work("beta", new_map)
    work("gamma", new_map)
    wait_until(lambda: succeeded(journal_dir, env) == 15, what="outcomes harvested")
    check("move", effects, finished + waiting + other)
    with contextlib.closing(second.client()) as client:
        left = [key for key in client.scan_iter("rq:job:*") if client.hget(key, "origin") == b"beta"]
    assert left == []
    assert entries(second, "beta") == []


def test_status_gives_each_instance_its_own_waiting_count_and_refusal(
    tmp_path: Path, journal_dir: Path, make_redis_server: MakeRedisServer
) -> None:
    """Per instance: its own waiting_for_a_worker; one whose password is missing is refused, not DOWN."""
    from click.testing import CliRunner
    from hybridq.cli import cli
    from hybridq.ops.status import stats
    from hybridq.worker import waiting

    first, second = make_redis_server(), make_redis_server()
    ensure_journal_dir(journal_dir)
    with contextlib.closing(second.client()) as client:
        waiting.record(client, "j1", {"func": "x.y", "queue": "beta", "reason": "r"}, lease_s=60)
        waiting.record(client, "j2", {"func": "x.y", "queue": "beta", "reason": "r"}, lease_s=60)
    out = stats(str(journal_dir), redis_url=first.url, redis_for={"beta": second.url})
    assert out["redis"]["waiting_for_a_worker"] == 0  # the default instance's
    assert [i["waiting_for_a_worker"] for i in out["redis_instances"]] == [0, 2]

    with contextlib.closing(second.client()) as client:
        client.config_set("requirepass", "s3cret")
    out = stats(str(journal_dir), redis_url=first.url, redis_for={"beta": second.url})
    refused = out["redis_instances"][1]
    assert refused["up"] is False
    assert "login refused" in refused["refused"], refused
    assert "refused" not in out["redis_instances"][0]
    text = CliRunner().invoke(
        cli,
        ["status", "--journal", str(journal_dir), "--redis", first.url, "--redis-for", f"beta={second.url}"],
    )
    assert text.exit_code == 0, text.output
    assert "REFUSED (login refused" in text.output, text.output
    host = second.url.split("//", 1)[1]
    fixed = stats(str(journal_dir), redis_url=first.url, redis_for={"beta": f"redis://:s3cret@{host}"})
    assert fixed["redis_instances"][1]["up"] is True
