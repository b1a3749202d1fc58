"""How much each queue may hold in Redis now: the window, sized from the drain, and the memory gate.

Redis holds a **window** per queue, not the backlog (docs/forwarder.md, "The window"): the
forwarder keeps about ``window_cover_s`` seconds of the queue's observed drain queued there,
between ``window_min`` and ``window_max`` jobs, and leaves the rest in its journal (the run
table, :mod:`hybridq.forwarder.runs`). Each step it reads the queues' lengths (``LLEN``,
pipelined when there are several), and a queue whose length fell to half its target is topped
up to the target.

The drain rate is what left the queue since the last look (the length then, plus what was pushed
since, minus the length now), smoothed over :data:`RATE_RISE_S` while it rises and
:data:`RATE_TAU_S` while it falls. A queue found empty after jobs
left it had workers waiting: its target doubles (up to the ceiling) and halves back after
:data:`BOOST_DECAY_S` without another underrun.

:class:`MemoryGate` is the other bound: with Redis at a ``maxmemory``, nothing is pushed while
``used_memory`` is above ``redis_high_water`` of it, so the workers' outcomes and lease renewals
always find room. An ``OOM`` reply is a pause, logged once, and so is its end.

Several forwarders on one queue see the same length: each tops the queue up to its own target,
so the queue holds up to one target per forwarder (docs/forwarder.md says so).

This module must not import redis or rq.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridq.errors import RedisRefused, TransportError
from hybridq.forwarder.config import ForwarderConfig
from hybridq.transport.base import MemoryInfo, Transport

__all__ = ["BYTES_PER_JOB", "MemoryGate", "QueueWindow", "Windows", "check_eviction_policy"]

log = logging.getLogger("hybridq.forwarder")

#: Smoothing of the drain rate while it falls (seconds).
RATE_TAU_S = 5.0
#: Smoothing of the drain rate while it rises (seconds): a burst's workers find the window
#: grown within a second, not after the several underruns a slow rise costs them.
RATE_RISE_S = 0.5
#: A boosted target halves after this long without an underrun (seconds).
BOOST_DECAY_S = 10.0
#: What a queued job is taken to cost Redis before the gate has seen a push (bytes).
BYTES_PER_JOB = 4000
#: A queued job's cost in Redis over the bytes its push sent: the hash's overhead, the queue
#: entry. The memory gate's estimate of a job (:meth:`MemoryGate.sent`), which sizes the pushes
#: between two samples of ``INFO memory``. Measured (used_memory per pushed job, 2,000 jobs of
#: 0.6, 1.3 and 2.4 KB sent) on Redis 6.2: 1,676, 2,336 and 3,515 B; on 7.0: 1,505, 2,200 and
#: 3,368 B: the bytes sent plus about 1.1 KB (docs/deploy.md's table).
HASH_OVERHEAD = (1.0, 1100)
#: How often the gate asks Redis for ``INFO memory`` (seconds).
MEMORY_SAMPLE_S = 0.1


@dataclass
class QueueWindow:
    """One queue's window: its target, drain rate and last seen length (see module docstring)."""

    floor: int
    ceiling: int
    cover_s: float
    #: Jobs per second leaving the queue (smoothed).
    rate: float = 0.0
    #: The target set by an underrun (0: none).
    boost: int = 0
    #: The queue's length at the last look, plus what was pushed since.
    expected: int = 0
    #: The length Redis reported at the last look.
    length: int = 0
    at: float = field(default=-math.inf)
    boosted_at: float = field(default=-math.inf)
    #: Whether the queue is being topped up (it fell to half its target at the last look).
    filling: bool = True

    @property
    def target(self) -> int:
        """How many jobs the queue should hold."""
        return max(self.floor, min(self.ceiling, max(int(self.rate * self.cover_s), self.boost)))

    def observe(self, length: int, now: float) -> None:
        """Note the queue's length now: the drain since the last look, underruns."""
        left = max(0, self.expected - length)
        if self.at > -math.inf:
            dt = max(now - self.at, 1e-3)
            drain = left / dt
            weight = 1.0 - math.exp(-dt / (RATE_RISE_S if drain > self.rate else RATE_TAU_S))
            self.rate += (drain - self.rate) * weight
            if length == 0 and left > 0:  # workers emptied it: they wait for the next refill
                self.boost = min(self.ceiling, 2 * self.target)
                self.boosted_at = now
            elif self.boost and now - self.boosted_at >= BOOST_DECAY_S:
                self.boost //= 2
                self.boosted_at = now
        self.expected = self.length = length
        self.at = now
        self.filling = length <= self.target // 2

    def room(self) -> int:
        """How many jobs to push now: up to the target once the queue is down to half of it."""
        return max(0, self.target - self.expected) if self.filling else 0

    def pushed(self, n: int) -> None:
        """Count ``n`` jobs pushed into the queue since the last look."""
        self.expected += n


