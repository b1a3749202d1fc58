"""S16: Redis comes back with an older state (a snapshot, a lagging replica): nothing finished runs again.

Every process is real: ``python -m hybridq forward --lease 2``, ``python -m hybridq worker --burst``
and private redis-servers. Jobs run ``tests.tasks.record``, which appends its token to an effects
file (fsync'd), so runs are counted without trusting hybridq.

* The snapshot case: jobs are queued, Redis ``SAVE``s, every job runs and is harvested into the
  ledger, then Redis is SIGKILLed and restarted from its dump, which still holds every queue
  entry. A worker started at once (before the forwarder can have noticed the restart) and one
  started after the forwarder's refill must run none of them again; jobs that had not run when
  the snapshot was taken still run, once.
* The replica case: a replica stops receiving the master's stream (SIGSTOP) while the jobs run
  and are harvested; the master dies, the replica is promoted (``REPLICAOF NO ONE``), the worker
  and the forwarder are pointed at it: no finished job runs again.

Figure line: ``S16 <case>: jobs=N runs=N re-runs=0``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.journal.paths import ensure_journal_dir
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery, Probe
from hybridq.transport.rq import RQTransport

from tests.support.processes import ForwarderProcess, run_status, wait_until
from tests.support.redis import MakeRedisServer
from tests.support.rqwork import job_data

LEASE_S = 2.0


@pytest.fixture
def forwarders() -> Iterator[list[ForwarderProcess]]:
    procs: list[ForwarderProcess] = []
    yield procs
    for proc in procs:
        proc.kill()


def start_forwarder(
    procs: list[ForwarderProcess], journal: Path, url: str, env: dict[str, str], tmp_path: Path
) -> ForwarderProcess:
    ensure_journal_dir(journal)
    proc = ForwarderProcess(
        journal,
        url,
        env=env,
        log_path=tmp_path / f"forwarder-{len(procs)}.log",
        extra_args=("--lease", str(LEASE_S)),
    )
    procs.append(proc)
    return proc


def burst_worker(url: str, env: dict[str, str], tmp_path: Path, *queues: str) -> None:
    """``hybridq worker --burst --simple QUEUES``: run what is queued now, then exit."""
    with open(tmp_path / "workers.log", "a", encoding="utf-8") as log:
        done = subprocess.run(
            [sys.executable, "-m", "hybridq", "worker", "--burst", "--simple", "--redis", url, *queues],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, (tmp_path / "workers.log").read_text()


def runs(effects: Path) -> Counter[str]:
    try:
        return Counter(effects.read_text(encoding="utf-8").split())
    except FileNotFoundError:
        return Counter()


def length(server: RedisServer, queue: str) -> int:
    with contextlib.closing(server.client()) as client:
        return int(client.llen(f"rq:queue:{queue}"))


def succeeded(journal: Path, env: dict[str, str]) -> int:
    status: dict[str, Any] = run_status(journal, env)
    return int(status["succeeded"])


def epoch_value(server: RedisServer) -> bytes | None:
    with contextlib.closing(server.client()) as client:
        keys = client.keys("hybridq:epoch:*")
        return client.get(keys[0]) if keys else None


def test_s16_redis_restarted_from_an_older_snapshot_runs_no_finished_job_again(
    tmp_path: Path,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    make_redis_server: MakeRedisServer,
    forwarders: list[ForwarderProcess],
) -> None:
    redis = make_redis_server()
    effects = tmp_path / "effects.txt"
    forwarder = start_forwarder(forwarders, journal_dir, redis.url, subprocess_env, tmp_path)
    queue = Queue("default", journal_dir)
    done_tokens = [f"done-{i}" for i in range(20)]
    later_tokens = [f"later-{i}" for i in range(5)]
    queue.enqueue_many([queue.prepare("tests.tasks.record", (str(effects), t)) for t in done_tokens])
    later = Queue("later", journal_dir)
    later.enqueue_many([later.prepare("tests.tasks.record", (str(effects), t)) for t in later_tokens])
    wait_until(lambda: length(redis, "default") == 20 and length(redis, "later") == 5, what="jobs pushed")
    with contextlib.closing(redis.client()) as client:
        client.save()  # the snapshot: 25 jobs queued

    burst_worker(redis.url, subprocess_env, tmp_path, "default")
    assert runs(effects) == Counter(done_tokens)
    wait_until(lambda: succeeded(journal_dir, subprocess_env) == 20, what="outcomes harvested")

    before = epoch_value(redis)
    redis.restart()  # SIGKILL, then start from the dump: the 25 queue entries are back
    assert length(redis, "default") == 20
    # At once: the forwarder has not noticed the restart yet (it looks once a second).
    burst_worker(redis.url, subprocess_env, tmp_path, "default", "later")
    wait_until(lambda: epoch_value(redis) != before, what="the forwarder's new epoch")
    time.sleep(1.0)  # its refill pass
    burst_worker(redis.url, subprocess_env, tmp_path, "default", "later")
    wait_until(lambda: succeeded(journal_dir, subprocess_env) == 25, timeout=60, what="the later jobs")
    burst_worker(redis.url, subprocess_env, tmp_path, "default", "later")

    counted = runs(effects)
    print(
        f"S16 snapshot: jobs=25 runs={sum(counted.values())} re-runs={sum(n - 1 for n in counted.values())}"
    )
    assert counted == Counter(done_tokens + later_tokens), counted
    forwarder.assert_alive()
    assert "ran again" not in forwarder.log()


def test_s16_a_lagging_replica_promoted_runs_no_finished_job_again(
    tmp_path: Path,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    make_redis_server: MakeRedisServer,
    forwarders: list[ForwarderProcess],
) -> None:
    master = make_redis_server()
    replica = make_redis_server(extra_args=("--replicaof", "127.0.0.1", str(master.port)))
    effects = tmp_path / "effects.txt"
    forwarder = start_forwarder(forwarders, journal_dir, master.url, subprocess_env, tmp_path)
    queue = Queue("default", journal_dir)
    tokens = [f"job-{i}" for i in range(20)]
    queue.enqueue_many([queue.prepare("tests.tasks.record", (str(effects), t)) for t in tokens])
    wait_until(lambda: length(replica, "default") == 20, what="jobs replicated")

    # The replica stops following: frozen, and its link cut (what the master had sent before
    # is all it will ever get: the master is dead before it runs again).
    replica.pause()
    try:
        with contextlib.closing(master.client()) as client:
            client.execute_command("CLIENT", "KILL", "TYPE", "replica")
        burst_worker(master.url, subprocess_env, tmp_path, "default")
        wait_until(lambda: succeeded(journal_dir, subprocess_env) == 20, what="outcomes harvested")
        forwarder.terminate()
        master.kill()
    finally:
        replica.resume()
    with contextlib.closing(replica.client()) as client:
        client.execute_command("REPLICAOF", "NO", "ONE")
    assert length(replica, "default") == 20  # every finished job is queued again on the replica

    burst_worker(replica.url, subprocess_env, tmp_path, "default")  # before any forwarder saw it
    before = epoch_value(replica)
    forwarder = start_forwarder(forwarders, journal_dir, replica.url, subprocess_env, tmp_path)
    wait_until(lambda: epoch_value(replica) != before, what="the forwarder's new epoch")
    time.sleep(1.0)  # its refill pass
    burst_worker(replica.url, subprocess_env, tmp_path, "default")

    counted = runs(effects)
    print(f"S16 replica: jobs=20 runs={sum(counted.values())} re-runs={sum(n - 1 for n in counted.values())}")
    assert counted == Counter(tokens), counted
    assert succeeded(journal_dir, subprocess_env) == 20
    forwarder.assert_alive()


# -- the pieces, one script call at a time -------------------------------------------------------


def _envelope() -> Envelope:
    return Envelope(
        id=new_job_id(),
        func="tests.tasks.add",
        queue="default",
        idempotency_key=new_job_id(),
        created_at=time.time(),
        args=(1, 2),
    )


def test_the_claim_refuses_a_stale_generation_and_an_unchecked_restart(redis_server: RedisServer) -> None:
    from hybridq import worker

    transport = RQTransport(redis_server.url)
    conn = transport.connection
    try:
        env = _envelope()
        run_id = transport.state_token("o").run_id
        claim = worker._script(conn, worker._CLAIM)
        claim_keys = [keys.result(env.key_id), keys.lease(env.key_id), keys.rq_job(env.id), keys.epoch("o")]

        def attempt(token: str, gen: int) -> list[Any]:
            reply: list[Any] = claim(keys=claim_keys, args=[token, 10_000, env.id, 0, 1, gen])
            conn.delete(keys.lease(env.key_id))
            return [reply[0], reply[1].decode() if isinstance(reply[1], bytes) else reply[1]]

        assert attempt("a", 0)[0] == 0  # no epoch key: nothing to fence against
        conn.set(keys.epoch("o"), "0123abcdef")  # an older forwarder's epoch token
        assert attempt("b", 0)[0] == 0
        conn.set(keys.epoch("o"), f"2:{run_id}:token")
        assert attempt("c", 1) == [4, "stale"]
        assert attempt("d", 2)[0] == 0
        assert attempt("e", 3)[0] == 0
        conn.set(keys.epoch("o"), "2:0000000000000000000000000000000000000000:token")  # not this server
        assert attempt("f", 2) == [4, "unchecked"]
        conn.set(keys.epoch("o"), "2::token")  # the forwarder could not read run_id (ACL)
        assert attempt("g", 2)[0] == 0
    finally:
        transport.close()


def test_every_script_reads_the_servers_run_id_as_info_gives_it(redis_server: RedisServer) -> None:
    """The forwarder's read (_STATE), the claim's fence and the limits' epoch must agree."""
    from hybridq import worker
    from hybridq.protocol.keys import RUN_ID_LUA
    from hybridq.transport.rq_limits import KEY_USE, key_use

    transport = RQTransport(redis_server.url)
    conn = transport.connection
    try:
        want = conn.info("server")["run_id"]
        assert conn.eval(RUN_ID_LUA + "return redis_run_id()", 0).decode() == want
        assert transport.state_token("o").run_id == want
        key_use(conn.register_script(KEY_USE), 10.0, {"tenant:r": 0}, {})
        assert conn.get(keys.LIMITS_EPOCH).decode().endswith(f":{want}")
        env = _envelope()
        claim = worker._script(conn, worker._CLAIM)
        conn.set(keys.epoch("o"), f"2:{want}:token")
        claim_keys = [keys.result(env.key_id), keys.lease(env.key_id), keys.rq_job(env.id), keys.epoch("o")]
        assert claim(keys=claim_keys, args=["a", 10_000, env.id, 0, 1, 2])[0] == 0, "not fenced"
        # Only a field at a line's start: a field whose name ends in "run_id" is not it.
        read = RUN_ID_LUA + "return run_id_of(ARGV[1])"
        assert conn.eval(read, 0, "# Server\r\nxrun_id:zz\r\nrun_id:abc12\r\n") == b"abc12"
        assert conn.eval(read, 0, "# Server\r\nmaster_run_id:abc12\r\n") is None
    finally:
        transport.close()


