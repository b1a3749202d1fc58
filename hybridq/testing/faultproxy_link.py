"""One proxied connection: its two sockets, their thread, and the faults applied on the way.

Apart from :mod:`hybridq.testing.faultproxy` (the listener and the fault switches) to keep each
module short; a link reads the switches and takes its cuts through its proxy's methods, under
the proxy's lock. Only the standard library.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import ssl
import struct
import threading
import time
from typing import TYPE_CHECKING

from hybridq.testing.faultproxy_resp import _Garbled, parse_command, reply_end

if TYPE_CHECKING:
    from hybridq.testing.faultproxy import FaultProxy

#: The longest a connection's thread waits before it looks at the faults again (seconds).
POLL_S = 0.05
#: Bytes read at a time.
CHUNK = 65536
#: A side is not read while this many bytes wait to be written to the other (backpressure).
MAX_BUFFERED = 4 << 20
#: How long a TLS handshake or the connect to Redis may take (seconds).
CONNECT_TIMEOUT_S = 10.0

# What a queued item does once its delay has passed (besides writing its bytes).
_SEND, _CLOSE, _ABORT = 0, 1, 2


class _Direction:
    """One direction of a connection: bytes read from ``src`` wait here until due, then go to ``dst``."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.parsed = bytearray()  # read but not parsed yet (an incomplete command or reply)
        self.queue: collections.deque[tuple[float, bytes, int]] = collections.deque()
        self.queued = 0
        self.out = b""  # due, being written
        self.done_reading = False

    def put(self, due: float, data: bytes, action: int = _SEND) -> None:
        self.queue.append((due, data, action))
        self.queued += len(data)

    def can_read(self) -> bool:
        return not self.done_reading and self.queued + len(self.out) < MAX_BUFFERED

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue and not self.out else None

    def release(self, now: float) -> int:
        """Move what is due into ``out`` (once ``out`` is written); the action to take, if any."""
        while self.queue and not self.out and self.queue[0][0] <= now:
            _, data, action = self.queue.popleft()
            self.queued -= len(data)
            self.out = data
            if action != _SEND:
                return action
        return _SEND


