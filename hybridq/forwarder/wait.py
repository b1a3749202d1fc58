"""How the forwarder's loop waits between steps, and what wakes it.

:meth:`Waits.wait` is the idle wait after a step: until a producer's nudge or an event watcher's
wake (:meth:`Waits.wake`), at most until the next thing due (a schedule's tick, a held delayed job,
a retry, the terminal count's publication), not at all while a refill is going. :meth:`Waits.sleep`
is a backoff's pause, which only a stop cuts short; both journal due ticks
(:meth:`Waits.fire_between`, for the periodic jobs of :class:`Ticks`) so that a long outage or
backlog does not hold them back.

The forwarder (:class:`~hybridq.forwarder.loop.Forwarder`) holds one :class:`Waits`, which owns the
nudge socket the loop sleeps on (``Forwarder._listener`` reads it) and reads the rest of what it
needs from the parts it is handed.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

from hybridq.errors import JournalIOError
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.push import ForwarderStats
from hybridq.forwarder.state import ForwarderState
from hybridq.forwarder.upkeep import Upkeep
from hybridq.protocol.nudge import NudgeListener, nudge

__all__ = ["Ticks", "Waits"]

log = logging.getLogger("hybridq.forwarder")


class Ticks(Protocol):
    """Periodic jobs the forwarder keeps (``hybridq.scheduler.Scheduler``; docs/schedules.md)."""

    def fire(self, now: float) -> int:
        """Append the jobs of the ticks due at ``now`` to the journal; return how many."""

    def next_fire(self) -> float | None:
        """When the soonest tick is due (Unix time), if known."""

    def close(self) -> None:
        """Release what it holds (the forwarder closes it with itself)."""


@dataclass(eq=False)
class Waits:
    """The loop's idle wait, its sleeps and wakes, ticks fired in between (see module docstring)."""

    #: The journal directory (the nudge socket's name comes from it).
    journal: str
    #: The forwarder's options (its idle timeout).
    config: ForwarderConfig
    #: The forwarder's durable state (held jobs, retries).
    state: ForwarderState
    #: The completions side (a refill going on, retries already pushed).
    completions: Upkeep
    #: The forwarder's counters (whether the transport is down).
    stats: ForwarderStats
    #: The periodic jobs, if any.
    schedules: Ticks | None
    _: KW_ONLY
    #: The forwarder's clock.
    clock: Callable[[], float]
    #: Whether the forwarder was asked to stop.
    stopping: Callable[[], bool]
    #: When the terminal count is due to be published (``time.monotonic()``), if it is.
    publish_at: Callable[[], float | None]
    #: The socket producers' nudges arrive on; None until :meth:`listen`, or when it cannot be had.
    listener: NudgeListener | None = field(default=None, init=False)

    def listen(self) -> None:
        """Take the journal's nudge socket; without it the loop polls (each idle timeout)."""
        try:
            self.listener = NudgeListener(self.journal)
        except OSError as exc:
            # Someone else holds the name (abstract sockets have no permissions): run
            # without nudges; new records are still picked up within the idle timeout.
            log.warning(
                "cannot listen for producers' nudges (%s): polling every %.1f s",
                exc,
                self.config.idle_timeout_s,
            )

    def close(self) -> None:
        """Release the nudge socket. Idempotent."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, waking early only for a stop (producers' nudges do not cut it short)."""
        self.fire_between()
        deadline = time.monotonic() + seconds
        while not self.stopping():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.listener is not None:
                self.listener.wait(left)
            else:
                time.sleep(min(left, 0.05))  # no socket to wake it: look at the stop flag often

    def wait(self) -> None:
        """Wait for a nudge, at most until the next thing due (not at all while refilling)."""
        refilling = self.completions is not None and self.completions.reconciler.refilling
        if refilling and self.stats.down_since is None:
            # Redis lost its state: every unfinished job goes back, a batch per step, at once;
            # nothing else would wake the loop (the queues are empty, no worker sends events).
            # While Redis is down, the idle wait below paces the attempts.
            return
        timeout = self.config.idle_timeout_s
        tick = self.schedules.next_fire() if self.schedules is not None else None
        if tick is not None:
            timeout = min(timeout, max(0.0, tick - self.clock()))
        if self.state.checkpoint.held:
            timeout = min(timeout, max(0.0, self.state.checkpoint.held[0].run_at - self.clock()))
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
        publish_at = self.publish_at()
        if publish_at is not None:
            timeout = min(timeout, max(0.01, publish_at - time.monotonic()))
        if self.listener is not None:
            self.listener.wait(timeout)
        else:
            self.sleep(timeout)  # no nudges: poll (a stop still wakes it within 50 ms)

    def wake(self) -> None:
        """Wake the loop through its own nudge socket (the event watcher does, on a new event)."""
        if self.listener is not None:
            nudge(self.journal, name=self.listener.name)

    def fire_between(self) -> None:
        """Journal due ticks during a long step: a backlog, an outage, a full disk (best effort).

        A tick is appended to the journal, not pushed: Redis being down must not delay it. A
        failure here (the disk is full) is left for the next step, which retries it.
        """
        if self.schedules is None or self.stopping():
            return
        try:
            self.schedules.fire(self.clock())
        except (JournalIOError, OSError) as exc:
            log.debug("schedule ticks not appended yet: %s", exc)
