"""The lease renewer: one thread per process keeps every lease the process holds alive.

A delivery's claim takes its idempotency key's lease for ``lease_s``; while the task runs, and
until its outcome is stored or given up, :func:`hold` renews it every third of its length (at
most every :data:`CANCEL_POLL_S`). When
the worker or its work-horse is killed the renewals stop, the lease expires within ``lease_s``,
and the forwarder delivers the job again.

In a pool process the supervisor renews the same leases too (:mod:`hybridq.worker.keeper`): a
task holding the GIL stops this thread, not the supervisor. :func:`supervise` connects the two;
:func:`hold_all` and :func:`release_all` tell it about a batch of leases in one message.

The same call tells whether the job was cancelled (its RQ job hash marked by the forwarder:
:mod:`hybridq.forwarder.cancelling`): :attr:`Renewal.cancelled` is set, which the running task reads
(``current_job().cancelled``) and the pool's watchdog acts on. So that a cancel is seen soon,
a lease with its job named is renewed at least every :data:`CANCEL_POLL_S`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

import redis
from redis.exceptions import RedisError

from hybridq.worker.keeper import Channel
from hybridq.worker.scripts import renew_many

__all__ = [
    "CANCEL_POLL_S",
    "Renewal",
    "flush",
    "hold",
    "hold_again",
    "hold_all",
    "release",
    "release_all",
    "supervise",
]

log = logging.getLogger("hybridq.worker")

#: The longest a running job's cancel goes unseen by its worker (seconds): one renewal call per
#: process at most this often while it runs jobs (all its leases in that call).
CANCEL_POLL_S = 1.0


class _CancelFlag(threading.Event):
    """A :class:`threading.Event` whose condition (and its lock) is made at its first use.

    A pool process makes one per job (its lease's cancel flag), and nearly every one is only
    ever asked ``is_set()``: the two objects ``Event()`` makes were about 5 % of a pool
    process's CPU in a no-op burn-down (profiled). ``set``, ``clear`` and ``wait`` are the
    Event's own, on the condition made here; ``dict.setdefault`` keeps it one per flag when
    two threads make it at once. It relies on CPython's Event keeping its state in ``_cond``
    and ``_flag`` alone (3.11 to 3.13): ``tests/unit/test_cancel_flag.py`` fails if that changes.
    """

    def __init__(self) -> None:  # (not Event.__init__: it makes the condition this defers)
        self._flag = False

    @property
    def _cond(self) -> threading.Condition:
        cond: threading.Condition | None = self.__dict__.get("_lazy_cond")
        if cond is None:
            cond = self.__dict__.setdefault("_lazy_cond", threading.Condition(threading.Lock()))
        return cond


@dataclass(eq=False)
class Renewal:
    """One lease being renewed (:func:`hold`), until :func:`release` or :attr:`until`."""

    conn: redis.Redis
    key: str
    token: str
    lease_ms: int
    interval_s: float
    due: float
    lost: bool = False
    #: When to stop renewing even if nobody removed it (monotonic; set once the task returned).
    until: float = math.inf
    #: The RQ job hash of the lease's job: each renewal looks for its cancel mark there.
    job_key: str | None = None
    #: Set once a renewal found the job marked cancelled.
    cancelled: threading.Event = field(default_factory=_CancelFlag)


class _LeaseRenewer:
    """One thread per process renews every lease the process holds, each every third of its length.

    The leases due together are renewed in one script call (:func:`.scripts.renew_many`).

    Starting a thread per job cost more than the job's two Redis round trips (W1 profile), and
    waking it for every job costs CPU too: it is woken only for a renewal due before it would
    look again anyway (a job's first renewal is a third of a lease away; the thread usually
    already waits less than that).
    """

    def __init__(self) -> None:
        self._renewals: set[Renewal] = set()
        self._wake = threading.Condition()
        #: When the thread looks at the renewals next (monotonic); guarded by ``_wake``.
        self._wake_at = math.inf
        self._thread = threading.Thread(target=self._run, name="hybridq-lease", daemon=True)
        self._thread.start()

    def add(
        self, conn: redis.Redis, key: str, token: str, lease_s: float, job_key: str | None = None
    ) -> Renewal:
        interval = max(0.05, lease_s / 3 if job_key is None else min(lease_s / 3, CANCEL_POLL_S))
        renewal = Renewal(
            conn,
            key,
            token,
            max(1, int(lease_s * 1000)),
            interval,
            time.monotonic() + interval,
            job_key=job_key,
        )
        with self._wake:
            self._renewals.add(renewal)
            if renewal.due < self._wake_at:
                self._wake.notify()
        return renewal

    def remove(self, renewal: Renewal) -> None:
        with self._wake:
            self._renewals.discard(renewal)

    def _run(self) -> None:
        while True:
            with self._wake:
                now = time.monotonic()
                self._renewals -= {r for r in self._renewals if r.until <= now}
                due = [r for r in self._renewals if r.due <= now]
                if not due:
                    soonest = min((r.due for r in self._renewals), default=now + 60.0)
                    timeout = max(0.01, soonest - now)
                    self._wake_at = now + timeout
                    self._wake.wait(timeout)
                    self._wake_at = math.inf  # looking now: add() need not wake it
                    continue
                for r in due:
                    r.due = now + r.interval_s
            by_conn: dict[int, list[Renewal]] = {}
            for r in due:
                by_conn.setdefault(id(r.conn), []).append(r)
            for group in by_conn.values():
                self._renew(group)

    def _renew(self, group: list[Renewal]) -> None:
        """Renew the leases of ``group`` (one Redis client) in one call."""
        jobs = [r.job_key for r in group]
        try:
            renewed = renew_many(
                group[0].conn,
                [(r.key, r.token, r.lease_ms) for r in group],
                None if None in jobs else [j for j in jobs if j is not None],
            )
        except RedisError as exc:
            log.warning("cannot renew %d lease(s) (%s, ...): %s", len(group), group[0].key, exc)
            return
        for r, reply in zip(group, renewed, strict=True):
            with self._wake:
                if r not in self._renewals:
                    continue  # its outcome was stored meanwhile (which frees the lease)
            ok = int(reply) & 1
            if int(reply) & 2 and not r.cancelled.is_set():
                log.info("job of %s: cancelled (hybridq cancel): asking it to stop", r.key)
                r.cancelled.set()
            if not ok and not r.lost:
                r.lost = True
                log.warning("lost the lease on %s: the job may be delivered again while it runs", r.key)


_renewer_instance: _LeaseRenewer | None = None
_renewer_lock = threading.Lock()


def _renewer() -> _LeaseRenewer:
    """This process's renewer (a forked work-horse starts its own: threads do not survive fork)."""
    global _renewer_instance
    renewer = _renewer_instance
    if renewer is not None:
        return renewer
    with _renewer_lock:
        if _renewer_instance is None:
            _renewer_instance = _LeaseRenewer()
        return _renewer_instance


#: The pool's supervisor, told of every lease this process holds (None: not a pool process).
_channel: Channel | None = None


def supervise(channel: Channel | None) -> None:
    """Have the pool's supervisor renew this process's leases too (:mod:`hybridq.worker.keeper`)."""
    global _channel
    _channel = channel


def _after_fork_in_child() -> None:
    global _renewer_instance, _renewer_lock, _channel
    _renewer_instance = None  # its thread is not in this process
    _renewer_lock = threading.Lock()  # another thread may have held it at the fork
    _channel = None  # the parent's, not this process's


os.register_at_fork(after_in_child=_after_fork_in_child)


def hold(conn: redis.Redis, key: str, token: str, lease_s: float, job_key: str | None = None) -> Renewal:
    """Renew the lease ``key`` (``token`` holds it) every third of ``lease_s`` until :func:`release`.

    With ``job_key`` (the job's RQ hash), also every :data:`CANCEL_POLL_S` at least, and each
    renewal looks for the job's cancel mark (:attr:`Renewal.cancelled`).
    """
    return hold_all(conn, [(key, token, lease_s, job_key)])[0]


def hold_all(conn: redis.Redis, leases: list[tuple[str, str, float, str | None]]) -> list[Renewal]:
    """:func:`hold` each ``(key, token, lease_s, job_key)``; the supervisor is told in one message.

    The message is written before this returns: before the task starts, so a task that then holds
    the GIL does not keep it from the supervisor.
    """
    renewer = _renewer()
    renewals = [renewer.add(conn, key, token, lease_s, job_key) for key, token, lease_s, job_key in leases]
    channel = _channel
    if channel is not None:
        channel.hold([(r.key, r.token, r.lease_ms) for r in renewals])
    return renewals


def hold_again(renewal: Renewal) -> None:
    """``renewal``'s lease was claimed again: renewed as if new, by the supervisor too.

    The supervisor forgets a lease the first time its renewal finds it gone; a claim made
    again may have taken it anew (the same token), and the task that now starts may hold the GIL.
    """
    renewal.lost = False
    channel = _channel
    if channel is not None:
        channel.hold([(renewal.key, renewal.token, renewal.lease_ms)])


def flush() -> None:
    """Tell the supervisor now of the freed leases :func:`release_all` kept for its next message."""
    channel = _channel
    if channel is not None:
        channel.flush()


def release(renewal: Renewal) -> None:
    """Stop renewing ``renewal``'s lease."""
    release_all([renewal])


def release_all(renewals: list[Renewal], *, freed: bool = False) -> None:
    """Stop renewing these leases (the supervisor is told in one message).

    ``freed``: their outcomes deleted them in Redis (the supervisor hears it with the next
    message, at the latest at :func:`flush`).
    """
    renewer = _renewer()
    for renewal in renewals:
        renewer.remove(renewal)
    channel = _channel
    if channel is not None:
        channel.release([r.token for r in renewals], freed=freed)
