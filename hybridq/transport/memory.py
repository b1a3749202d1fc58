"""An in-memory transport for tests: the forwarder's logic without Redis.

Like dramatiq's ``StubBroker`` or procrastinate's ``InMemoryConnector``, it ships in the package
so users can test their own code. It can be told to fail, to simulate Redis being down.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hybridq.envelope import Envelope
from hybridq.errors import TransportError

from .base import PushResult, Transport

__all__ = ["MemoryTransport"]


class MemoryTransport(Transport):
    """Queues in a dict. ``down = True`` (or :meth:`fail_next`) makes pushes fail."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Queue name -> job ids, in the order they were queued.
        self.queues: dict[str, list[str]] = {}
        #: Job id -> envelope, for every job the "backend" knows.
        self.jobs: dict[str, Envelope] = {}
        #: While true, every call raises TransportError.
        self.down = False
        self._failures = 0
        self._partial: int | None = None
        #: Number of push calls that reached the backend (failed ones included).
        self.push_calls = 0

    def fail_next(self, times: int = 1, *, after: int | None = None) -> None:
        """Make the next ``times`` pushes fail; with ``after``, each queues ``after`` jobs first."""
        with self._lock:
            self._failures = times
            self._partial = after

    def forget(self) -> None:
        """Lose everything, as a Redis restart without persistence would."""
        with self._lock:
            self.queues.clear()
            self.jobs.clear()

    def pop(self, queue: str) -> Envelope | None:
        """Take the next job off ``queue`` (what a worker would do)."""
        with self._lock:
            ids = self.queues.get(queue)
            if not ids:
                return None
            return self.jobs[ids.pop(0)]

    def push(self, jobs: Sequence[Envelope]) -> PushResult:
        """Queue the jobs not already known, in order (see :class:`Transport`)."""
        with self._lock:
            self.push_calls += 1
            if self.down:
                raise TransportError("memory transport is down")
            limit = len(jobs)
            failing = self._failures > 0
            if failing:
                self._failures -= 1
                limit = min(limit, self._partial or 0)
            pushed = present = 0
            for env in jobs[:limit]:
                if env.id in self.jobs:
                    present += 1
                    continue
                self.jobs[env.id] = env
                self.queues.setdefault(env.queue, []).append(env.id)
                pushed += 1
            if failing:
                raise TransportError(f"injected failure after {limit} jobs")
            return PushResult(pushed, present)

    def ping(self) -> None:
        """Raise TransportError while down."""
        if self.down:
            raise TransportError("memory transport is down")
