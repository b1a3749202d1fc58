"""Leases the pool's supervisor renews for its processes: a task holding the GIL cannot stop them.

A pool process renews the leases of its running jobs from a thread (:mod:`hybridq.worker.lease`);
a task that holds the GIL (a C call, a regex backtracking for seconds) stops every other thread
of its process, that one too, and its leases would lapse while it runs: the forwarder would
deliver its jobs again beside it. So each process also tells the supervisor, which runs no task,
which leases it holds (:class:`Channel`, one pipe per process: a line per batch of claims or of
outcomes), and the supervisor renews them too (:class:`Keeper`) until the process releases them or
ends. The process keeps renewing its own leases as well (so a supervisor killed first does not
cost them), and its renewals, not the supervisor's, look for cancel marks.

Which side fences: the claim, made at the moment a task starts, checks the forwarder's epoch and
Redis's ``run_id`` (:mod:`hybridq.worker.scripts`); a renewal extends a lease only while its
token is there, on whichever server Redis is now. So a lease the supervisor renews is always one a
fenced claim took, for a task already running (or finished and not yet recorded), and it stops
the moment the process ends (its pipe reads end-of-file): its jobs are then delivered again after
one lease, as when the process renewed them itself. ``hybridq worker --rq``/``--simple`` and a
plain ``rq worker`` have no supervisor: there a task holding the GIL for longer than its lease can
lose it (docs/worker.md).

This module must not import the journal; the supervisor side runs no thread (the pool forks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
import time
from dataclasses import dataclass

import redis
from redis.exceptions import RedisError

from hybridq.envelope.codec import dumps_compact
from hybridq.transport import redisurl
from hybridq.worker.scripts import CALL_TIMEOUT_S, renew_many

__all__ = ["Channel", "Keeper"]

log = logging.getLogger("hybridq.worker")

#: Leases due within this long of the earliest due one are renewed in the same call (seconds).
COALESCE_S = 0.2


class Channel:
    """A pool process's side: tells the supervisor the leases it takes and lets go of.

    Written before the task starts, so a task that then holds the GIL does not delay it. A
    supervisor that is gone (a broken pipe) is not an error: the process renews its leases itself.
    A lease its outcome freed in Redis is let go of with the leases its turn claims, or by
    :meth:`flush` at the end of the turn; one given up while Redis holds it, at once. Never
    later: a Redis back from a snapshot (or a lagging replica promoted) can bring a freed lease
    back under the same token, and a supervisor still holding the token would renew it for good.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()
        self._freed: list[str] = []
        self.broken = False

    def hold(self, leases: list[tuple[str, str, int]]) -> None:
        """The supervisor renews each ``(lease key, token, lease ms)`` from now on."""
        if leases:
            self._send(leases, [])

    def release(self, tokens: list[str], *, freed: bool = False) -> None:
        """The supervisor stops renewing the leases of ``tokens``.

        ``freed``: Redis no longer holds them under these tokens (their outcomes deleted them):
        said with the next message, at the latest at the turn's :meth:`flush`. Otherwise (given
        up: they are to lapse) said now.
        """
        if freed:
            with self._lock:
                self._freed += tokens
        elif tokens:
            self._send([], tokens)

    def flush(self) -> None:
        """Say now the freed leases not said yet (the end of a pool process's turn)."""
        if self._freed:
            self._send([], [])

    def _send(self, holds: list[tuple[str, str, int]], releases: list[str]) -> None:
        with self._lock:  # one writer at a time: a line longer than PIPE_BUF is written in parts
            if self.broken:
                return
            releases, self._freed = [*releases, *self._freed], []
            message: dict[str, object] = {"h": holds} if holds else {}
            if releases:
                message["r"] = releases
            # Not json.dumps: with options it builds an encoder per call, for each batch of claims.
            data = memoryview((dumps_compact(message) + "\n").encode())
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError as exc:
                self.broken = True
                log.warning("the pool's supervisor is gone (%s): this process renews its leases alone", exc)


@dataclass(slots=True)
class _Lease:
    key: str
    token: str
    ms: int
    due: float


