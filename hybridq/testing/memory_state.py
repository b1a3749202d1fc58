"""What the memory transport holds, as Redis would: its tables, their faults, snapshots.

It owns :class:`MemoryState`, the base of :class:`hybridq.testing.memory.MemoryTransport`: the
queues, jobs, deliveries, stored outcomes, leases, events and epochs a Redis would hold, the
switches that make calls fail (``down``, :meth:`MemoryState.fail_next`), losing everything
(:meth:`MemoryState.forget`) and the RDB-like :meth:`MemoryState.snapshot` and
:meth:`MemoryState.restore`. The port's calls and the simulated worker that read and write these
tables are the transport's own. Split from :mod:`hybridq.testing.memory` (docs/architecture.md).
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import TransportError
from hybridq.transport.base import Delivery, Event

__all__ = ["MemoryState"]


class MemoryState:
    """The tables of a :class:`~hybridq.testing.memory.MemoryTransport` and their faults."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        #: Queue name -> job ids, in the order they were queued.
        self.queues: dict[str, list[str]] = {}
        #: Job id -> envelope, for every job the "backend" knows.
        self.jobs: dict[str, Envelope] = {}
        #: Job id -> the delivery it was pushed with.
        self.deliveries: dict[str, Delivery] = {}
        #: Job id -> run number delivered (requeue * 100000 + attempt).
        self.runs: dict[str, int] = {}
        #: Job id -> the run number whose task started (the worker claimed it).
        self.claimed: dict[str, int] = {}
        #: Job id -> "queued", "started", "finished" or "failed".
        self.status: dict[str, str] = {}
        #: Idempotency key id -> stored outcome (as the worker stores it).
        self.results: dict[str, dict[str, Any]] = {}
        #: Idempotency key ids whose lease is held.
        self.leases: set[str] = set()
        #: Owner -> completion events, oldest first.
        self.events: dict[str, list[Event]] = {}
        self.epochs: dict[str, str] = {}
        self.run_id = uuid.uuid4().hex
        #: Task runs (the simulated worker called the function), per job id.
        self.executions: dict[str, int] = {}
        #: Job ids whose delivery a worker refused as older than the owner's epoch (never run).
        self.fenced: set[str] = set()
        #: Job ids marked cancelled (``hybridq_cancel`` in the RQ job hash): a claim runs nothing.
        self.cancelled: set[str] = set()
        #: While true, every call raises TransportError.
        self.down = False
        self._failures = 0
        self._partial: int | None = None
        self._event_ids = itertools.count(1)
        #: Number of push calls that reached the backend (failed ones included).
        self.push_calls = 0
        #: The simulated worker's clock (RetryLater deadlines); replaced in tests.
        self.clock: Callable[[], float] = time.time

    def fail_next(self, times: int = 1, *, after: int | None = None) -> None:
        """Make the next ``times`` pushes fail; with ``after``, each queues ``after`` jobs first."""
        with self._lock:
            self._failures = times
            self._partial = after

    def forget(self) -> None:
        """Lose everything, as a Redis restart without persistence would."""
        with self._lock:
            for table in (
                self.queues,
                self.jobs,
                self.deliveries,
                self.runs,
                self.claimed,
                self.status,
                self.results,
            ):
                table.clear()
            self.leases.clear()
            self.events.clear()
            self.epochs.clear()
            self.fenced.clear()
            self.cancelled.clear()
            self.run_id = uuid.uuid4().hex

    #: What :meth:`snapshot` keeps: everything Redis would have in its dump.
    _STATE = (
        "queues",
        "jobs",
        "deliveries",
        "runs",
        "claimed",
        "status",
        "results",
        "leases",
        "events",
        "epochs",
        "fenced",
        "cancelled",
    )

    def snapshot(self) -> dict[str, Any]:
        """A copy of the whole state, as an RDB snapshot (``SAVE``) would keep it."""
        with self._lock:
            return {name: copy.deepcopy(getattr(self, name)) for name in self._STATE}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Restart from ``snapshot`` (a new run id): what happened since is gone."""
        with self._lock:
            for name in self._STATE:
                setattr(self, name, copy.deepcopy(snapshot[name]))
            self.run_id = uuid.uuid4().hex

    def _check(self) -> None:
        if self.down:
            raise TransportError("memory transport is down")
