"""A private PostgreSQL server for the outbox tests (docs/outbox.md), like ``redis.py`` for Redis.

One server per test session (``postgres_server``), started on first use: the one
``python -m hybridq.testing.postgres`` starts for users trying the outbox
(:class:`hybridq.testing.postgres.PostgresServer`: a ``postgres`` found on PATH, else the
``pgserver`` wheel's, on a unix socket in its own short temporary directory, as ``nobody`` when
run as root).

``pg_dsn`` gives each test a fresh, empty database on it and its DSN. A test that restarts or
stops the server (``PostgresServer.restart``) gets its own server with ``make_postgres_server``.
Tests are skipped, with the reason, only when neither binary can be found or started.

Everything here is test support: the server runs with ``fsync=off`` (the machine never loses
power under a test; a killed or restarted server still keeps every committed transaction).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import subprocess
from collections.abc import Callable, Iterator

import pytest
from hybridq.testing.postgres import PostgresServer, find_bin

__all__ = ["PostgresServer", "find_bin", "make_postgres_server", "pg_dsn", "postgres_server"]


def _start_or_skip() -> PostgresServer:
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("psycopg 3 is not installed (pip install 'hybridq[postgres]')")
    bindir = find_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL: neither a postgres on PATH nor the pgserver wheel (hybridq[postgres])")
    try:
        server = PostgresServer(bindir)  # as root: needs the user nobody
    except (KeyError, OSError) as exc:
        pytest.skip(f"PostgreSQL from {bindir} cannot be set up: {exc}")
    atexit.register(server.destroy)  # a run that ends without its teardown leaves no server behind
    try:
        server.start()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        server.destroy()
        pytest.skip(f"PostgreSQL from {bindir} did not start: {exc}")
    return server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's private PostgreSQL server (started on first use)."""
    server = _start_or_skip()
    yield server
    server.destroy()


@pytest.fixture
def pg_dsn(postgres_server: PostgresServer) -> str:
    """The DSN of a fresh, empty database on the session's server."""
    return postgres_server.create_database()


@pytest.fixture
def make_postgres_server() -> Iterator[Callable[[], PostgresServer]]:
    """A factory of private servers of the test's own (to restart or stop); destroyed at teardown."""
    servers: list[PostgresServer] = []

    def make() -> PostgresServer:
        server = _start_or_skip()
        servers.append(server)
        return server

    yield make
    for server in servers:
        with contextlib.suppress(Exception):
            server.destroy()
