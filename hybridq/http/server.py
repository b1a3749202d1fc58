"""uvicorn serving the application: in the foreground, or in a thread (``forward --serve``).

The socket is bound here, before uvicorn starts, so that port 0 works and the address is known
(:attr:`Server.address`) before the first request. uvicorn logs through the ``logging`` setup of
the command (its ``log_config`` is not applied); its access log says the client, method, path
and status of each request, never a header (so never a token).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import stat
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from hybridq.http.config import ServeConfig
from hybridq.http.connections import Guard, protocol_for

__all__ = ["Server", "bind_socket", "bind_unix"]

#: Seconds a stopping server gives requests in flight to finish.
GRACEFUL_S = 10
#: Connections waiting to be accepted (uvicorn's default).
BACKLOG = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one).

    Raises:
        OSError: the address cannot be bound (in use, not ours, not resolvable).
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


#: The mode of a unix socket ``--bind unix:PATH`` makes: its owner and group may connect.
UNIX_MODE = 0o660


def bind_unix(path: str) -> socket.socket:
    """A unix stream socket bound at ``path``, mode :data:`UNIX_MODE`, not listening yet.

    A socket file left at ``path`` by a server that is gone is replaced; anything else there
    (a live server's socket, a file, a link) is not.

    Raises:
        OSError: ``path`` is in use, is not a socket, or cannot be bound.
    """
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket: not replaced")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # left by a server that is gone
        else:
            raise OSError(errno.EADDRINUSE, f"{path}: another server is listening there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # Before listen(): until then a connect is refused, whatever mode the umask gave the file.
        os.chmod(path, UNIX_MODE)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, stopped by SIGTERM or SIGINT with exit 0 (uvicorn re-raises the signal).

    A second signal stops it at once, as in uvicorn.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # in a thread (forward --serve): its owner calls Server.stop
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        del sig, frame
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


class Server:
    """uvicorn serving ``app`` on ``config.host:config.port``.

    Args:
        app: the ASGI application (:func:`hybridq.http.app.create_app`).
        config: the server's settings.
        **uvicorn_options: more ``uvicorn.Config`` options (the benchmark's ``access_log``).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, app: Any, config: ServeConfig, **uvicorn_options: Any) -> None:
        self.unix_path = None if config.unix_path is None else str(config.unix_path)
        self.sock = (
            bind_socket(config.host, config.port) if self.unix_path is None else bind_unix(self.unix_path)
        )
        # Listening now: a client that connects before uvicorn's loop runs waits in the backlog.
        self.sock.listen(BACKLOG)
        options: dict[str, Any] = {
            "log_config": None,
            "access_log": config.access_log,
            "proxy_headers": True,
            "forwarded_allow_ips": config.forwarded_allow_ips,
            "server_header": False,
            "timeout_graceful_shutdown": GRACEFUL_S,
            "lifespan": "off",
            "backlog": BACKLOG,
            # Slow or idle clients: a bound on what they hold (the body deadline is the API's):
            # a deadline for headers, idle connections closed to make room, a share per client.
            "limit_concurrency": config.limit_concurrency,
            "timeout_keep_alive": config.keep_alive_s,
            "http": protocol_for(
                Guard(config.limit_concurrency, config.client_connections, config.header_timeout_s)
            ),
            **uvicorn_options,
        }
        self.uvicorn = _Uvicorn(uvicorn.Config(app, **options))
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound host and port."""
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """``http://host:port`` of the bound address (``unix:PATH`` for a unix socket)."""
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT (in the main thread: uvicorn handles both)."""
        bound = os.stat(self.unix_path) if self.unix_path is not None else None
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:
            self.sock.close()
            if self.unix_path is not None and bound is not None:
                with contextlib.suppress(OSError):  # only our own socket file, not a successor's
                    now = os.stat(self.unix_path)
                    if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
                        os.unlink(self.unix_path)

    def start(self) -> None:
        """Serve in a thread of this process (signals stay the caller's: call :meth:`stop`)."""
        self._thread = threading.Thread(target=self.run, name="hybridq-serve", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = GRACEFUL_S + 5) -> None:
        """Stop the thread :meth:`start` began, after the requests in flight (or ``timeout``)."""
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
