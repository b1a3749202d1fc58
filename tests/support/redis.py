"""Fixtures giving each test its own private redis-server (never the developer's Redis on 6379).

Registered for every test module by ``pytest_plugins`` in ``tests/conftest.py``.
``redis_server`` is a fresh, running :class:`~hybridq.testing.embedded.RedisServer` on a free loopback
port under ``tmp_path``, killed (SIGKILL) after the test. ``make_redis_server(**options)`` starts as many
as a test needs (``unix_socket=True`` for a socket in a short temporary directory) and kills
every one of them at teardown.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq.testing.embedded import RedisServer

__all__ = ["make_redis_server", "redis_server"]

MakeRedisServer = Callable[..., RedisServer]


@pytest.fixture
def make_redis_server(tmp_path: Path) -> Iterator[MakeRedisServer]:
    """A factory of started private servers; every one is killed at teardown."""
    servers: list[RedisServer] = []
    socket_dirs: list[str] = []

    def make(*, unix_socket: bool | str = False, start: bool = True, **options: Any) -> RedisServer:
        directory = tmp_path / f"redis-{len(servers)}"
        if unix_socket is True:
            # sun_path holds 107 bytes: tmp_path can be longer than that (macOS, deep TMPDIRs).
            socket_dirs.append(tempfile.mkdtemp(prefix="hq-", dir="/tmp"))
            unix_socket = str(Path(socket_dirs[-1]) / "redis.sock")
        server = RedisServer(directory=directory, unix_socket=unix_socket or None, **options)
        servers.append(server)
        if start:
            server.start()
        return server

    yield make
    for server in servers:
        # SIGKILL, not stop(): a SIGTERM waits for Redis's next serverCron tick (hz 10), 90 ms per
        # server measured, and nothing of it is read after the test.
        server.kill()
    for path in socket_dirs:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def redis_server(make_redis_server: MakeRedisServer) -> RedisServer:
    """A fresh, empty, running private redis-server on a free port; killed after the test."""
    return make_redis_server()
