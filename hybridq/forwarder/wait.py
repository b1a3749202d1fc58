"""How the forwarder's loop waits between steps, and what wakes it.

:meth:`WaitMixin._wait` is the idle wait after a step: until a producer's nudge or an event
watcher's wake (:meth:`WaitMixin._wake`), at most until the next thing due (a schedule's tick, a
held delayed job, a retry, the terminal count's publication), not at all while a refill is going.
:meth:`WaitMixin._sleep` is a backoff's pause, which only a stop cuts short; both journal due
ticks (:meth:`WaitMixin._fire_between`, for the periodic jobs of :class:`Ticks`) so that a long
outage or backlog does not hold them back.

These are the forwarder's own methods (:class:`~hybridq.forwarder.loop.Forwarder`), kept in a mixin
so that they work on its attributes as they did in :mod:`hybridq.forwarder.loop` (tests replace
``_sleep`` and call ``_wait`` on the forwarder).

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from hybridq.errors import JournalIOError
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.push import Pusher
from hybridq.forwarder.state import ForwarderState
from hybridq.forwarder.upkeep import Upkeep
from hybridq.ledger.checkpoint import Checkpoint
from hybridq.protocol.nudge import NudgeListener, nudge

__all__ = ["Ticks", "WaitMixin"]

log = logging.getLogger("hybridq.forwarder")


class Ticks(Protocol):
    """Periodic jobs the forwarder keeps (``hybridq.scheduler.Scheduler``; docs/schedules.md)."""

    def fire(self, now: float) -> int:
        """Append the jobs of the ticks due at ``now`` to the journal; return how many."""

    def next_fire(self) -> float | None:
        """When the soonest tick is due (Unix time), if known."""

    def close(self) -> None:
        """Release what it holds (the forwarder closes it with itself)."""


class WaitMixin:
    """The loop's idle wait, its sleeps and wakes, ticks fired in between (see module docstring)."""

    # The forwarder's, set in Forwarder.__init__.
    journal: str
    config: ForwarderConfig
    clock: Callable[[], float]
    state: ForwarderState
    completions: Upkeep
    schedules: Ticks | None
    _pusher: Pusher
    _listener: NudgeListener | None
    _stopping: bool
    _publish_due: bool
    _next_publish: float

    if TYPE_CHECKING:  # the forwarder's own (hybridq.forwarder.loop)

        @property
        def checkpoint(self) -> Checkpoint:
            """Where forwarding stands."""

    def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, waking early only for a stop (producers' nudges do not cut it short)."""
        self._fire_between()
        deadline = time.monotonic() + seconds
        while not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._listener is not None:
                self._listener.wait(left)
            else:
                time.sleep(min(left, 0.05))  # no socket to wake it: look at the stop flag often

    def _wait(self) -> None:
        refilling = self.completions is not None and self.completions.reconciler.refilling
        if refilling and self._pusher.stats.down_since is None:
            # Redis lost its state: every unfinished job goes back, a batch per step, at once;
            # nothing else would wake the loop (the queues are empty, no worker sends events).
            # While Redis is down, the idle wait below paces the attempts.
            return
        timeout = self.config.idle_timeout_s
        tick = self.schedules.next_fire() if self.schedules is not None else None
        if tick is not None:
            timeout = min(timeout, max(0.0, tick - self.clock()))
        if self.checkpoint.held:
            timeout = min(timeout, max(0.0, self.checkpoint.held[0].run_at - self.clock()))
        # Retries still to push; one pushed waits for its worker's event, which wakes the loop.
        harvester = self.completions.harvester if self.completions is not None else None
        soonest = min(
            (
                run_at
                for loc, (run_at, attempt) in self.state.index.retries.items()
                if harvester is None or not harvester.retry_pushed(loc, attempt)
            ),
            default=None,
        )
        if soonest is not None:
            timeout = min(timeout, max(0.05, soonest - self.clock()))
        if self._publish_due:
            timeout = min(timeout, max(0.01, self._next_publish - time.monotonic()))
        if self._listener is not None:
            self._listener.wait(timeout)
        else:
            self._sleep(timeout)  # no nudges: poll (a stop still wakes it within 50 ms)

    def _wake(self) -> None:
        """Wake the loop through its own nudge socket (the event watcher does, on a new event)."""
        if self._listener is not None:
            nudge(self.journal, name=self._listener.name)

    def _fire_between(self) -> None:
        """Journal due ticks during a long step: a backlog, an outage, a full disk (best effort).

        A tick is appended to the journal, not pushed: Redis being down must not delay it. A
        failure here (the disk is full) is left for the next step, which retries it.
        """
        if self.schedules is None or self._stopping:
            return
        try:
            self.schedules.fire(self.clock())
        except (JournalIOError, OSError) as exc:
            log.debug("schedule ticks not appended yet: %s", exc)
