"""A TCP proxy between hybridq's clients and Redis that injects network faults (tests, chaos).

Why it is over 450 lines: the RESP framing, the per-connection pump and the fault switches share
one lock and one connection state; split, each half would need the other's internals.

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

Only the standard library is used. The chaos harness and the tests use this module; hybridq's
own code never does.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

__all__ = ["CommandMatch", "FaultProxy", "FaultStats", "parse_command", "reply_end", "script_call"]

#: A command as the client sent it: its name, then its arguments.
Command = Sequence[bytes]
#: What :meth:`FaultProxy.cut_replies` cuts: a command name (any case), or a predicate.
CommandMatch = bytes | Callable[[Command], bool]

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


class _Garbled(ValueError):
    """Bytes that are not the Redis protocol: stop reading this connection's commands."""


def _int(buf: bytearray, start: int, end: int) -> int:
    try:
        return int(buf[start:end])
    except ValueError as exc:
        raise _Garbled(bytes(buf[start:end])) from exc


def parse_command(buf: bytearray, pos: int) -> tuple[list[bytes], int] | None:
    """The command starting at ``buf[pos]`` and the index after it, or ``None`` if incomplete.

    Clients send arrays of bulk strings; an inline command (``PING\\r\\n``) is split on spaces.
    """
    if pos >= len(buf):
        return None
    if buf[pos] != ord("*"):
        end = buf.find(b"\n", pos)
        return None if end < 0 else (bytes(buf[pos:end]).split(), end + 1)
    line = buf.find(b"\r\n", pos)
    if line < 0:
        return None
    args: list[bytes] = []
    p = line + 2
    for _ in range(_int(buf, pos + 1, line)):
        line = buf.find(b"\r\n", p)
        if line < 0:
            return None
        if buf[p] != ord("$"):
            raise _Garbled(bytes(buf[p : p + 16]))
        start = line + 2
        end = start + _int(buf, p + 1, line)
        if end + 2 > len(buf):
            return None
        args.append(bytes(buf[start:end]))
        p = end + 2
    return args, p


def reply_end(buf: bytearray, pos: int) -> int | None:
    """The index just after the complete reply starting at ``buf[pos]``, or ``None`` if incomplete."""
    need, p = 1, pos
    while need:
        line = buf.find(b"\r\n", p)
        if line < 0:
            return None
        kind = buf[p]
        need -= 1
        if kind in b"$=!":  # bulk string, verbatim string, bulk error: a length, then the bytes
            size = _int(buf, p + 1, line)
            p = line + 2 + (size + 2 if size >= 0 else 0)
            if p > len(buf):
                return None
        elif kind in b"*~>":  # array, set, push: that many replies follow
            need += max(0, _int(buf, p + 1, line))
            p = line + 2
        elif kind in b"%|":  # map, attribute: that many pairs (an attribute precedes a reply)
            need += 2 * _int(buf, p + 1, line) + (kind == ord("|"))
            p = line + 2
        elif kind in b"+-:_,#(":  # one line
            p = line + 2
        else:
            raise _Garbled(bytes(buf[p : p + 16]))
    return p


def script_call(source: str) -> Callable[[Command], bool]:
    """A :class:`CommandMatch` for calls of one Lua script (``EVALSHA`` of its SHA1, or ``EVAL``)."""
    sha = hashlib.sha1(source.encode()).hexdigest().encode()  # noqa: S324 - Redis names scripts so

    def match(command: Command) -> bool:
        name = command[0].upper() if command else b""
        return len(command) > 1 and (
            (name == b"EVALSHA" and command[1].lower() == sha)
            or (name == b"EVAL" and command[1] == source.encode())
        )

    return match


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
