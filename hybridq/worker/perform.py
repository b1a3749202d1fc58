"""What runs one job a pool worker took: decoding its hash, the claim and task, RQ's record of it.

:func:`prepare` makes a :class:`~hybridq.worker.runner.Taken` of a job hash's fields (or says the
job is RQ's code's to run); :class:`Performer` runs it on a runner thread (:meth:`~Performer.work`)
or, for an ``async def`` task, on the runner's event loop (:meth:`~Performer.work_async`), with
:mod:`hybridq.worker.run`'s claim, lease, task call and outcome, and notes what RQ records of it
(finished with its return value, or failed with its error).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException

from hybridq import keys
from hybridq.context import _current
from hybridq.envelope import Envelope
from hybridq.errors import Cancelled
from hybridq.protocol import ENTRY_POINT, Delivery
from hybridq.signing import keyring
from hybridq.worker.admit import check
from hybridq.worker.run import CLAIMED, Run, begin, claim, conclude, perform, release
from hybridq.worker.runner import CANCEL_GRACE_S, NotStarted, Runner, Taken
from hybridq.worker.starter import Starter, hold_claimed

__all__ = ["FRESH_S", "Performer", "Resolver", "is_async", "prepare", "run_by_rq"]

log = logging.getLogger("hybridq.worker")

#: How often a running ``async def`` task's cancel flag is looked at (seconds).
ASYNC_POLL_S = 0.5
#: A claim older than this when its task is about to start is made again first (seconds): the
#: thread (or event loop) was held up since, and the claim may be gone (:meth:`Performer._fresh`).
FRESH_S = 0.05


def prepare(job_id: str, queue: str, fields: list[Any], resolve: Callable[[Envelope], Any]) -> Taken | None:
    """The job to run from its hash's fields, or ``None`` if RQ's code must run it."""
    data, origin, run_no, on_success, on_failure, on_stopped, timeout, result_ttl, failure_ttl = fields
    if run_no is None or on_success or on_failure or on_stopped or origin is None or origin.decode() != queue:
        return None
    try:
        with contextlib.suppress(zlib.error):  # RQ reads uncompressed data too
            data = zlib.decompress(data)
        func_name, instance, args, kwargs = json.loads(data)
        if func_name != ENTRY_POINT or instance is not None or len(args) != 1 or kwargs:
            return None
        d = Delivery.from_json(args[0])
        env = d.envelope
        if env.id != job_id or env.queue != queue:
            return None  # a copy of another job: RQ's code refuses it, unreported
        func = resolve(env)
        if func is None:
            return None  # refused or not importable here: RQ's code reports or leaves it
        item = Taken(job_id, queue, Run.new(args[0], d, func))
        seconds = int(timeout) if timeout else Queue.DEFAULT_TIMEOUT
        item.timeout = None if seconds < 0 else float(seconds)
        item.result_ttl = int(result_ttl) if result_ttl else 500
        item.failure_ttl = int(failure_ttl) if failure_ttl else 31536000
    except Exception:
        return None
    return item


class Resolver:
    """The function to run for an envelope (:func:`~hybridq.worker.admit.check`).

    Resolved once per path when no signing key is configured (a signature is each envelope's own).
    """

    def __init__(self) -> None:
        self._funcs: dict[str, Callable[..., Any]] = {}

    def __call__(self, env: Envelope) -> Callable[..., Any] | None:
        """The function for ``env``; ``None`` if refused or not importable here."""
        if keyring() is not None:
            return check(env)[0]
        func = self._funcs.get(env.func)
        if func is None:
            func = check(env)[0]
            if func is not None:
                self._funcs[env.func] = func
        return func


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
        return True

    def _claimed(self, item: Taken, *, again: bool = False) -> bool:
        """Claim ``item`` now, as its task is about to start; whether the task may run.

        The claim goes with those of the other threads starting now (:class:`.Starter`), or
        was made by the engine's turn for this thread; ``again``: a plain claim now, of a claim
        made too long ago (:meth:`_fresh`). A key another delivery holds is polled until it is
        claimed or has an outcome (each poll a claim at that moment). What RQ records of a job
        that does not run is noted here.
        """
        run = item.run
        try:
            if again:
                run.claim_reply = None  # claim() sends one (the same token: the lease is ours if kept)
            elif run.claim_reply is None and (self.starter is None or self.starter.start(item) is None):
                item.dropped = True  # could not be sent (logged): left for the forwarder
                return False
            sent = time.monotonic()  # before the claim: Redis may run it long before its reply is read
            answer = claim(self.client, run)
        except RedisError as exc:
            log.error(
                "job %s: cannot claim it (%s): left for the forwarder to deliver again", item.job_id, exc
            )
            item.dropped = True
            return False
        except Exception as exc:
            failed(item, text(exc))
            return False
        if answer is not CLAIMED:
            succeeded(item, answer)
            return False
        if again or not item.claimed_at:  # claimed by this call, or by a poll
            item.claimed_at = sent
            if run.renewal is not None:
                run.renewal.lost = False  # the lease is this run's again, as of `sent`
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
        waited = time.monotonic() - item.claimed_at
        if not _stale(item):
            return True
        log.info("job %s: claimed %.2f s ago and not started yet: claiming it again", item.job_id, waited)
        return self._claimed(item, again=True)

    async def work_async(self, item: Taken) -> None:
        """Claim, then run, one ``async def`` task on the runner's event loop."""
        run = item.run
        env = run.d.envelope
        # The claim is made here, as the coroutine starts (not when the engine gave it to the
        # loop): the loop may be busy first. Off the loop's thread: it waits for Redis.
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self._claimed, item):
            return

        async def task() -> Any:
            # The claim's last check, in the step that calls the task: the loop may have been
            # held up since the claim (a blocking coroutine, a thread holding the GIL).
            while _stale(item):
                if not await loop.run_in_executor(None, self._fresh, item):
                    raise NotStarted(item.job_id)  # the claim is gone: not called
            return await run.func(*env.args, **env.kwargs)

        context = begin(self.client, run)
        started = time.monotonic()
        value: Any = None
        error: Exception | None = None
        try:
            coro = task()
            value = await self._stoppable(
                item, asyncio.wait_for(coro, item.timeout) if item.timeout is not None else coro
            )
        except TimeoutError as exc:  # wait_for's, or the task's own
            timed_out = item.timeout is not None and time.monotonic() - started >= item.timeout
            error = (
                JobTimeoutException(f"Task exceeded maximum timeout value ({item.timeout:g} seconds)")
                if timed_out
                else exc
            )
        except Exception as exc:
            error = exc
        except NotStarted:
            release(run)
            run.finish = None  # not run: what the claim made again found is noted (_claimed)
            return
        except BaseException as exc:  # cancelled: no outcome, the lease lapses
            release(run)
            run.finish = None
            failed(item, text(exc))
            return
        finally:
            _current.reset(context)
        value, error = conclude(run, value, error)
        _record(item, value, error)

    async def _stoppable(self, item: Taken, coro: Any) -> Any:
        """Await ``coro``; cancelled (hybridq cancel) and still running after the grace, stop it.

        The asyncio form of the watchdog's stop: the task is cancelled (``CancelledError`` in
        it, its ``finally`` blocks run) and the run ends with :class:`hybridq.Cancelled`.
        """
        renewal = item.run.renewal
        if renewal is not None and renewal.cancelled.is_set():  # cancelled while it waited for the loop
            coro.close()
            raise Cancelled(f"job {item.job_id} was cancelled before it started")
        task = asyncio.ensure_future(coro)
        if renewal is None:
            return await task
        flag = renewal.cancelled
        grace = self.runner.cancel_grace_s if self.runner is not None else CANCEL_GRACE_S
        stopped = False

        async def watch() -> None:
            nonlocal stopped
            while not flag.is_set():  # noqa: ASYNC110 - a threading.Event, set by the lease thread
                await asyncio.sleep(ASYNC_POLL_S)
            await asyncio.sleep(grace)
            log.warning("job %s: cancelled, still running after its grace period: stopping it", item.job_id)
            stopped = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            return await task
        except asyncio.CancelledError:
            if stopped:
                raise Cancelled(f"job {item.job_id} was cancelled: stopped after its grace period") from None
            raise
        finally:
            watcher.cancel()

    def stuck(self, item: Taken) -> None:
        """A job stuck past its timeout (on the watchdog's thread): nothing is recorded for it.

        Its thread may still act; its lease stays renewed until this process exits, then lapses,
        and the forwarder delivers it again (a ``lost`` run). A recorded timeout would let the
        retry run while this run still does.
        """
        item.dropped = True