def test_refill_purges_finished_copies_and_brings_live_ones_up(redis_server: RedisServer) -> None:
    transport = RQTransport(redis_server.url)
    conn = transport.connection
    try:
        finished, queued, fenced, running, missing, other = (_envelope() for _ in range(6))
        transport.push([Delivery(e, "o", ("w", 0, 64)) for e in (finished, other, queued, fenced, running)])
        conn.hset(keys.rq_job(fenced.id), mapping={"status": "finished", "hybridq_fenced": "1"})
        conn.lrem("rq:queue:default", 0, fenced.id)
        conn.hset(keys.rq_job(running.id), "status", "started")
        conn.lrem("rq:queue:default", 0, running.id)

        result = transport.refill(
            [Probe(finished.id, finished.key_id, "default")],
            [Delivery(e, "o", ("w", 0, 64), gen=1) for e in (queued, fenced, running, missing)],
        )
        assert (result.requeued, result.purged) == (3, 1)
        assert not conn.exists(keys.rq_job(finished.id))
        assert [i.decode() for i in conn.lrange("rq:queue:default", 0, -1)] == [
            other.id,
            queued.id,  # rewritten in place: it keeps its place
            fenced.id,
            missing.id,
        ]
        for env in (queued, fenced, missing):
            job = transport.connection.hgetall(keys.rq_job(env.id))
            assert job[b"status"] == b"queued"
            assert b"hybridq_fenced" not in job
            data = job_data(job[b"data"])
            assert data[2][0]["gen"] == 1
        assert conn.hget(keys.rq_job(running.id), "status") == b"started"  # the reconcile pass's
    finally:
        transport.close()
