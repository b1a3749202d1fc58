"""An ``async def`` task's call in its run's own asyncio task: its stop, and what its end records.

:meth:`hybridq.worker.perform.Performer.work_async` awaits the task in the asyncio task of its
run, within ``asyncio.timeout``, not in a task of its own (nor ``wait_for``'s): a task that
ends with an error keeps it, and the error's traceback holds the frame that awaited the task, a
reference cycle that would hold a failed task's frames and data until a collection, rare in a
pool process (:mod:`hybridq.worker.gcpace`). The run's task is one per job
(:class:`~hybridq.worker.runner.Runner`), and the user's code shares it: its
``cancelling()`` count with the timeout and the stop, its context variables. So:

* the stop after a cancel's grace cancels that task, and takes its request back as it ends
  (:func:`stoppable`), as ``asyncio.timeout`` does its own;
* a cancel request the task leaves on it (Python 3.11's ``TaskGroup`` does, after a child's
  failure; so does a task that cancels itself and catches it) keeps ``asyncio.timeout`` from
  turning its cancel into ``TimeoutError``: a ``CancelledError`` out of an expired timeout is the
  timeout all the same (:func:`timed_out`; nothing in hybridq cancels a run's task from
  outside), and the requests left are taken back once the call is over (:func:`settle`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hybridq.errors import Cancelled
from hybridq.worker.runner import Taken

__all__ = ["ASYNC_POLL_S", "settle", "stoppable", "timed_out"]

log = logging.getLogger("hybridq.worker")

#: How often a running ``async def`` task's cancel flag is looked at (seconds).
ASYNC_POLL_S = 0.5


async def stoppable(item: Taken, coro: Any, grace: float) -> Any:
    """Await ``coro``; cancelled (hybridq cancel) and still running ``grace`` s later, stop it.

    The asyncio form of the watchdog's stop: the task is cancelled (``CancelledError`` in it,
    its ``finally`` blocks run) and the run ends with :class:`hybridq.Cancelled`, whatever the
    task does with the cancel (re-raises it, raises its own error or ``TimeoutError``, or
    swallows it and returns), as docs/worker.md says: a stopped run is never retried.
    """
    renewal = item.run.renewal
    if renewal is not None and renewal.cancelled.is_set():  # cancelled while it waited for the loop
        coro.close()
        raise Cancelled(f"job {item.job_id} was cancelled before it started")
    if renewal is None:
        return await coro
    flag = renewal.cancelled
    current = asyncio.current_task()
    assert current is not None  # a coroutine the loop runs
    stopped = False

    async def watch() -> None:
        nonlocal stopped
        while not flag.is_set():  # noqa: ASYNC110 - a threading.Event, set by the lease thread
            await asyncio.sleep(ASYNC_POLL_S)
        await asyncio.sleep(grace)
        log.warning("job %s: cancelled, still running after its grace period: stopping it", item.job_id)
        stopped = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        value = await coro
    except asyncio.CancelledError:
        if stopped:
            raise _stopped(item) from None
        raise
    except BaseException as exc:  # the task's own error (or TimeoutError) for the stop's cancel
        if stopped:
            raise _stopped(item) from exc
        raise
    finally:
        watcher.cancel()
        if stopped:
            current.uncancel()
    if stopped:  # it swallowed the stop's cancel and returned
        raise _stopped(item)
    return value


def _stopped(item: Taken) -> Cancelled:
    return Cancelled(f"job {item.job_id} was cancelled: stopped after its grace period")


def timed_out(error: BaseException, timer: asyncio.Timeout) -> bool:
    """Whether ``error``, out of ``timer``'s block, is the timeout's (not the task's own).

    ``TimeoutError`` once ``timer`` expired; or a ``CancelledError`` then: a cancel request the
    task left on its asyncio task kept ``asyncio.timeout`` from taking the cancel as its own.
    """
    return timer.expired() and isinstance(error, (TimeoutError, asyncio.CancelledError))


def settle(task: asyncio.Task[Any], cancelling: int) -> None:
    """Take back the cancel requests left on ``task`` past ``cancelling`` (the count before the call).

    A request the task's code left would make a later ``asyncio.timeout`` or ``TaskGroup`` in
    this asyncio task take its own cancel for one from outside. A task that called
    ``current_task().cancel()`` and returned without an await leaves a ``CancelledError``
    pending all the same (Python cannot take it back): the run's task must not await after the
    call's outcome is decided (``Runner._run_async`` does not), or it would lose it.
    """
    while task.cancelling() > cancelling:
        task.uncancel()
