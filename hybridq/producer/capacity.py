"""The producer's capacity check: how many accepted jobs are not yet terminal.

This module must not import redis or rq.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

from hybridq.errors import QueueFull
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ledger.compacted import AcceptedCounter

__all__ = ["PendingCount"]

#: Every capacity counter alive in this process (their locks are replaced in a forked child).
_pending_counts: weakref.WeakSet[PendingCount] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """Replace the counters' locks in a forked child (a lock held by another thread stays held)."""
    for pending in list(_pending_counts):
        pending._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class PendingCount:
    """Pending jobs (accepted, not yet terminal) for the capacity check.

    Counts the journal's records incrementally (only new records are read each time) at most
    once per ``refresh_s``, and adds this process's own enqueues in between. Within a process the
    check is exact (a reservation is taken before the append); across processes it can overshoot
    by what other processes appended within ``refresh_s``. The number of terminal jobs is the
    one the forwarder publishes in its checkpoint (it lags by at most one harvest, so the count
    errs on the side of "pending").
    """

    def __init__(self, journal: str, refresh_s: float = 1.0) -> None:
        self._journal = journal
        self._counter = AcceptedCounter(journal)
        self._accepted = 0  # records accepted (compacted ones included) by the last refresh
        self._terminal = 0  # terminal jobs, as the forwarder last published
        self._local = 0  # appended by this process since then
        self._inflight = 0  # reserved by this process, being appended
        self._refreshed = -1e9
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        _pending_counts.add(self)

    def _after_fork(self) -> None:
        # The parent's in-flight reservations are not ours; recount at the first reserve.
        self._lock = threading.Lock()
        self._inflight = 0
        self._refreshed = -1e9

    def reserve(self, n: int, capacity: int) -> None:
        """Take ``n`` places or raise :class:`QueueFull`; follow with :meth:`release`."""
        with self._lock:
            if time.monotonic() - self._refreshed >= self._refresh_s:
                self._refresh()
            pending = self._accepted - self._terminal + self._local + self._inflight
            if pending + n > capacity:
                raise QueueFull(pending, capacity)
            self._inflight += n

    def _refresh(self) -> None:
        self._accepted = self._counter.count()
        checkpoint = load_checkpoint(self._journal)
        self._terminal = checkpoint.terminal if checkpoint is not None else 0
        self._local = 0
        self._refreshed = time.monotonic()

    def release(self, n: int, *, appended: bool) -> None:
        """End a reservation: the records are in the journal (``appended``) or were not written."""
        with self._lock:
            self._inflight -= n
            if appended:
                self._local += n
