"""The event watcher: a thread that wakes the forwarder's loop as soon as a completion event arrives.

A finished job whose event waits in Redis runs again if Redis loses it before the harvest (the
one window in docs/guarantees.md): harvesting only on producers' nudges and the idle timeout left
it open up to a second. The watcher blocks on the stream (XREAD BLOCK) and wakes the loop through
its own nudge socket, so the loop still sleeps in one place and a producer's nudge wakes it as
before. After a nudge it waits until the loop has harvested, so it never spins on events the loop
has not taken yet.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hybridq.transport import Transport

__all__ = ["WATCH_BLOCK_S", "EventWatcher"]

#: How long the event watcher blocks on the completion stream per call (seconds).
WATCH_BLOCK_S = 0.5


class EventWatcher:
    """Watches one forwarder's completion stream from a daemon thread.

    Args:
        transport: the backend (one whose ``blocking_events`` is true).
        owner: the forwarder's owner id (its stream).
        last_event_id: the id of the newest event harvested (it waits for a newer one).
        wake: wakes the forwarder's loop (a nudge to its own socket).
        patience_s: the longest wait for the loop to harvest after a wake.
    """

    def __init__(
        self,
        transport: Transport,
        owner: str,
        *,
        last_event_id: Callable[[], str],
        wake: Callable[[], None],
        patience_s: float,
    ) -> None:
        self.transport = transport
        self.owner = owner
        self._last_event_id = last_event_id
        self._wake = wake
        self._patience_s = patience_s
        self._stop = threading.Event()
        #: Set by the loop after each harvest: the watcher waits for it before it looks again.
        self._harvested = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridq-event-watcher", daemon=True)

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def harvested(self) -> None:
        """Tell the watcher the loop has harvested (it may look again)."""
        self._harvested.set()

    def stop(self) -> None:
        """Stop the thread (it blocks in Redis for at most :data:`WATCH_BLOCK_S`)."""
        self._stop.set()
        self._harvested.set()
        self._thread.join(WATCH_BLOCK_S * 2)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                found = self.transport.wait_events(self.owner, self._last_event_id(), WATCH_BLOCK_S)
            except Exception:  # Redis down, or anything else: the loop's idle timeout still harvests
                self._stop.wait(WATCH_BLOCK_S)
                continue
            if found and not self._stop.is_set():
                self._harvested.clear()
                self._wake()
                self._harvested.wait(self._patience_s + WATCH_BLOCK_S)
