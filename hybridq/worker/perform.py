"""What runs one job a pool worker took: the claim and task, RQ's record of it.

:func:`hybridq.worker.intake.prepare` makes a :class:`~hybridq.worker.runner.Taken` of a job
hash's fields; :class:`Performer` runs it on a runner thread (:meth:`~Performer.work`)
or, for an ``async def`` task, on the runner's event loop (:meth:`~Performer.work_async`), with
:mod:`hybridq.worker.run`'s claim, lease, task call and outcome, and notes what RQ records of it
(finished with its return value, or failed with its error).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import time
import zlib
from base64 import b64encode
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import RedisError
from rq.timeouts import JobTimeoutException

from hybridq.context import _current
from hybridq.worker import lease
from hybridq.worker.acall import settle, stoppable, timed_out
from hybridq.worker.run import BUSY, BUSY_POLL_S, CLAIMED, begin, claim, conclude, perform, release
from hybridq.worker.runner import CANCEL_GRACE_S, NotStarted, Runner, Taken
from hybridq.worker.starter import Starter, hold_claimed
from hybridq.worker.values import own_cancel

__all__ = ["FRESH_S", "Performer", "is_async"]

log = logging.getLogger("hybridq.worker")

#: A claim older than this when its task is about to start is made again first (seconds): the
#: thread (or event loop) was held up since, and the claim may be gone (:meth:`Performer._fresh`).
FRESH_S = 0.05
#: How many times an ``async def`` task's claim is made again while the event loop keeps being
#: held up past :data:`FRESH_S` between the claim and the call; then the job is given up
#: (:meth:`Performer.work_async`).
LATE_TRIES = 5


class Performer:
    """Runs the jobs of one pool worker process (see the module docstring).

    Args:
        client: the Redis client of the worker's own calls (claims, leases, outcomes).
        runner: the runner whose loop takes ``async def`` tasks.
        starter: claims jobs as they start, batched across threads (None: each claims alone).
    """

    def __init__(
        self, client: redis.Redis, runner: Runner | None = None, starter: Starter | None = None
    ) -> None:
        self.client = client
        self.runner = runner
        self.starter = starter

    def work(self, item: Taken) -> bool:
        """Claim and run one job on a runner thread; False if it went on to the event loop."""
        run = item.run
        if is_async(run.func):
            self.runner.start_async(item)  # type: ignore[union-attr]  # claimed there, as it starts
            return False
        if not self._claimed(item):
            return True
        if run.renewal is not None:
            item.cancel_flag = run.renewal.cancelled  # the watchdog stops it after a cancel's grace
        if self.runner is not None:  # the claim's last check is in the guard, right before the call
            run.func = self.runner.guard(item, run.func, ready=lambda: self._fresh(item))
        elif not self._fresh(item):
            return True
        try:
            value, error = perform(self.client, run)
        except NotStarted:
            run.finish = None  # not run: what the claim made again found is noted (_claimed)
            return True
        except BaseException as exc:
            run.finish = None
            failed(item, text(exc))
            return True
        _record(item, value, error)
        # Not kept as this frame ends: the frame that caught it, in its traceback, links to this
        # one (its caller), so the task's frames and data would wait for a collection (a cycle).
        del error
        return True

    def _claimed(self, item: Taken, *, again: bool = False, wait: bool = True) -> bool | None:
        """Claim ``item`` now, as its task is about to start; whether the task may run.

        The claim goes with those of the other threads starting now (:class:`.Starter`), or
        was made by the engine's turn for this thread; ``again``: a plain claim now, of a claim
        made too long ago (:meth:`_fresh`), or a poll. A key another delivery holds is polled
        until it is claimed or has an outcome (each poll a claim at that moment), or this
        process is leaving (:meth:`_poll`); ``wait`` False: not polled, ``None`` returned (the
        event loop waits between polls: :meth:`_claim_async`). What RQ records of a job that
        does not run is noted here.
        """
        run = item.run
        try:
            if again:
                run.claim_reply = None  # claim() sends one (the same token: the lease is ours if kept)
            elif run.claim_reply is None and (self.starter is None or self.starter.start(item) is None):
                item.dropped = True  # could not be sent (logged): left for the forwarder
                return False
            sent = time.monotonic()  # before the claim: Redis may run it long before its reply is read
            answer = claim(self.client, run, self._poll if wait else _once)
        except RedisError as exc:
            log.error(
                "job %s: cannot claim it (%s): left for the forwarder to deliver again", item.job_id, exc
            )
            item.dropped = True
            return False
        except Exception as exc:
            failed(item, text(exc))
            return False
        if answer is BUSY:
            if not wait:
                return None
            self._give_up(item)
            return False
        if answer is not CLAIMED:
            succeeded(item, answer)
            return False
        if again or not item.claimed_at:  # claimed by this call, or by a poll
            item.claimed_at = sent
            if run.renewal is not None:  # held since an earlier claim: the supervisor may have let go
                lease.hold_again(run.renewal)
        hold_claimed(self.client, [run])  # claimed by a poll (a claim the starter made is held)
        return True

    def _fresh(self, item: Taken) -> bool:
        """Whether ``item``'s task may start now: its claim is fresh, or still ours when asked again.

        The last check before the task's call. A claim sent more than :data:`FRESH_S` ago (its
        thread or the event loop was held up: a task holding the GIL, a busy loop), or whose
        lease's renewal found it gone, may be gone by now (Redis back from a snapshot, this
        host cut off past the lease): it is made again, now, with the same token (the lease is
        ours if it was kept, after the epoch fences).
        """
        if not _stale(item):
            return True
        _claiming_again(item)
        return bool(self._claimed(item, again=True))

    def _poll(self) -> bool:
        """Whether to claim a busy key again (after :data:`BUSY_POLL_S`): not if this process is leaving.

        A process that is leaving (stopped, recycled, a job stuck in it) waits for its jobs to
        end: one polling for a key that a stuck job holds (its lease renewed until the process
        exits) would keep it for good.
        """
        if not self._leaving():
            time.sleep(BUSY_POLL_S)
        return not self._leaving()

    def _leaving(self) -> bool:
        return self.runner is not None and self.runner.leaving

    def _give_up(self, item: Taken) -> None:
        """Leave ``item`` unstarted (its key busy, this process leaving): the forwarder delivers it again."""
        log.info(
            "job %s: its key is held by another run and this process is leaving: not started; "
            "delivered again",
            item.job_id,
        )
        release(item.run)  # a lease it held before (claimed, then lost) is not renewed any more
        item.dropped = True

    async def _claim_async(self, item: Taken, *, again: bool = False) -> bool:
        """:meth:`_claimed` from the event loop: each try on an executor thread, the polls' waits on the loop.

        Off the loop's thread, as a claim waits for Redis; but the loop's shared executor (a few
        threads) never holds a thread polling a busy key: as many deliveries of one key as it
        has threads would take them all, and the delivery holding the key could not get one to
        claim it again (a deadlock).
        """
        loop = asyncio.get_running_loop()
        while True:
            claimed = await loop.run_in_executor(
                None, functools.partial(self._claimed, item, again=again, wait=False)
            )
            if claimed is not None:
                return claimed
            if self._leaving():
                self._give_up(item)
                return False
            await asyncio.sleep(BUSY_POLL_S)
            again = True  # a poll: a plain claim now

    async def work_async(self, item: Taken) -> None:
        """Claim, then run, one ``async def`` task on the runner's event loop.

        The claim is made here, as the coroutine starts (not when the engine gave it to the
        loop: the loop may be busy first), and made again while it is stale (:meth:`_ready_async`),
        before the task's timeout starts: a claim that waits for a busy key or for Redis is not
        the task running. Its last check is in the very step that calls the task
        (:meth:`_call_async`); a loop held up past :data:`FRESH_S` after each of
        :data:`LATE_TRIES` claims made again gives the job up (not started: delivered again).
        """
        if not await self._claim_async(item):
            return
        for _ in range(LATE_TRIES):
            if not await self._ready_async(item):
                return
            try:
                ran = await self._call_async(item)
            except _Late:
                continue  # held up between the claim and the call: made again first
            if ran is not None:
                _record(item, *conclude(item.run, *ran))
            return
        log.warning(
            "job %s: its event loop was held up after each of %d claims made again: not started; "
            "delivered again",
            item.job_id,
            LATE_TRIES,
        )
        release(item.run)
        item.dropped = True

    async def _ready_async(self, item: Taken) -> bool:
        """:meth:`_fresh` for the event loop: a stale claim made again (off the loop's thread)."""
        if not _stale(item):
            return True
        _claiming_again(item)
        return await self._claim_async(item, again=True)

    async def _call_async(self, item: Taken) -> tuple[Any, Exception | None] | None:
        """Call ``item``'s task, within its timeout; what it returned or raised.

        ``None``: no outcome (the run cancelled from outside: noted here). Raises :class:`_Late`
        if its claim went stale before the call (the task not called).
        """
        run = item.run
        env = run.d.envelope
        called = False

        async def task() -> Any:
            # The claim's last check, in the step that calls the task: no await between the two,
            # so no other coroutine holds the loop up in between.
            nonlocal called
            if _stale(item):
                raise _Late(item.job_id)
            called = True
            args, kwargs = env.call_args()  # tagged values decoded
            return await run.func(*args, **kwargs)

        context = begin(self.client, run)
        timer = asyncio.timeout(item.timeout)  # None: none
        current = asyncio.current_task()
        assert current is not None  # a coroutine the loop runs
        cancelling = current.cancelling()
        grace = self.runner.cancel_grace_s if self.runner is not None else CANCEL_GRACE_S
        try:
            async with timer:
                return await stoppable(item, task(), grace), None
        except _Late:
            raise
        except BaseException as exc:
            if not called and isinstance(exc, TimeoutError):  # it starts in the step of the call
                raise _Late(item.job_id) from None
            if timed_out(exc, timer):  # the timeout's (see hybridq.worker.acall), not the task's own
                return None, JobTimeoutException(
                    f"Task exceeded maximum timeout value ({item.timeout:g} seconds)"
                )
            if isinstance(exc, Exception):
                return None, exc
            if called and isinstance(exc, asyncio.CancelledError):
                # Not the stop's nor the timeout's (told apart above): the task's own. No name
                # kept: its traceback holds this frame (hybridq.worker.values.own_cancel).
                return None, own_cancel(exc)
            # Cancelled from outside the run (SystemExit, KeyboardInterrupt too): no outcome,
            # the lease lapses.
            release(run)
            run.finish = None
            if called:
                failed(item, text(exc))
            else:  # never started: nothing recorded, delivered again
                item.dropped = True
            return None
        finally:
            settle(current, cancelling)
            _current.reset(context)

    def stuck(self, item: Taken) -> None:
        """A job stuck past its timeout (on the watchdog's thread): nothing is recorded for it.

        Its thread may still act; its lease stays renewed until this process exits, then lapses,
        and the forwarder delivers it again (a ``lost`` run). A recorded timeout would let the
        retry run while this run still does.
        """
        item.dropped = True


class _Late(NotStarted):
    """An ``async def`` task's claim went stale before its call (the loop held up): made again first."""


def _once() -> bool:
    """A busy key is not polled (:func:`~hybridq.worker.run.claim`'s ``poll``)."""
    return False


def _claiming_again(item: Taken) -> None:
    waited = time.monotonic() - item.claimed_at
    log.info("job %s: claimed %.2f s ago and not started yet: claiming it again", item.job_id, waited)


def _stale(item: Taken) -> bool:
    """Whether ``item``'s claim must be made again before its task starts (:meth:`Performer._fresh`).

    Sent more than :data:`FRESH_S` ago, or its lease's renewal already found it gone.
    """
    renewal = item.run.renewal
    return time.monotonic() - item.claimed_at > FRESH_S or (renewal is not None and renewal.lost)


#: :func:`is_async`'s answers, by function: asked twice per job (the engine's take, the thread
#: that runs it) of the few functions a process runs, at about 0.6 us each through ``inspect``
#: (docs/benchmarks.md, "The pool's Python per job"). Emptied when it grows past
#: :data:`_ASYNC_MAX` (a process resolving a new function object per job). A function whose
#: ``__code__`` is replaced in place (a hot reload) keeps its first answer until then.
_async: dict[Callable[..., Any], bool] = {}
_ASYNC_MAX = 1024


def is_async(func: Callable[..., Any]) -> bool:
    """Whether ``func`` (or the function a ``hybridq.task`` wraps) is an ``async def``."""
    try:
        return _async[func]
    except KeyError:
        pass
    except Exception:  # unhashable, or a __hash__ or __eq__ that raises: asked each time
        return inspect.iscoroutinefunction(inspect.unwrap(func))
    answer = inspect.iscoroutinefunction(inspect.unwrap(func))
    if len(_async) >= _ASYNC_MAX:
        _async.clear()
    _async[func] = answer
    return answer


def _record(item: Taken, value: Any, error: Exception | None) -> None:
    """Note what RQ records of a run whose task returned ``value`` or raised ``error``."""
    run = item.run
    if error is None:
        succeeded(item, value, run.result_json)
    else:
        failed(item, run.error_text or text(error))


def succeeded(item: Taken, value: Any, text: str | None = None) -> None:
    """Note that RQ records ``item`` finished, with ``value`` (JSON ``text``, if made) as its result."""
    item.ok = True
    if value is not None:
        item.rq_field = "return_value"
        item.rq_value = b64encode((text if text is not None else json.dumps(value)).encode()).decode()


def failed(item: Taken, text: str) -> None:
    """Note that RQ records ``item`` failed, with ``text`` as its error."""
    item.ok = False
    item.rq_field = "exc_string"
    item.rq_value = b64encode(zlib.compress(text.encode())).decode()


def text(error: BaseException) -> str:
    """One line naming ``error``'s class and message."""
    return f"{type(error).__module__}.{type(error).__qualname__}: {error}"