def _stale(item: Taken) -> bool:
    """Whether ``item``'s claim must be made again before its task starts (:meth:`Performer._fresh`).

    Sent more than :data:`FRESH_S` ago, or its lease's renewal already found it gone.
    """
    renewal = item.run.renewal
    return time.monotonic() - item.claimed_at > FRESH_S or (renewal is not None and renewal.lost)


def run_by_rq(rq_worker: Any, rq_queue: Queue, job_id: str, *, several_queues: bool) -> None:
    """Run one job with RQ's own worker code (hybridq's pipelining SimpleWorker), in this thread."""
    conn = rq_worker.connection
    try:
        job = rq_queue.job_class.fetch(job_id, connection=conn, serializer=JSONSerializer)
        rq_worker.execute_job(job, rq_queue)
    except Exception:  # RQ logs and records what a job does; this is what it did not catch
        log.exception("job %s: RQ's worker code failed on it", job_id)
    finally:
        if several_queues:  # RQ removes it from its intermediate list only when it serves one queue
            with contextlib.suppress(RedisError):
                conn.lrem(keys.rq_intermediate(rq_queue.name), 1, job_id)


def is_async(func: Callable[..., Any]) -> bool:
    """Whether ``func`` (or the function a ``hybridq.task`` wraps) is an ``async def``."""
    return inspect.iscoroutinefunction(inspect.unwrap(func))


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