class Windows:
    """Every queue's window of one forwarder (see module docstring)."""

    def __init__(self, config: ForwarderConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.queues: dict[str, QueueWindow] = {}
        #: Whether the transport reports queue lengths (else the window is open: push everything).
        self.bounded = True

    def of(self, queue: str) -> QueueWindow:
        """The window of ``queue`` (made on first use)."""
        w = self.queues.get(queue)
        if w is None:
            c = self.config
            w = self.queues[queue] = QueueWindow(c.window_min, c.window_max, c.window_cover_s)
        return w

    def look(self, transport: Transport, queues: list[str]) -> None:
        """Read the lengths of ``queues`` (TransportError: Redis is down, nothing changes)."""
        if not self.bounded:
            return
        lengths = transport.queue_lengths(queues)
        if lengths is None:
            self.bounded = False
            return
        now = self.clock()
        for queue, length in lengths.items():
            self.of(queue).observe(length, now)

    def reset(self) -> None:
        """Redis lost state: the next look is a new baseline, not a drain (its rate is kept)."""
        for w in self.queues.values():
            w.at = -math.inf
            w.expected = w.length = 0
            w.filling = False  # until the next look: the refill pass puts the old window back first

    def room(self, queue: str) -> int:
        """How many jobs of ``queue`` to push now (no bound when the transport cannot say)."""
        return self.of(queue).room() if self.bounded else 1 << 62


#: A pause at the high-water mark longer than this is logged once at INFO (seconds).
LONG_PAUSE_S = 60.0


class MemoryGate:
    """Pushes only while Redis is under its high-water mark (see module docstring)."""

    def __init__(self, config: ForwarderConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.high_water = config.redis_high_water
        self.clock = clock
        #: The last ``INFO memory`` read (``None``: not yet, or the transport cannot say).
        self.info: MemoryInfo | None = None
        self._next = 0.0
        #: Why pushes are paused now (``"high_water"`` or ``"oom"``), or ``None``.
        self.paused: str | None = None
        self.paused_since: float | None = None
        self._long_noted = False
        #: Pauses since start, and when the last ``OOM`` reply came (``time.time()``).
        self.pauses = 0
        self.last_oom: float | None = None
        #: What a queued job costs Redis (bytes), learnt from what the pushes sent.
        self.bytes_per_job = float(BYTES_PER_JOB)

    def sample(self, transport: Transport, *, force: bool = False) -> None:
        """Read ``INFO memory`` at most every :data:`MEMORY_SAMPLE_S` (TransportError: down)."""
        now = self.clock()
        if not force and now < self._next:
            return
        self._next = now + MEMORY_SAMPLE_S
        self.info = transport.memory()

    @property
    def ratio(self) -> float | None:
        """``used_memory / maxmemory``; ``None`` without a limit."""
        info = self.info
        return None if info is None or not info.maxmemory else info.used / info.maxmemory

    def room(self) -> int:
        """How many jobs may be pushed before the mark (no bound without a ``maxmemory``)."""
        info = self.info
        if self.paused == "oom" and info is not None and info.maxmemory and info.used >= info.maxmemory:
            return 0  # still full: the next sample (after the harvest freed memory) decides
        if info is None or not info.maxmemory or not self.high_water:
            self._resume()
            return 1 << 62
        free = int(info.maxmemory * self.high_water) - info.used
        # A job costs its hash, and while the push is in flight its copy in Redis's input
        # buffer too (counted in used_memory): room for half as many keeps the peak at the mark.
        per_job = 2 * int(self.bytes_per_job)
        if free < per_job:
            self._pause("high_water")
            return 0
        self._resume()
        return free // per_job

    def pushed(self, n: int) -> None:
        """Count ``n`` jobs pushed since the last sample (they use memory the sample did not see)."""
        if self.info is not None:
            used = self.info.used + int(n * self.bytes_per_job)
            self.info = MemoryInfo(used, self.info.maxmemory, self.info.policy)

    def sent(self, jobs: int, sent_bytes: int) -> None:
        """Learn a job's cost from a push: ``jobs`` whose fields came to ``sent_bytes``."""
        if jobs and sent_bytes:
            ratio, extra = HASH_OVERHEAD
            seen = sent_bytes / jobs * ratio + extra
            self.bytes_per_job = max(seen, self.bytes_per_job * 0.8 + seen * 0.2)

    def refused(self, exc: TransportError) -> None:
        """Redis answered ``OOM`` to a push: pause until the next sample says there is room."""
        log.debug("push refused: %s", exc)
        self.last_oom = time.time()
        self._next = 0.0  # look again at the next step
        self._pause("oom")

    def _pause(self, why: str) -> None:
        if self.paused is None:
            info = self.info
            used = f"used {info.used} of {info.maxmemory} bytes" if info is not None else "memory"
            # At the mark is flow control (routine under a backlog); an OOM reply is news.
            log.log(
                logging.WARNING if why == "oom" else logging.DEBUG,
                "Redis is full (%s, %s): pushes paused, jobs wait in the journal, workers unaffected",
                "high-water mark" if why == "high_water" else "OOM reply",
                used,
            )
            self.pauses += 1
            self.paused_since = self.clock()
            self._long_noted = False
        elif not self._long_noted and self.clock() - (self.paused_since or 0.0) > LONG_PAUSE_S:
            # Routine for seconds; for a minute, something holds Redis's memory (a slow worker
            # pool, another tenant, big results): worth one line, not one per step.
            self._long_noted = True
            log.info(
                "pushes paused at Redis's high-water mark for %.0f s (used %s of %s bytes): jobs "
                "wait in the journal until workers or the harvest free memory",
                self.clock() - (self.paused_since or 0.0),
                self.info.used if self.info is not None else "?",
                self.info.maxmemory if self.info is not None else "?",
            )
        self.paused = why

    def _resume(self) -> None:
        if self.paused is not None:
            log.log(
                logging.WARNING if self.paused == "oom" else logging.DEBUG,
                "Redis has room again: pushes resumed after %.1f s",
                self.clock() - (self.paused_since or 0.0),
            )
            self.paused = self.paused_since = None


def check_eviction_policy(info: MemoryInfo | None, *, allow_eviction: bool) -> None:
    """Refuse a Redis that may evict any key (``allkeys-*``) unless allowed; warn on ``volatile-*``.

    ``allkeys-*`` can evict queue lists, epoch keys and leases: queued jobs vanish (the reconcile
    pass delivers them again, late), a running job's lease goes (it may run twice), an epoch
    key's loss makes every forwarder refill. ``volatile-*`` evicts only keys with a TTL: leases
    and stored outcomes (a job may run twice) and harvested events' results.
    """
    if info is None or not info.maxmemory:
        return
    if info.policy.startswith("allkeys-") and not allow_eviction:
        raise RedisRefused(
            f"Redis's maxmemory-policy is {info.policy}: at its limit it may evict queued jobs, "
            "leases and epoch keys (jobs late or run twice); set it to noeviction, or start the "
            "forwarder with --allow-eviction to accept that"
        )
    if info.policy != "noeviction":
        log.warning(
            "Redis's maxmemory-policy is %s: at its limit it may evict leases and stored outcomes "
            "(a job may run twice); noeviction is what a queue needs",
            info.policy,
        )
