"""A private PostgreSQL to try the outbox on, and for tests: no root, no apt, no TCP port.

``python -m hybridq.testing.postgres [DIR]`` starts one and prints its DSN on stdout, then runs
until Ctrl-C (or SIGTERM) stops it; without ``DIR`` its data lives in a temporary directory
removed at the end, with ``DIR`` it is kept there and the next start reuses it (docs/outbox.md,
"Trying it on PostgreSQL"). The binaries are a ``postgres`` found on PATH (``HYBRIDQ_POSTGRES_BIN``
may name another ``bin`` directory), else those the ``pgserver`` wheel of the ``postgres`` extra
ships (PostgreSQL 16). It listens on a unix socket in its directory only (``listen_addresses``
is empty). As root, where PostgreSQL refuses to run, it runs as ``nobody``.

For trying and tests only, like the demo's Redis: ``fsync=off`` (a killed server keeps every
committed transaction, a power cut may not), trust authentication for local users. The test
suite's ``postgres_server`` fixture (``tests/support/postgres.py``) is this server.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from hybridq.extras import require

__all__ = ["PostgresServer", "find_bin", "main"]

#: A ``bin`` directory with ``postgres`` and ``initdb`` in it, looked at first.
ENV_BIN = "HYBRIDQ_POSTGRES_BIN"
START_TIMEOUT_S = 30.0
#: ``sun_path`` holds 107 bytes: the socket ``DIR/.s.PGSQL.5432`` must fit.
_SOCKET_NAME = ".s.PGSQL.5432"
_SUN_PATH_MAX = 107


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
    """A private PostgreSQL cluster in a directory of its own, on a unix socket only.

    Args:
        bindir: where ``postgres`` and ``initdb`` are (:func:`find_bin`'s answer by default).
        directory: where its data, log and socket go (kept; created when missing); by default a
            new short temporary directory, removed by :meth:`destroy`.

    Raises:
        FileNotFoundError: no PostgreSQL binaries were found.
        ValueError: ``directory`` is too long a path for the socket.
    """

    def __init__(
        self, bindir: Path | None = None, *, directory: str | os.PathLike[str] | None = None
    ) -> None:
        found = bindir or find_bin()
        if found is None:
            raise FileNotFoundError(
                f"no PostgreSQL: neither a postgres on PATH (or in ${ENV_BIN}) nor the pgserver wheel "
                "(pip install 'hybridq[postgres]')"
            )
        self.bindir = found
        self._owned = directory is None
        # sun_path holds 107 bytes: a short directory under /tmp holds the socket.
        self.base = (
            Path(tempfile.mkdtemp(prefix="hq-pg-", dir="/tmp")) if directory is None else Path(directory)
        )
        if len(os.fsencode(os.path.abspath(self.base / _SOCKET_NAME))) > _SUN_PATH_MAX:
            raise ValueError(f"{self.base}: too long a path for PostgreSQL's socket; give a shorter one")
        self.base = self.base.absolute()
        self.base.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data = self.base / "data"
        self.log = self.base / "log"
        self.process: subprocess.Popen[bytes] | None = None
        self._user: tuple[int, int] | None = None
        if os.geteuid() == 0:
            entry = pwd.getpwnam("nobody")
            self._user = (entry.pw_uid, entry.pw_gid)
            os.chown(self.base, *self._user)
        self._databases = itertools.count()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.destroy()

    def _as_user(self) -> dict[str, object]:
        if self._user is None:
            return {}
        return {"user": self._user[0], "group": self._user[1], "extra_groups": []}

    def _run(self, *args: str) -> None:
        result = subprocess.run(  # type: ignore[call-overload]  # noqa: S603 - our own binaries
            args, capture_output=True, timeout=120, check=False, cwd=self.base, **self._as_user()
        )
        if result.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {result.stderr.decode(errors='replace')[-2000:]}")

    def start(self) -> None:
        """Start the server (``initdb`` the first time); wait until it accepts connections."""
        if not (self.data / "PG_VERSION").exists():
            self._run(
                str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                "--encoding=UTF8", "--no-sync",
            )  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(  # type: ignore[call-overload]  # noqa: S603 - our own binaries
                [str(self.bindir / "postgres"), "-D", str(self.data), "-k", str(self.base), *_settings()],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=self.base,
                start_new_session=True,
                **self._as_user(),
            )
        self.wait_ready()

    def wait_ready(self) -> None:
        """Until the server accepts connections (RuntimeError, with its log, if it exits or hangs)."""
        require("postgres", "a private PostgreSQL", "psycopg")
        import psycopg  # noqa: PLC0415 - the postgres extra

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited {self.process.returncode}: {self.tail()}")
            try:
                psycopg.connect(self.dsn(), connect_timeout=2).close()
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"postgres did not answer in {START_TIMEOUT_S} s: {self.tail()}"
                    ) from None
                time.sleep(0.02)
            else:
                return

    def tail(self) -> str:
        """The end of the server's log."""
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
        """Stop it; remove its directory if it made that directory itself."""
        self.stop()
        if self._owned:
            shutil.rmtree(self.base, ignore_errors=True)

    def dsn(self, database: str = "postgres") -> str:
        """The DSN of ``database`` on it (``postgresql://postgres@/DB?host=DIR``)."""
        return f"postgresql://postgres@/{database}?host={self.base}"

    def create_database(self) -> str:
        """A fresh, empty database; its DSN."""
        import psycopg  # noqa: PLC0415 - the postgres extra

        name = f"t{os.getpid()}_{next(self._databases)}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    @property
    def version(self) -> str:
        """``postgres (PostgreSQL) 16.x``."""
        command = [str(self.bindir / "postgres"), "--version"]
        result = subprocess.run(command, capture_output=True, check=True)  # noqa: S603 - our own binary
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


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridq.testing.postgres [DIR]``: start one, print its DSN, stop it on Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="python -m hybridq.testing.postgres",
        description="A private PostgreSQL to try hybridq's outbox on (not for production: fsync is "
        "off). Prints its DSN, runs until Ctrl-C.",
    )
    parser.add_argument(
        "dir", nargs="?", help="keep its data here (reused next time); default: a temporary one"
    )
    args = parser.parse_args(argv)
    stop = False

    def stopping(*_: object) -> None:
        nonlocal stop
        stop = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stopping)
    try:
        require("postgres", "python -m hybridq.testing.postgres", "psycopg")
        server = PostgresServer(directory=args.dir)
        server.start()
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        sys.stderr.write(f"hybridq.testing.postgres: error: {exc}\n")
        return 1
    try:
        sys.stdout.write(f"{server.dsn()}\n")
        sys.stdout.flush()
        sys.stderr.write(
            f"{server.version} in {server.base} (fsync off: for trying, not for production); "
            f"Ctrl-C stops it{'' if args.dir else ' and removes it'}\n"
        )
        while not stop and server.process is not None and server.process.poll() is None:
            with contextlib.suppress(InterruptedError):
                time.sleep(0.2)
        if not stop:
            sys.stderr.write(f"hybridq.testing.postgres: error: postgres exited: {server.tail()}\n")
            return 1
    finally:
        server.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
