"""A TCP proxy between hybridq's clients and Redis that injects network faults (tests, chaos).

Clients (the forwarder, workers, ``hybridq status``) connect to the proxy's :attr:`FaultProxy.url`
instead of Redis; every connection gets its own connection to the upstream Redis and its own
thread, which moves bytes both ways with non-blocking sockets. Faults are switched at runtime,
from any thread, and apply to open and new connections alike:

* :meth:`~FaultProxy.latency`: every chunk is delivered this long after it was read, per
  direction (a request/reply round trip costs both).
* :meth:`~FaultProxy.reset`: every open connection is reset (RST, ``SO_LINGER`` 0) now.
  :meth:`~FaultProxy.refuse`: every new connection is reset as soon as it is accepted.
* :meth:`~FaultProxy.blackhole`: nothing moves and new connections are held, unanswered, as
  on a partitioned network: clients must time out. When it is lifted the held bytes flow again,
  as TCP delivers them after a partition heals, so a command a client has given up on may still
  run (then call :meth:`~FaultProxy.reset` too, if the partition should have outlived TCP).
* :meth:`~FaultProxy.cut_replies`: a matching command goes to Redis and runs, then the client's
  connection is reset instead of delivering its reply: the write happened, the client never
  heard (the "unknown outcome"). Replies to earlier commands are delivered first. An error
  reply (``NOSCRIPT``, ``EXECABORT``: nothing ran) is delivered, and the next match is cut.

To know which reply answers which command, the proxy reads the Redis protocol (RESP2 and RESP3)
in both directions; bytes are forwarded unchanged. Out-of-band replies (RESP3 pushes, pub/sub
messages) match no command and are never cut.

With ``ssl_context`` the proxy terminates TLS on the listening side (``rediss://`` clients) and
talks plaintext to Redis, so a TLS client can be tested against a redis-server built without
TLS. The upstream connection is opened only after the TLS handshake succeeded.

This module holds the listener and the fault switches; each connection is a link
(:mod:`hybridq.testing.faultproxy_link`), which reads the switches under the proxy's lock, and
the RESP framing is :mod:`hybridq.testing.faultproxy_resp`. Only the standard library is used.
The chaos harness and the tests use this module; hybridq's own code never does.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

# Re-exported for the old import path; the code reading these constants is in faultproxy_link: patch there.
from hybridq.testing.faultproxy_link import CHUNK as CHUNK  # noqa: PLC0414 - re-exported
from hybridq.testing.faultproxy_link import CONNECT_TIMEOUT_S as CONNECT_TIMEOUT_S  # noqa: PLC0414 - re-exported
from hybridq.testing.faultproxy_link import MAX_BUFFERED as MAX_BUFFERED  # noqa: PLC0414 - re-exported
from hybridq.testing.faultproxy_link import POLL_S, _Link
from hybridq.testing.faultproxy_resp import Command as Command  # noqa: PLC0414 - re-exported
from hybridq.testing.faultproxy_resp import CommandMatch, parse_command, reply_end, script_call

__all__ = ["CommandMatch", "FaultProxy", "FaultStats", "parse_command", "reply_end", "script_call"]


@dataclass
class FaultStats:
    """What the proxy has done so far."""

    #: Connections accepted.
    connections: int = 0
    #: Connections reset by :meth:`FaultProxy.reset` or :meth:`FaultProxy.refuse`.
    resets: int = 0
    #: Replies withheld by :meth:`FaultProxy.cut_replies` (each reset its connection too).
    cuts: int = 0
    #: Client TLS handshakes that failed (e.g. the client did not trust the certificate).
    tls_failures: int = 0


@dataclass
class _CutRule:
    match: Callable[[Command], bool]
    every: int
    left: int
    seen: int = 0


class FaultProxy:
    """A fault-injecting TCP proxy in front of one Redis (see the module docstring).

    Use it as a context manager, or call :meth:`start` and :meth:`stop`.

    Args:
        upstream_host: where Redis listens.
        upstream_port: its port.
        ssl_context: a server-side context: clients must speak TLS to the proxy (``rediss://``).
        host: the address to listen on.
        port: the port to listen on (0: a free one; see :attr:`port` once started).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.ssl_context = ssl_context
        self.host = host
        self._port = port
        self.stats = FaultStats()
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = False
        # The faults (read by every connection's thread on each turn of its loop).
        self.delay_up_s = 0.0
        self.delay_down_s = 0.0
        self.holding = False
        self.refusing = False
        self._cut: _CutRule | None = None

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        if self._listener is None:
            raise RuntimeError("the proxy is not started")
        return self._port

    @property
    def url(self) -> str:
        """A URL of database 0 through the proxy (``rediss://`` when it terminates TLS)."""
        scheme = "rediss" if self.ssl_context is not None else "redis"
        return f"{scheme}://{self.host}:{self.port}/0"

    def start(self) -> None:
        """Listen, and accept connections in a thread."""
        if self._listener is not None:
            raise RuntimeError("the proxy is already started")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self._port))
        listener.listen(128)
        listener.settimeout(POLL_S)  # accept() wakes up to notice stop()
        self._port = listener.getsockname()[1]
        self._listener = listener
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        """Stop accepting, reset every connection, wait for their threads. Idempotent."""
        self._stopping = True
        if self._acceptor is not None:
            self._acceptor.join()
            self._acceptor = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.reset()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the faults ---------------------------------------------------------------------------

    def latency(self, up_s: float, down_s: float | None = None) -> None:
        """Delay client-to-Redis bytes by ``up_s`` and Redis-to-client bytes by ``down_s`` (default: same)."""
        if up_s < 0 or (down_s is not None and down_s < 0):
            raise ValueError("latency cannot be negative")
        self.delay_up_s = up_s
        self.delay_down_s = up_s if down_s is None else down_s

    def reset(self) -> int:
        """Reset every open connection (RST) and wait until they are gone; return how many."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.abort_requested = True
        for link in links:
            link.thread.join()
        return len(links)

    def refuse(self, on: bool = True) -> None:
        """While on, reset every new connection as soon as it is accepted."""
        self.refusing = on

    def blackhole(self, on: bool = True) -> None:
        """While on, move no bytes and hold new connections; off: the held bytes flow again."""
        self.holding = on

    def cut_replies(self, n: int = 1, match: CommandMatch | None = None, *, every: int = 1) -> None:
        """Withhold the replies of the next ``n`` matching commands, resetting their connections.

        Args:
            n: how many replies to cut; then the fault disarms itself.
            match: a command name such as ``b"EXEC"`` (any case), a predicate on the command
                (see :func:`script_call`), or ``None`` for every command.
            every: cut only every ``every``-th matching command's reply.
        """
        if n < 0 or every < 1:
            raise ValueError("n must be >= 0 and every >= 1")
        if match is None:
            predicate: Callable[[Command], bool] = lambda _command: True  # noqa: E731
        elif isinstance(match, bytes):
            name = match.upper()
            predicate = lambda command: bool(command) and command[0].upper() == name  # noqa: E731
        else:
            predicate = match
        with self._lock:
            self._cut = _CutRule(predicate, every, n)

    @property
    def cuts_left(self) -> int:
        """How many replies the armed :meth:`cut_replies` still has to cut."""
        with self._lock:
            return self._cut.left if self._cut is not None else 0

    def clear(self) -> None:
        """Remove every fault: no latency, no blackhole (held bytes flow), no refusal, no cuts."""
        with self._lock:
            self._cut = None
        self.delay_up_s = self.delay_down_s = 0.0
        self.refusing = False
        self.holding = False

    # -- for the connections ------------------------------------------------------------------

    def _matches(self, command: Command) -> bool:
        """Whether the armed cut applies to ``command`` (its reply may be cut)."""
        with self._lock:
            rule = self._cut
            return rule is not None and rule.left > 0 and rule.match(command)

    def _take_cut(self) -> bool:
        """A matching command's reply arrived: whether to cut it (counts towards ``every``, ``n``)."""
        with self._lock:
            rule = self._cut
            if rule is None or rule.left <= 0:
                return False
            rule.seen += 1
            if rule.seen % rule.every:
                return False
            rule.left -= 1
            self.stats.cuts += 1
            return True

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + 1)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # out of fds, say: the client waits in the backlog meanwhile
                time.sleep(POLL_S)
                continue
            link = _Link(self, client)
            with self._lock:  # started under the lock: reset() may join any link it sees
                self.stats.connections += 1
                self._links.add(link)
                link.thread.start()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)
