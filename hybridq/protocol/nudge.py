"""Waking the forwarder without polling: producers send one datagram after each durable append.

The forwarder binds a Linux abstract-namespace unix datagram socket named after the journal's
real path (no file to clean up, no 108-byte path limit). A nudge is best effort: when nobody
listens, or the socket buffer is full, it is dropped and the forwarder's idle timeout (about a
second) picks the record up anyway. Nothing durable ever depends on a nudge.

Abstract sockets have no file permissions, so anyone on the host can send to one. The listener
therefore (1) takes a nudge only from its own user or root, read from the kernel's
``SCM_CREDENTIALS`` (``SO_PASSCRED``), and (2) coalesces: it drains every pending datagram per
wake and wakes the forwarder at most once per :data:`MIN_INTERVAL_S`, so a flood costs the
forwarder a bounded number of passes (and Redis commands), not one per datagram.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["MIN_INTERVAL_S", "NudgeListener", "address", "nudge"]

#: The shortest time between two nudge-woken forwarder passes. Under a steady stream of
#: enqueues a pass forwards everything written meanwhile, so this adds at most this much
#: latency, and only when passes would otherwise follow each other faster.
MIN_INTERVAL_S = 0.02

#: Datagrams read per drain at most (a flood that outpaces the reads must not hold it forever).
_MAX_DRAIN = 4096

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def address(journal_path: str) -> str:
    """The abstract socket name for a journal directory."""
    digest = hashlib.blake2b(os.path.realpath(journal_path).encode(), digest_size=12).hexdigest()
    return f"\0hybridq-{digest}"


class _Sender:
    """One non-blocking datagram socket per process (re-made after fork)."""

    def __init__(self) -> None:
        self.pid = -1
        self.sock: socket.socket | None = None
        self._making = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._making = threading.Lock()  # a thread of the parent may have held it at the fork

    def send(self, name: str) -> None:
        sock = self.sock
        if self.pid != os.getpid() or sock is None:
            sock = self._make()
            if sock is None:
                return  # being made by another thread, or by this one under a signal handler
        # Nobody listening, or the buffer is full: either way the forwarder catches up by itself.
        with contextlib.suppress(OSError):
            sock.sendto(b"!", name)

    def _make(self) -> socket.socket | None:
        """The process's socket, made once; ``None`` if it is being made right now.

        Under a lock: two threads' first nudges at once (a forwarder's lookup check and a
        producer) made two sockets, and the one dropped was never closed (a ResourceWarning).
        Never waited for: ``Forwarder.stop()`` nudges from a signal handler, which may interrupt
        this very thread while it holds the lock; that nudge is skipped (a nudge is best effort:
        the loop it would wake checks its flag at least every second).
        """
        if not self._making.acquire(blocking=False):
            return None
        try:
            if self.pid != os.getpid() or self.sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.settimeout(0.0)
                self.sock, self.pid = sock, os.getpid()
            return self.sock
        finally:
            self._making.release()

    def close(self) -> None:
        if self.sock is not None and self.pid == os.getpid():
            self.sock.close()
        self.sock = None


_sender = _Sender()
atexit.register(_sender.close)


def nudge(journal_path: str, *, name: str | None = None) -> None:
    """Tell the forwarder of ``journal_path`` that new records are there (best effort)."""
    _sender.send(name or address(journal_path))


class NudgeListener:
    """The forwarder's end: bind the journal's name, wait for nudges (coalesced, checked).

    Attributes:
        accepted: nudges taken (from this process's user or root).
        refused: datagrams from any other user, dropped.
        wakes: times :meth:`wait` returned True.
    """

    def __init__(
        self,
        journal_path: str,
        *,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = address(journal_path)
        self.min_interval_s = min_interval_s
        self.accepted = 0
        self.refused = 0
        self._clock = clock
        self._uid = os.geteuid()
        self._pending = False  # a nudge was taken and not yet reported by wait()
        self._last_wake = float("-inf")
        # With SO_PASSCRED the kernel attaches the sender's pid/uid/gid to every datagram.
        self._creds = hasattr(socket, "SO_PASSCRED")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(self.name)
            if self._creds:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(0.0)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a nudge; True if one was taken (all pending are drained).

        Returns True at most once per ``min_interval_s``: a nudge that arrives sooner is
        reported when the interval is over (if that is within ``timeout_s``, else at the next
        call). Datagrams from other users never wake it.
        """
        deadline = self._clock() + max(0.0, timeout_s)
        while True:
            now = self._clock()
            if self._pending:
                due = self._last_wake + self.min_interval_s
                if now >= due:
                    self._drain()  # what arrived meanwhile is part of this wake
                    self._pending, self._last_wake = False, now
                    return True
                if now >= deadline:
                    return False
                time.sleep(min(due, deadline) - now)  # not select(): a flood would spin it
                continue
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - now))
            if not ready:
                return False
            self._drain()
            if not self._pending and self._clock() >= deadline:
                return False  # only refused datagrams, and the time is up

    def _drain(self) -> None:
        """Read the pending datagrams (at most _MAX_DRAIN); note whether any may wake us."""
        space = socket.CMSG_SPACE(_UCRED.size) if self._creds else 0
        for _ in range(_MAX_DRAIN):
            try:
                _data, ancdata, _flags, _addr = self.sock.recvmsg(64, space)
            except (BlockingIOError, InterruptedError):
                return
            if self._trusted(ancdata):
                self.accepted += 1
                self._pending = True
            else:
                self.refused += 1

    def _trusted(self, ancdata: list[tuple[int, int, bytes]]) -> bool:
        """Whether the datagram came from this process's user or root."""
        if not self._creds:
            return True  # no credentials on this platform: accept (best effort, as before)
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
                _pid, uid, _gid = _UCRED.unpack_from(data)
                return uid in (self._uid, 0)
        return False

    def close(self) -> None:
        """Unbind."""
        self.sock.close()
