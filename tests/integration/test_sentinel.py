"""``redis+sentinel://`` against real servers: a demoted master, and the commands through Sentinel.

* A client still connected to a master that was demoted to a replica gets ``READONLY`` on its
  next write. For a plain command redis-py already turns it into a ConnectionError (retried by
  hybridq as any outage) and drops the connection, so the next one asks the Sentinels again; inside a script (every write hybridq makes) Redis 6 wraps the reply in
  ``ERR Error running script ... -READONLY ...``, which redis-py's class passes up as an error
  (the "before" below): hybridq's connection class treats both alike. The Sentinels are stood in
  for by an object that names the replica first, then the master, so the test needs no election.
* ``hybridq forward``, ``status``, ``doctor`` and ``worker --simple`` given only a Sentinel URL (a
  real master, replica and three Sentinels).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.testing.embedded import RedisServer
from hybridq.transport import redisurl
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection

from tests.integration.test_worker_redis import Stack, all_succeeded, stack, wait_status
from tests.support.processes import wait_until
from tests.support.redis import MakeRedisServer
from tests.support.sentinel import SentinelProcess, SentinelTopology

__all__ = ["stack"]  # the fixture, used by this module's tests

WRITE_SCRIPT = "return redis.call('SET', KEYS[1], ARGV[1])"


class Sentinels:
    """Stands in for redis-py's Sentinel manager: names each address in turn, then the last."""

    def __init__(self, *servers: RedisServer) -> None:
        self.addresses = [("127.0.0.1", s.port) for s in servers]
        self.asked = 0

    def discover_master(self, _service: str) -> tuple[str, int | None]:
        self.asked += 1
        return self.addresses[min(self.asked, len(self.addresses)) - 1]


@pytest.fixture
def demoted(make_redis_server: MakeRedisServer) -> tuple[RedisServer, RedisServer]:
    """(master, replica): the replica plays the master that was demoted since the client connected."""
    master = make_redis_server()
    return master, make_redis_server(extra_args=("--replicaof", "127.0.0.1", str(master.port)))


def test_redis_py_alone_does_not_follow_a_demotion_reported_inside_a_script(
    demoted: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = demoted
    pool = SentinelConnectionPool(
        "svc", Sentinels(replica, master), connection_class=SentinelManagedConnection
    )
    client = redisurl.client("redis://127.0.0.1:1/0")  # any client: the pool is replaced
    client.connection_pool = pool
    try:
        with pytest.raises(ResponseError, match="READONLY"):
            client.eval(WRITE_SCRIPT, 1, "k", "v")
    finally:
        pool.disconnect()


@pytest.mark.parametrize("write", ["command", "script"])
def test_a_client_on_a_demoted_master_asks_the_sentinels_again(
    demoted: tuple[RedisServer, RedisServer], write: str
) -> None:
    master, replica = demoted
    client = redisurl.client("redis+sentinel://127.0.0.1:1/svc/0", socket_timeout=5.0)
    sentinels = Sentinels(replica, master)
    client.connection_pool.proxy.sentinel_manager = sentinels  # type: ignore[attr-defined]
    try:
        # Like any broken connection, the first try is a ConnectionError (hybridq's loops retry
        # those with backoff); the connection is dropped, and the next one goes to the master.
        for attempt in (1, 2):
            try:
                if write == "command":
                    client.set("k", "v")
                else:
                    client.eval(WRITE_SCRIPT, 1, "k", "v")
            except RedisConnectionError:
                assert attempt == 1
        assert sentinels.asked == 2, "the demoted master's reply made the client ask again"
        with contextlib.closing(master.client()) as direct:
            assert direct.get("k") == b"v"
    finally:
        client.close()


def hybridq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridq", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_forward_status_doctor_and_worker_through_a_sentinel_url(
    sentinel_topology: SentinelTopology,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    # A dead Sentinel listed first is skipped at once (redis-py's default retries: 4.4 s each time).
    hosts = ",".join(
        [f"127.0.0.1:{_closed_port()}", *(f"127.0.0.1:{s.port}" for s in sentinel_topology.sentinels)]
    )
    client = redisurl.client(f"redis+sentinel://{hosts}/mymaster/0")
    started = time.monotonic()
    assert client.ping()
    client.close()
    assert time.monotonic() - started < 1.0
    env = {**subprocess_env, "HYBRIDQ_REDIS_URL": sentinel_topology.url}  # the environment's form
    queue = Queue("default", journal_dir)
    for i in range(5):
        queue.enqueue("tests.tasks.record", str(tmp_path / "effects.txt"), f"t{i}")
    stack.env = env
    stack.forwarder(sentinel_topology.url)
    with contextlib.closing(sentinel_topology.master.client()) as client:
        wait_until(lambda: client.llen("rq:queue:default") == 5, what="5 jobs pushed through Sentinel")
    done = hybridq(env, "worker", "--simple", "--burst", "default")
    assert done.returncode == 0, done.stderr
    wait_status(journal_dir, env, all_succeeded(5), what="5 jobs")
    status = hybridq(env, "status", "--json", "--journal", str(journal_dir))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["redis"]["up"] is True
    # status --all through the Sentinel URL: the forwarder published there as it pushes there.
    every = hybridq(env, "status", "--all", "--json")
    assert every.returncode == 0, every.stderr
    fleet = json.loads(every.stdout)
    assert (fleet["fresh"], [f["accepted"] for f in fleet["forwarders"]]) == (1, [5])
    doctor = hybridq(env, "doctor", "--journal", str(journal_dir))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert (tmp_path / "effects.txt").read_text().split() == [f"t{i}" for i in range(5)]


def test_a_login_the_sentinels_refuse_is_a_refusal_not_an_outage(
    tmp_path: Path, journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    """A Sentinel with ``requirepass``: a wrong or missing ``sentinel_password`` makes the commands
    exit with one line (as a wrong Redis password does); the right one gets past the Sentinel."""
    sentinel = SentinelProcess(tmp_path / "sentinel", _closed_port(), extra=("requirepass s3cret",))
    try:
        wait_until(lambda: _answers(sentinel), what="the Sentinel to answer")
        base = f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster/0"
        for url in (base, base + "?sentinel_password=wrong"):
            client = redisurl.client(url)
            with pytest.raises(AuthenticationError) as caught:
                client.ping()
            client.close()
            assert redisurl.refusal(caught.value) == "login refused: check the user name and password"
        client = redisurl.client(base + "?sentinel_password=s3cret&sentinel_timeout=0.5", socket_timeout=0.5)
        with pytest.raises(RedisConnectionError) as other:
            client.ping()  # past the Sentinel: the master it names is not there
        client.close()
        assert redisurl.refusal(other.value) is None
        env = {**subprocess_env, "HYBRIDQ_REDIS_URL": base + "?sentinel_password=wrong"}
        done = hybridq(env, "worker", "default")  # not --burst: an outage would be waited out
        assert done.returncode == 1, done.stderr
        assert "hybridq: error: Redis refused this configuration (login refused" in done.stderr
        assert "wrong" not in done.stderr
    finally:
        sentinel.stop()


def _answers(sentinel: SentinelProcess) -> bool:
    with contextlib.closing(sentinel.client()) as client:
        try:
            client.ping()
        except AuthenticationError:
            return True  # it answers, and wants a password
        except RedisError:
            return False
    return True


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
