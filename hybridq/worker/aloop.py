"""The pool process's event loop thread (``hybridq-async``), which runs its ``async def`` jobs.

This module must not import redis or rq.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

__all__ = ["serve_loop", "start_loop"]

log = logging.getLogger("hybridq.worker")


def serve_loop(loop: asyncio.AbstractEventLoop, stopped: Callable[[], bool]) -> None:
    """Run ``loop`` until it is stopped (:meth:`Runner.close`), whatever a task's step raises.

    asyncio lets ``SystemExit`` and ``KeyboardInterrupt`` out of ``run_forever`` from any task's
    step: one raised in a child task a job's task started (``create_task``, a ``TaskGroup``'s
    child) ended this thread, and every ``async def`` job of the process stalled. The child is
    done with it (the job awaiting the child sees it as its own: docs/worker.md), the loop's
    other callbacks are still queued, and running it again goes on with them. ``stopped``:
    whether the runner is closing (checked after such an error: ``run_forever`` forgets a
    ``loop.stop()`` that came in the same iteration).
    """
    while True:
        try:
            loop.run_forever()
        except (SystemExit, KeyboardInterrupt) as exc:
            # The traceback names the task that raised it.
            log.exception("a task on the event loop raised %s: ignored, the loop goes on", type(exc).__name__)
            if stopped():
                return
            continue
        return


def start_loop(stopped: Callable[[], bool]) -> asyncio.AbstractEventLoop:
    """A new event loop, run by a thread of its own (``hybridq-async``) until it is stopped."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=serve_loop, args=(loop, stopped), name="hybridq-async", daemon=True).start()
    return loop
