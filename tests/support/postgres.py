"""A private PostgreSQL server for the outbox tests (docs/outbox.md), like ``redis.py`` for Redis.

One server per test session (``postgres_server``), started on first use: a ``postgres`` found
on PATH (``HYBRIDQ_POSTGRES_BIN`` may name another ``bin`` directory), else the binaries the
``pgserver`` wheel ships (PostgreSQL 16; ``pip install 'hybridq[postgres]'``). It listens on a
unix socket in its own short temporary directory only (``listen_addresses`` is empty: no TCP
port at all). As root, PostgreSQL refuses to run: the server then runs as ``nobody``.

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
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = ["PostgresServer", "find_bin", "make_postgres_server", "pg_dsn", "postgres_server"]

ENV_BIN = "HYBRIDQ_POSTGRES_BIN"
START_TIMEOUT_S = 30.0


def find_bin() -> Path | None:
    """The ``bin`` directory of a PostgreSQL install (with ``postgres`` and ``initdb``), or None."""
    candidates: list[Path] = []
    if os.environ.get(ENV_BIN):
        candidates.append(Path(os.environ[ENV_BIN]))
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(Path(os.path.realpath(on_path)).parent)
    spec = importlib.util.find_spec("pgserver")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "pginstall" / "bin")
    for path in candidates:
        if (path / "postgres").is_file() and (path / "initdb").is_file():
            return path
    return None


class PostgresServer:
    """A private PostgreSQL cluster in a temporary directory, on a unix socket only."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        # sun_path holds 107 bytes: a short directory under /tmp holds the socket.
        self.base = Path(tempfile.mkdtemp(prefix="hq-pg-", dir="/tmp"))
        self.data = self.base / "data"
        self.log = self.base / "log"
        self.process: subprocess.Popen[bytes] | None = None
        self._user: tuple[int, int] | None = None
        if os.geteuid() == 0:
            entry = pwd.getpwnam("nobody")
            self._user = (entry.pw_uid, entry.pw_gid)
            os.chown(self.base, *self._user)
        self._databases = itertools.count()

    def _run(self, *args: str) -> None:
        kwargs: dict[str, object] = {}
        if self._user is not None:
            kwargs.update(user=self._user[0], group=self._user[1], extra_groups=[])
        result = subprocess.run(args, capture_output=True, timeout=120, check=False, cwd=self.base, **kwargs)  # type: ignore[call-overload]
        if result.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {result.stderr.decode(errors='replace')[-2000:]}")

    def start(self) -> None:
        """initdb (first time), start the server, wait until it accepts connections."""
        if not (self.data / "PG_VERSION").exists():
            self._run(
                str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                "--encoding=UTF8", "--no-sync",
            )  # fmt: skip
        kwargs: dict[str, object] = {}
        if self._user is not None:
            kwargs.update(user=self._user[0], group=self._user[1], extra_groups=[])
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(  # type: ignore[call-overload]
                [str(self.bindir / "postgres"), "-D", str(self.data), "-k", str(self.base), *_settings()],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=self.base,
                start_new_session=True,
                **kwargs,
            )
        self.wait_ready()

    def wait_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited {self.process.returncode}: {self.tail()}")
            try:
                psycopg.connect(self.dsn("postgres"), connect_timeout=2).close()
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"postgres did not answer in {START_TIMEOUT_S} s: {self.tail()}"
                    ) from None
                time.sleep(0.02)
            else:
                return

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def stop(self, *, immediate: bool = False) -> None:
        """Stop the server: a fast shutdown, or an immediate one (as after a crash: recovery on start)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT if immediate else signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self.process = None

    def restart(self, *, immediate: bool = True, down_s: float = 0.0) -> None:
        """Stop the server (every session is cut), stay down ``down_s`` seconds, start it again."""
        self.stop(immediate=immediate)
        time.sleep(down_s)
        self.start()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def dsn(self, database: str) -> str:
        return f"postgresql://postgres@/{database}?host={self.base}"

    def create_database(self) -> str:
        """A fresh, empty database; its DSN."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._databases)}"
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    @property
    def version(self) -> str:
        result = subprocess.run([str(self.bindir / "postgres"), "--version"], capture_output=True, check=True)
        return result.stdout.decode().strip()


def _settings() -> list[str]:
    settings = {
        "listen_addresses": "",  # the unix socket only: no TCP port
        "fsync": "off",
        "full_page_writes": "off",
        "max_connections": "200",
        "shared_buffers": "32MB",
    }
    return [arg for name, value in settings.items() for arg in ("-c", f"{name}={value}")]


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
