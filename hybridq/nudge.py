"""Waking the forwarder without polling: producers send one datagram after each durable append.

The forwarder binds a Linux abstract-namespace unix datagram socket named after the journal's
real path (no file to clean up, no 108-byte path limit). A nudge is best effort: when nobody
listens, or the socket buffer is full, it is dropped and the forwarder's idle timeout (about a
second) picks the record up anyway. Nothing durable ever depends on a nudge.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import select
import socket

__all__ = ["NudgeListener", "address", "nudge"]


def address(journal_path: str) -> str:
    """The abstract socket name for a journal directory."""
    digest = hashlib.blake2b(os.path.realpath(journal_path).encode(), digest_size=12).hexdigest()
    return f"\0hybridq-{digest}"


class _Sender:
    """One non-blocking datagram socket per process (re-made after fork)."""

    def __init__(self) -> None:
        self.pid = -1
        self.sock: socket.socket | None = None

    def send(self, name: str) -> None:
        if self.pid != os.getpid() or self.sock is None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self.sock.settimeout(0.0)
            self.pid = os.getpid()
        # Nobody listening, or the buffer is full: either way the forwarder catches up by itself.
        with contextlib.suppress(OSError):
            self.sock.sendto(b"!", name)

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
    """The forwarder's end: bind the journal's name, wait for nudges."""

    def __init__(self, journal_path: str) -> None:
        self.name = address(journal_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(self.name)
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(0.0)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a nudge; drain all pending ones. True if any arrived."""
        ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout_s))
        if not ready:
            return False
        while True:
            try:
                self.sock.recv(64)
            except BlockingIOError:
                return True

    def close(self) -> None:
        """Unbind."""
        self.sock.close()