class Keeper:
    """The supervisor's side: reads each process's pipe and renews the leases it holds.

    Args:
        url: the Redis URL the processes use.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: redis.Redis | None = None
        #: Per process (by pid): the read end of its pipe (-1 once closed), its leases by token,
        #: and its unfinished line.
        self._fds: dict[int, int] = {}
        self._leases: dict[int, dict[str, _Lease]] = {}
        self._partial: dict[int, bytes] = {}
        self._failing = False
        #: When the next lease is due, at the latest (monotonic): never after the earliest
        #: ``due`` held. A lease let go of leaves it early; the scan it then makes puts it right.
        #: So a message (a line per turn of each process) costs no scan of every lease held.
        self._due = float("inf")

    def add(self, pid: int, fd: int) -> None:
        """Read the pipe ``fd`` of the new process ``pid``."""
        self._fds[pid] = fd
        self._leases[pid] = {}
        self._partial[pid] = b""

    def drop(self, pid: int) -> None:
        """The process ``pid`` ended: stop renewing its leases (they lapse within a lease)."""
        self._close(pid)
        self._fds.pop(pid, None)
        self._leases.pop(pid, None)
        self._partial.pop(pid, None)

    def _close(self, pid: int) -> None:
        fd = self._fds.get(pid, -1)
        if fd >= 0:
            self._fds[pid] = -1
            with contextlib.suppress(OSError):
                os.close(fd)
        if pid in self._leases:
            self._leases[pid].clear()

    def close_in_child(self) -> None:
        """In a newly forked process: close the pipes of the others (it holds none of theirs)."""
        for pid in list(self._fds):
            self._close(pid)
        self._fds.clear()
        self._leases.clear()
        self._partial.clear()

    def held(self) -> int:
        """How many leases are renewed here now."""
        return sum(len(leases) for leases in self._leases.values())

    def wait(self, timeout_s: float) -> None:
        """Read what the processes sent and renew what is due, for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            wait_s = min(deadline, self._due) - now
            by_fd = {fd: pid for pid, fd in self._fds.items() if fd >= 0}
            if by_fd:
                readable, _, _ = select.select(list(by_fd), [], [], max(0.0, wait_s))
                for fd in readable:
                    self._read(by_fd[fd], fd)
            elif wait_s > 0:
                time.sleep(wait_s)
            self._renew_due()
            if time.monotonic() >= deadline:
                return

    def _read(self, pid: int, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:  # the process closed its end: it ended (the pool reaps it)
            self._close(pid)
            return
        lines = (self._partial[pid] + data).split(b"\n")
        self._partial[pid] = lines.pop()
        leases = self._leases[pid]
        now = time.monotonic()
        for line in lines:
            try:
                message = json.loads(line)
                for key, token, ms in message.get("h", ()):
                    leases[token] = x = _Lease(key, token, int(ms), now + int(ms) / 3000)
                    self._due = min(self._due, x.due)
                for token in message.get("r", ()):
                    leases.pop(token, None)
            except (ValueError, TypeError, AttributeError):
                log.error("unreadable lease message from a worker process: %r", line[:200])

    def _renew_due(self) -> None:
        now = time.monotonic()
        if now < self._due:  # nothing is due yet (the bound is never late)
            return
        soon = now + COALESCE_S
        due = [x for leases in self._leases.values() for x in leases.values() if x.due <= soon]
        if not any(x.due <= now for x in due):  # the one due was let go of
            self._due = min(x.due for x in due) if due else self._next_due()
            return
        try:
            self._renew(due, now)
        finally:
            self._due = self._next_due()

    def _next_due(self) -> float:
        return min((x.due for leases in self._leases.values() for x in leases.values()), default=float("inf"))

    def _renew(self, due: list[_Lease], now: float) -> None:
        """Renew ``due`` in one call, and note when each is due next (soon again if it failed)."""
        try:
            if self._conn is None:
                self._conn = redisurl.client(
                    self.url, socket_timeout=CALL_TIMEOUT_S, socket_connect_timeout=CALL_TIMEOUT_S
                )
            replies = renew_many(self._conn, [(x.key, x.token, x.ms) for x in due])
        except RedisError as exc:
            if not self._failing:
                log.warning("the pool cannot renew its processes' %d lease(s): %s", len(due), exc)
            self._failing = True
            for x in due:
                x.due = now + min(1.0, x.ms / 6000)  # tried again soon
            return
        self._failing = False
        for x, reply in zip(due, replies, strict=True):
            if int(reply) & 5:  # renewed, or a limited key's slot held (the task still runs)
                x.due = now + x.ms / 3000
            else:  # no longer ours (recorded meanwhile, or lost): the process finds out itself
                for leases in self._leases.values():
                    if leases.get(x.token) is x:
                        del leases[x.token]
