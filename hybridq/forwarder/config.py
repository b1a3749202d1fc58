"""The forwarder's settings: :class:`ForwarderConfig` holds every option (frozen, checked once).

It is checked when made, before anything is created; :mod:`hybridq.forwarder.state` (which owns
the forwarder's durable state) re-exports every name of this module.

This module must not import redis or rq.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hybridq.errors import ConfigError
from hybridq.protocol import DEFAULT_KEY_TTL_S, DEFAULT_LEASE_S
from hybridq.protocol.keylimits import Limits, parse_limits

__all__ = [
    "DEFAULT_INDEX_OFFSETS_MAX",
    "DEFAULT_KEY_WINDOW_MAX",
    "DEFAULT_KEY_WINDOW_S",
    "DEFAULT_STATS_EVERY_S",
    "DONE_GRACE_LEASES",
    "MIN_STATS_EVERY_S",
    "ForwarderConfig",
    "check_key_ttl",
]

#: How long a job may stay "done" (outcome stored in Redis, no completion event harvested) before
#: it is delivered again, in leases (at least a minute): the event may have been evicted. The
#: delivery finds the stored outcome and reports it without running the task.
DONE_GRACE_LEASES = 6
#: How long the key of a finished job stays known to the forwarder (enqueue-if-absent), at least.
DEFAULT_KEY_WINDOW_S = 7 * 86400.0
#: The most keys of finished jobs the forwarder keeps in their window (about 0.5 KB each).
DEFAULT_KEY_WINDOW_MAX = 200_000
#: The most offsets of finished jobs the ledger index holds in memory (about 5 bytes each); past
#: it, whole segments' on disk (:meth:`hybridq.ledger.index.LedgerIndex.spill_past`, issue 29).
DEFAULT_INDEX_OFFSETS_MAX = 1_000_000
#: How often the forwarder publishes its stats snapshot to Redis (``hybridq status --all``).
DEFAULT_STATS_EVERY_S = 5.0
#: The shortest stats interval but 0 (never): a snapshot a millisecond would load Redis for a display.
MIN_STATS_EVERY_S = 0.2
#: The fewest jobs per queue kept queued in Redis by default (the window's floor).
DEFAULT_WINDOW_MIN = 500


def check_key_ttl(lease_s: float, key_ttl_s: float) -> None:
    """Refuse a key lifetime too short for the "done" grace period (see :data:`DONE_GRACE_LEASES`).

    A job whose completion event was lost stays "done" in Redis (its outcome stored) for up to
    the grace period before it is delivered again, to report that outcome without running. If the
    stored outcome expires first, the job reads as "orphaned" instead, and runs again. Twice the
    grace leaves room for the reconcile passes on either side and a short queue wait.
    """
    least = 2 * max(60.0, DONE_GRACE_LEASES * lease_s)
    if key_ttl_s < least:
        raise ConfigError(
            f"key TTL {key_ttl_s:g} s is too short for a {lease_s:g} s lease: it must be at least "
            f"{least:g} s (twice max(60 s, {DONE_GRACE_LEASES} leases)), or finished jobs whose "
            "completion event was lost would run again"
        )


#: What an implicit key's outcome outlives its harvest by, beyond a lease (seconds).
HARVESTED_KEY_MARGIN_S = 5.0


@dataclass(frozen=True, slots=True)
class ForwarderConfig:
    """A forwarder's options (checked when made: :class:`ConfigError` or ``ValueError``).

    Attributes:
        batch_size: the most jobs per push (one pipeline, one checkpoint write).
        idle_timeout_s: the longest sleep without a nudge (a missed nudge costs at most this).
        backoff_initial_s: first wait after a transport failure; doubles up to ``backoff_max_s``.
        lease_s: how long a worker's claim on a job lasts without renewal; a job whose worker
            stopped renewing it is delivered again about this long after the worker died.
        key_ttl_s: how long a job's outcome stays stored under its idempotency key in Redis
            (duplicates within this window return the stored result; the ledger covers the
            forwarder's own jobs forever).
        key_window_s: how long, at least, the forwarder remembers the explicit idempotency key of
            a finished job once its journal segment is compacted: a job with that key is not
            pushed meanwhile (docs/enqueue.md, "Enqueue-if-absent"). Keys of pending jobs, and of
            finished jobs whose segment is still in the journal, are always remembered.
        key_window_max: the most keys kept in their window; beyond it, the oldest are forgotten
            early (the memory bound: about 0.5 KB a key).
        index_offsets_max: the most offsets of finished jobs of the live journal the ledger
            index holds in memory (about 5 bytes each); past it, whole segments' move to files
            in the journal's ``.index-spill`` directory and are looked up there
            (docs/forwarder.md, "Memory: the bound that holds now"); ``None``: no cap.
        max_lost: a job whose worker vanished this many times fails for good (a task that kills
            its worker every time must not loop forever).
        reconcile_interval_s: the least time between two reconcile passes (default: a fifth of
            ``lease_s``, at least 1 s; see :attr:`reconcile_every_s`).
        window_min: the fewest jobs per queue the forwarder keeps queued in Redis (its window's
            floor; docs/forwarder.md, "The window"), while it has that many waiting.
        window_max: the most jobs per queue it keeps queued there (the window's ceiling).
        window_cover_s: the window holds this many seconds of the queue's observed drain.
        redis_high_water: the share of Redis's ``maxmemory`` above which it pushes nothing (the
            workers keep room for outcomes and leases); 0 turns the mark off.
        forget_finished: delete finished jobs' RQ hashes and results from Redis once harvested
            (``None``: only when Redis has a ``maxmemory``).
        harvested_key_ttl_s: with ``forget_finished``, how long an implicit key's stored outcome
            stays in Redis after its harvest (default: a lease plus 5 s, see
            :attr:`harvested_key_keep_s`).
        allow_eviction: start even when Redis's ``maxmemory_policy`` may evict any key
            (``allkeys-*``); refused otherwise.
        clock: wall-clock time (for delays and retry times); replaced in tests.
        stats_every_s: how often the snapshot ``hybridq status --all`` lists is published to the
            transport (Redis), with a TTL of three times that; 0: never.
        on_durable_write: called with the seconds each durable write took (checkpoint saves,
            ledger appends: each ends in an fsync), e.g. a metrics histogram's ``observe``.
        limits: the per-key limits: ``PATTERN=SPEC`` strings (as ``--limit``), a mapping of
            pattern to spec, or :class:`~hybridq.protocol.keylimits.Limits`; read as
            :attr:`key_limits` (docs/forwarder.md, "Limits per key").
        fair_keys: globs on the limit key (``'tenant:*'``, ``'tenant:big=3'`` with a weight):
            the waiting jobs of each matching key are taken round robin (docs/forwarder.md,
            "Priorities and fairness"); checked by :func:`hybridq.forwarder.selector.parse_fair_keys`.
    """

    batch_size: int = 500
    idle_timeout_s: float = 1.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    lease_s: float = DEFAULT_LEASE_S
    key_ttl_s: float = DEFAULT_KEY_TTL_S
    key_window_s: float = DEFAULT_KEY_WINDOW_S
    key_window_max: int = DEFAULT_KEY_WINDOW_MAX
    index_offsets_max: int | None = DEFAULT_INDEX_OFFSETS_MAX
    max_lost: int = 5
    reconcile_interval_s: float | None = None
    window_min: int = DEFAULT_WINDOW_MIN
    window_max: int = 10_000
    window_cover_s: float = 1.0
    redis_high_water: float = 0.8
    forget_finished: bool | None = None
    harvested_key_ttl_s: float | None = None
    allow_eviction: bool = False
    clock: Callable[[], float] = time.time
    on_durable_write: Callable[[float], None] | None = None
    stats_every_s: float = DEFAULT_STATS_EVERY_S
    limits: Limits | Mapping[str, str] | Sequence[str] | None = None
    fair_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.limits, str):
            raise TypeError("limits must be a list of 'PATTERN=SPEC' strings, not one string")
        object.__setattr__(self, "limits", parse_limits(self.limits))  # ConfigError: one line
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        check_key_ttl(self.lease_s, self.key_ttl_s)
        if not self.key_window_s >= 0:
            raise ValueError("key_window_s must be a number of seconds, at least 0")
        if self.key_window_max < 0:
            raise ValueError("key_window_max must be at least 0")
        if self.index_offsets_max is not None and self.index_offsets_max < 0:
            raise ValueError("index_offsets_max must be at least 0 (or None: no cap)")
        if not (self.stats_every_s == 0 or MIN_STATS_EVERY_S <= self.stats_every_s <= 3600):
            raise ValueError(f"stats_every_s must be 0 (never) or from {MIN_STATS_EVERY_S} to 3600 seconds")
        if not 1 <= self.window_min <= self.window_max:
            raise ValueError("the window needs 1 <= window_min <= window_max")
        if not 0.0 <= self.redis_high_water < 1.0:
            raise ValueError("redis_high_water must be a share of maxmemory, from 0 up to (not) 1")
        if not self.window_cover_s > 0 or not self.harvested_key_keep_s > 0:
            raise ValueError("window_cover_s and harvested_key_ttl_s must be positive seconds")

    @property
    def key_limits(self) -> Limits:
        """The per-key limits, checked (:attr:`limits` as given, parsed when the config was made)."""
        assert isinstance(self.limits, Limits)
        return self.limits

    @property
    def reconcile_every_s(self) -> float:
        """The least time between two reconcile passes, the default filled in."""
        if self.reconcile_interval_s is not None:
            return self.reconcile_interval_s
        return max(1.0, self.lease_s / 5)

    @property
    def harvested_key_keep_s(self) -> float:
        """How long an implicit key's outcome stays after its harvest, the default filled in.

        A copy of the job a pool worker reserved before the harvest deleted its hash is claimed
        up to half a lease later (``hybridq.worker.starter.GIVE_BACK_LEASES``); its claim finds
        the outcome and runs nothing only while the outcome is there: a lease, plus a margin
        (docs/guarantees.md).
        """
        if self.harvested_key_ttl_s is not None:
            return self.harvested_key_ttl_s
        return self.lease_s + HARVESTED_KEY_MARGIN_S