class _Link:
    """One client connection, its connection to Redis, and the thread moving bytes between them."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.abort_requested = False
        #: For each command sent to Redis and not answered yet: whether the armed cut matches it.
        self.pending: collections.deque[bool] = collections.deque()
        #: Whether this connection speaks RESP (replies are matched to commands).
        self.parse = True
        self.thread = threading.Thread(target=self._run, name="faultproxy-link", daemon=True)

    def _run(self) -> None:
        try:
            if self._open():
                self._pump()
        except OSError:
            self._reset()  # Redis refused us, or a side reset: pass the reset on
        finally:
            self._close()
            self.proxy._forget(self)

    def _open(self) -> bool:
        """Hold the connection through a blackhole, refuse it, or shake hands and connect upstream."""
        proxy = self.proxy
        while proxy.holding and not self.abort_requested:
            time.sleep(POLL_S)
        if proxy.refusing or self.abort_requested:
            self._reset()
            proxy._count("resets")
            return False
        self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if proxy.ssl_context is not None:
            self.client = proxy.ssl_context.wrap_socket(
                self.client, server_side=True, do_handshake_on_connect=False
            )
            self.client.settimeout(CONNECT_TIMEOUT_S)
            try:
                self.client.do_handshake()
            except OSError:  # ssl.SSLError is an OSError
                proxy._count("tls_failures")
                return False
        self.upstream = socket.create_connection(proxy.upstream, timeout=CONNECT_TIMEOUT_S)
        self.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.settimeout(0.0)  # non-blocking
        self.upstream.settimeout(0.0)
        return True

    def _pump(self) -> None:
        assert self.upstream is not None
        proxy = self.proxy
        up = _Direction(self.client, self.upstream)
        down = _Direction(self.upstream, self.client)
        while not self.abort_requested:
            now = time.monotonic()
            readable: list[socket.socket] = []
            writable: list[socket.socket] = []
            timeout = POLL_S
            for d in () if proxy.holding else (up, down):
                action = d.release(now)
                if action == _ABORT:  # a cut reply (counted when it was decided)
                    self._reset()
                    return
                if action == _CLOSE and d is down:
                    return  # Redis closed; everything it sent before is delivered
                if action == _CLOSE:
                    # The client closed. Redis gets everything it sent, then the end of the
                    # stream, and closes in turn (its replies go nowhere), as over TCP.
                    self.upstream.shutdown(socket.SHUT_WR)
                if d.can_read():
                    readable.append(d.src)
                    if isinstance(d.src, ssl.SSLSocket) and d.src.pending():
                        timeout = 0.0  # decrypted bytes wait inside the TLS layer
                if d.out:
                    writable.append(d.dst)
                due = d.next_due()
                if due is not None:
                    timeout = max(0.0, min(timeout, due - now))
            ready_r, ready_w, _ = select.select(readable, writable, [], timeout)
            for d in (up, down):
                if d.src in readable and (d.src in ready_r or timeout == 0.0):
                    self._read(d, is_up=d is up)
                if d.dst in ready_w:
                    _write(d)
        self._reset()
        proxy._count("resets")

    def _read(self, d: _Direction, *, is_up: bool) -> None:
        try:
            data = d.src.recv(CHUNK)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return
        proxy = self.proxy
        due = time.monotonic() + (proxy.delay_up_s if is_up else proxy.delay_down_s)
        if not data:
            d.done_reading = True
            d.put(due, b"", _CLOSE)
        elif is_up:
            self._note_commands(d, data)
            d.put(due, data)
        else:
            self._note_replies(d, data, due)

    def _note_commands(self, d: _Direction, data: bytes) -> None:
        """Note each complete command sent to Redis, and whether its reply is to be cut."""
        if not self.parse:
            return
        d.parsed += data
        pos = 0
        try:
            while (parsed := parse_command(d.parsed, pos)) is not None:
                command, pos = parsed
                if command:  # an empty inline line gets no reply
                    self.pending.append(self.proxy._matches(command))
        except _Garbled:
            self._stop_parsing()
            pos = len(d.parsed)
        del d.parsed[:pos]

    def _note_replies(self, d: _Direction, data: bytes, due: float) -> None:
        """Queue Redis's bytes for the client, stopping short of a reply to be cut."""
        if not self.parse:
            d.put(due, data)
            return
        new = len(d.parsed)  # what came before was queued already (all but cut replies are)
        d.parsed += data
        pos = 0
        try:
            while pos < len(d.parsed):
                kind = d.parsed[pos]
                if self.pending and kind != ord(">"):  # a push answers no command
                    # An error reply (NOSCRIPT, EXECABORT) means the command did not run: the
                    # client may hear it, and the cut waits for the next match.
                    if self.pending[0] and kind not in b"-!" and self.proxy._take_cut():
                        # Redis replies only after running a command: it ran. Deliver the
                        # replies before this one, then reset: the client never hears.
                        if pos > new:
                            d.put(due, bytes(d.parsed[new:pos]))
                        d.put(due, b"", _ABORT)
                        d.done_reading = True
                        return
                    self.pending[0] = False  # decided: deliver it
                end = reply_end(d.parsed, pos)
                if end is None:
                    break
                if self.pending and kind != ord(">"):
                    self.pending.popleft()
                pos = end
        except _Garbled:
            self._stop_parsing()
            pos = len(d.parsed)
        d.put(due, data)  # bytes go on as they arrive; only the parsing waits for whole replies
        del d.parsed[:pos]

    def _stop_parsing(self) -> None:
        """Bytes that are not RESP: forward them as they are, and cut no reply on this connection."""
        self.parse = False
        self.pending.clear()

    def _reset(self) -> None:
        """Close both connections with RST (SO_LINGER 0), not FIN."""
        linger = struct.pack("ii", 1, 0)
        for sock in (self.client, self.upstream):
            if sock is not None and sock.fileno() >= 0:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        self._close()

    def _close(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                sock.close()


def _write(d: _Direction) -> None:
    try:
        sent = d.dst.send(d.out)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
        return
    d.out = d.out[sent:]
