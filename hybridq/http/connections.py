"""What a connection may hold of ``hybridq serve``: a deadline for headers, a share per client.

uvicorn gives a connection no deadline before its request's headers are complete, and counts an
idle connection against ``limit_concurrency`` like a busy one: a thousand idle or half-sent
connections, no token needed, had every client answered 503 for as long as they were held.
:class:`GuardedH11` (uvicorn's h11 protocol, with :class:`Guard`'s rules) bounds that:

* **A deadline for headers**: a connection must complete a request's headers within
  ``header_timeout_s`` of opening, or of its previous response (a keep-alive connection): else
  it is closed (a ``408`` first if it had sent part of a request). The body has its own deadline
  (the API's, ``body_timeout_s``).
* **Idle connections make room**: when a new connection finds its client at its share, or the
  server at ``limit_concurrency``, the oldest connection still waiting for a request's headers
  (its client's, or anyone's) is closed. A connection whose request is being served is never
  closed for another; if none is idle, a client over its share is refused at once, and the
  server over its limit answers 503 as before.
* **A share per client**: at most ``client_connections`` connections per client address (per
  user on a unix socket), so one address cannot hold every slot with requests in flight (slow
  login bodies need no token).

A client is its peer address: everyone on one host, or behind one proxy, is one client (raise
``--client-connections`` behind a proxy; on a shared host, a unix socket's file permissions keep
other users out, docs/http.md).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["Guard", "GuardedH11", "protocol_for"]

log = logging.getLogger("hybridq.http")

#: Seconds between two warnings about connections closed to make room (they are counted meanwhile).
WARN_EVERY_S = 10.0
_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class Guard:
    """The connections of one server, by client, and those waiting for a request's headers.

    Args:
        limit: the most connections (uvicorn's ``limit_concurrency``).
        per_client: the most connections of one client.
        header_timeout_s: how long a connection may take to send a request's headers.
    """

    def __init__(self, limit: int, per_client: int, header_timeout_s: float) -> None:
        self.limit = limit
        self.per_client = per_client
        self.header_timeout_s = header_timeout_s
        self.clients: dict[object, set[GuardedH11]] = {}
        #: Connections waiting for a request's headers, oldest first (a dict keeps the order).
        self.waiting: dict[GuardedH11, None] = {}
        self._closed = 0
        self._warned = -WARN_EVERY_S

    def admit(self, conn: GuardedH11, everyone: set[Any]) -> bool:
        """Make room for ``conn`` (closing idle ones); ``False``: ``conn`` must be refused.

        ``everyone``: uvicorn's set of the server's connections (``conn`` included).
        """
        mine = self.clients.setdefault(conn.client_key, set())
        if len(mine) >= self.per_client and not self._evict(everyone, conn.client_key):
            self._note(f"client {conn.client_key} is at its {self.per_client} connections: refused one")
            return False
        while len(everyone) >= self.limit and self._evict(everyone, None):
            pass
        mine.add(conn)
        return True

    def _evict(self, everyone: set[Any], key: object) -> bool:
        """Close the oldest connection waiting for headers (of client ``key``, or anyone's)."""
        victim = next((c for c in self.waiting if key is None or c.client_key == key), None)
        if victim is None:
            return False
        victim.close_idle()
        everyone.discard(victim)  # uvicorn drops it at connection_lost: count it gone now
        self.forget(victim)
        self._note("closed the oldest idle connection to make room for a new one")
        return True

    def forget(self, conn: GuardedH11) -> None:
        """``conn`` is closed."""
        self.waiting.pop(conn, None)
        mine = self.clients.get(conn.client_key)
        if mine is not None:
            mine.discard(conn)
            if not mine:
                del self.clients[conn.client_key]

    def _note(self, what: str) -> None:
        """Log ``what`` at most every :data:`WARN_EVERY_S` (a flood must not flood the log)."""
        self._closed += 1
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            log.warning("%s (%d such since the last warning; docs/http.md)", what, self._closed)
            self._warned, self._closed = now, 0


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol under a :class:`Guard` (see the module docstring)."""

    guard: ClassVar[Guard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.client_key: object = None
        self._deadline: asyncio.TimerHandle | None = None
        self._partial = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Admit the connection (or refuse it), then wait for its first request's headers."""
        super().connection_made(transport)
        self.client_key = _client_key(transport)
        if not self.guard.admit(self, self.connections):
            self.connections.discard(self)
            transport.abort()
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        """uvicorn's; once a request's headers are in, their deadline is off."""
        self._partial = True
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._headers_done()

    def on_response_complete(self) -> None:
        """uvicorn's; a connection kept alive has the same deadline for its next request."""
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._partial = False
            self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's, and the guard forgets the connection."""
        self._headers_done()
        self.guard.forget(self)
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._headers_done()
        self._deadline = self.loop.call_later(self.guard.header_timeout_s, self._too_slow)
        self.guard.waiting[self] = None

    def _headers_done(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.guard.waiting.pop(self, None)

    def _too_slow(self) -> None:
        """The headers did not come in time: close (a 408 first if part of a request came)."""
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.close_idle(timed_out=True)

    def close_idle(self, *, timed_out: bool = False) -> None:
        """Close this connection, which waits for a request's headers."""
        self._headers_done()
        if timed_out and self._partial:
            self.transport.write(_TIMEOUT_408)
        self.transport.close()


def _client_key(transport: asyncio.Transport) -> object:
    """Who is on the other end: the peer's address (TCP), or its user id (a unix socket)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return "unix"
        return f"uid {struct.unpack('3i', creds)[1]}"
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) and peer else "?"


def protocol_for(guard: Guard) -> type[GuardedH11]:
    """The protocol class of one server (its own :class:`Guard`)."""
    return type("GuardedH11", (GuardedH11,), {"guard": guard, "__module__": __name__})
