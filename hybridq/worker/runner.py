"""How a pool worker's process runs its jobs: worker threads, an event loop, and the timeouts.

:class:`Runner` runs each job it is given on one of its threads (``--threads``), or, for an
``async def`` task, on its event loop thread (at most ``--async-concurrency`` at once), and puts
the job on its ``done`` queue once it ran. Its watchdog thread enforces each job's timeout:

* at the deadline, a job on a thread gets :class:`~rq.timeouts.JobTimeoutException` raised in
  it (at its next Python instruction; an ``async def`` task is cancelled by ``asyncio.timeout``);
  the job fails as any job that raised does (its retries apply);
* a job still running :data:`STUCK_S` later is stuck where no exception reaches it (a blocking
  C call): the watchdog marks the runner *poisoned*: the process takes no more jobs, lets its
  other jobs finish, and exits, so that the stuck thread dies with it (the pool starts a fresh
  process). Nothing is recorded for the stuck job while its thread may still act: its lease is
  renewed until the process exits, then lapses, and the forwarder delivers it again (a ``lost``
  run; alone in its process). No other job is lost;
* a job **cancelled** while it runs (its lease renewal found the mark: :mod:`hybridq.worker.lease`)
  is first asked (``current_job().cancelled``); :attr:`Runner.cancel_grace_s` later, the
  watchdog stops it as it stops a timeout: :class:`hybridq.Cancelled` raised in its thread (the
  run ends ``cancelled``), then, still running :data:`STUCK_S` after that, the process is
  poisoned as above (the lease lapses, and the forwarder settles the job ``cancelled``: it is
  never delivered again). An exception in the thread, not the process killed at once, so
  that the other jobs of the process go on and the task's ``finally`` blocks run;
* the watchdog stamps :attr:`Runner.alive` in shared memory every :data:`TICK_S`: a process
  wedged so badly that its watchdog cannot run (a C call holding the GIL) is killed by the pool
  (:mod:`hybridq.worker.pool`), and its jobs are delivered again once their leases lapse.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rq.timeouts import JobTimeoutException

from hybridq.errors import Cancelled
from hybridq.worker import quick
from hybridq.worker.aloop import start_loop

__all__ = ["AHEAD", "AHEAD_QUICK", "CANCEL_GRACE_S", "STUCK_S", "TICK_S", "NotStarted", "Runner", "Taken"]

log = logging.getLogger("hybridq.worker")

#: How long past its deadline a job may ignore its timeout before it counts as stuck (seconds).
STUCK_S = 2.0
#: How often the watchdog looks at the running jobs and stamps its heartbeat (seconds).
TICK_S = 0.2
#: How long a cancelled job may run on after its worker saw the cancel, before it is stopped (s).
CANCEL_GRACE_S = 10.0
#: Jobs a process holds (running and taken ahead), per thread; while its runs are quick. With
#: no-op jobs on 2 cores, 4 per thread ran a burn-down 10-15 % faster than 2 (fewer, larger
#: batches per round trip). A job taken ahead is only reserved (claimed when it starts:
#: :mod:`hybridq.worker.starter`), and a reservation that waits long is given back; so jobs that
#: take longer are taken only for free threads: none waits behind them.
AHEAD = 1
AHEAD_QUICK = 4

_PENDING, _RUNNING, _DONE, _WITHDRAWN = 0, 1, 2, 3


@dataclass(eq=False, slots=True)
class Taken:
    """One job a pool worker process took: what it runs and what it reports to Redis after."""

    job_id: str
    queue: str
    run: Any = None  # set by the engine: its hybridq.worker.run.Run
    #: RQ's execution id, given when the job starts (:mod:`hybridq.worker.starter`); "" before.
    exec_id: str = ""
    recorded: bool = False  # RQ's records of that execution may exist (batch_scripts.RECORD)
    #: When the job was taken (reserved), and when its claim was sent (monotonic; 0: not).
    taken_at: float = 0.0
    claimed_at: float = 0.0
    #: The job's timeout in seconds (``None``: none), and when it started (time.time()).
    timeout: float | None = None
    started: float = 0.0
    result_ttl: int = 500
    failure_ttl: int = 31536000
    #: What RQ records: finished (True) or failed, and its result field ("return_value" or
    #: "exc_string", base64 as RQ writes it; "" for none).
    ok: bool = True
    rq_field: str = ""
    rq_value: str = ""
    #: The claim could not be sent (Redis unreachable): nothing is recorded for this job.
    dropped: bool = False
    deadline: float = 0.0  # (this and the next two: the runner's bookkeeping)
    state: int = _PENDING
    thread: int = 0
    #: Inside the task's own call (:meth:`Runner.guard`): only there may a timeout be raised.
    in_task: bool = False
    signalled: bool = False
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Set once the job is seen cancelled (its lease renewal's flag), and when to stop it then.
    cancel_flag: threading.Event | None = None
    cancel_at: float = 0.0


class Runner:
    """Threads and an event loop that run jobs, and a watchdog for their timeouts (module doc).

    Args:
        threads: worker threads (at least 1).
        async_concurrency: most ``async def`` jobs running at once.
        work: runs one job on a thread (claim, task, outcome); may hand an async job back by
            returning ``False`` after :meth:`start_async`.
        work_async: the same for an ``async def`` task, on the event loop.
        on_stuck: records the timeout of a stuck job (called on the watchdog thread).
        stamp: called with ``time.monotonic()`` every :data:`TICK_S` (the pool's liveness check).
        cancel_grace_s: how long a cancelled job may run on before it is stopped.
    """

    def __init__(
        self,
        threads: int,
        async_concurrency: int,
        work: Callable[[Taken], bool],
        work_async: Callable[[Taken], Awaitable[None]],
        on_stuck: Callable[[Taken], None],
        stamp: Callable[[float], None] = lambda _now: None,
        cancel_grace_s: float = CANCEL_GRACE_S,
    ) -> None:
        self.threads = max(1, threads)
        self.cancel_grace_s = cancel_grace_s
        self.async_concurrency = max(1, async_concurrency)
        self.done: queue.SimpleQueue[Taken] = queue.SimpleQueue()
        self._work = work
        self._work_async = work_async
        self._on_stuck = on_stuck
        self._stamp = stamp
        self._todo: queue.SimpleQueue[Taken | None] = queue.SimpleQueue()
        self._running: set[Taken] = set()
        self._lock = threading.Lock()
        #: Jobs given to the threads (or the loop) and not yet done.
        self.sync_pending = 0
        self.async_pending = 0
        #: A job is stuck: this process must take nothing more and exit once the rest are done.
        self.poisoned = False
        self.leaving = False  # set by the engine as the process leaves: nothing polls a busy key
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._pool = [
            threading.Thread(target=self._serve, name=f"hybridq-run-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for t in self._pool:
            t.start()
        self._watchdog = threading.Thread(target=self._watch, name="hybridq-watchdog", daemon=True)
        self._watchdog.start()

    # -- giving jobs ------------------------------------------------------------------------------

    def submit(self, item: Taken) -> None:
        """Run ``item`` on a thread (an async task is passed on to the loop from there)."""
        with self._lock:
            self.sync_pending += 1
        self._todo.put(item)

    def start_async(self, item: Taken) -> None:
        """Run ``item``'s coroutine function on the event loop (called by ``work`` on a thread)."""
        loop = self._event_loop()
        with self._lock:
            self.async_pending += 1
        asyncio.run_coroutine_threadsafe(self._run_async(item), loop)

    def room(self, lifetime_left: int | None = None, waiting: int = 0) -> int:
        """How many more jobs to take now: the free threads and prefetch, within the async limit.

        A job per thread, and four per thread while the process's recent runs are all quick
        (:func:`.quick.all_quick`): more jobs per round trip where a round trip costs more than
        the jobs it brings, and none waiting behind a busy thread where runs are slow. A job
        taken ahead is only reserved; it is claimed when a thread starts it (docs/worker.md).

        Args:
            lifetime_left: jobs the process may still take in its life (``--max-jobs`` minus
                those it ended), or None. The jobs given and not done count against it, and so
                do those done but not yet ended (:attr:`done`), which are read second: a job
                finishing meanwhile counts twice at worst, never not at all.
            waiting: jobs taken and not given to a thread yet (reserved for one).
        """
        depth = AHEAD_QUICK if quick.all_quick() else AHEAD
        with self._lock:
            sync_room = depth * self.threads - self.sync_pending - waiting
            async_room = self.async_concurrency - self.async_pending
            given = self.sync_pending + self.async_pending + waiting
        room = min(sync_room, async_room)
        if lifetime_left is not None:
            room = min(room, lifetime_left - given - self.done.qsize())
        return max(0, room)

    def batch(self) -> int:
        """The fewest jobs worth a take while jobs run: a thread's worth while runs are quick.

        Quick jobs in batches (a round trip costs more than they do); slower ones one by one.
        """
        return self.threads if quick.all_quick() else 1

    def pending(self) -> int:
        """Jobs given and not yet done."""
        with self._lock:
            return self.sync_pending + self.async_pending

    def withdraw(self, item: Taken) -> bool:
        """Take back ``item`` if it is neither started nor claimed; whether it was.

        Never started here then (its reservation is given back: :mod:`hybridq.worker.starter`);
        it stops counting as pending when a thread (or the loop) meets it and skips it.
        """
        with item.lock:
            if item.state != _PENDING or (item.run is not None and item.run.claim_reply is not None):
                return False  # started, or claimed to start now: never taken back
            item.state = _WITHDRAWN
            return True

    def close(self) -> None:
        """Stop the threads (after the jobs given to them) and the loop."""
        self._stop.set()
        for _ in self._pool:
            self._todo.put(None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    # -- the threads ------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                item = self._todo.get()
                if item is None:
                    return
                self._one(item)
            except (JobTimeoutException, Cancelled):
                continue  # a stop that arrived after its job ended (see _one): nothing to do

    def guard(
        self, item: Taken, func: Callable[..., Any], ready: Callable[[], bool] | None = None
    ) -> Callable[..., Any]:
        """``func`` (the task), marked as the one place ``item``'s timeout may be raised.

        Its timeout counts from the call; a timeout raised but not yet delivered when it
        returns is taken back, so it never lands in the claim, the outcome or the next job.
        ``ready``: asked last before the call (is its claim still its own? if not,
        :class:`NotStarted` instead of the call): a thread can be held up between any two of its
        instructions (another one holding the GIL), so the fewer there are after it, the better.
        """

        def call(*args: Any, **kwargs: Any) -> Any:
            if ready is not None and not ready():
                raise NotStarted(item.job_id)
            with item.lock:
                item.in_task = True
                if item.timeout is not None:
                    item.deadline = time.monotonic() + item.timeout
            try:
                return func(*args, **kwargs)
            finally:
                with item.lock:
                    item.in_task = False
                    if item.signalled:
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(item.thread), None)

        return call

    def _one(self, item: Taken) -> None:
        item.thread = threading.get_ident()
        with item.lock:
            withdrawn = item.state == _WITHDRAWN
            item.state = _DONE if withdrawn else _RUNNING
        if withdrawn:  # given back by the engine: never started here, never ended here
            with self._lock:
                self.sync_pending -= 1
            return
        with self._lock:
            self._running.add(item)
        handed_over = False
        try:
            handed_over = not self._work(item)
        except (JobTimeoutException, Cancelled):
            pass  # raised in the task's call (guard) as it returned: the run concluded already
        finally:
            with item.lock:
                item.state = _DONE
                abandoned = item.abandoned
                if item.signalled:  # a timeout raised but not yet delivered must not hit the next job
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(item.thread), None)
            if not abandoned:  # else the watchdog let it go already
                if not handed_over:
                    self.done.put(item)  # before it stops counting as pending: never in neither
                with self._lock:
                    self._running.discard(item)
                    self.sync_pending -= 1

    # -- the event loop ---------------------------------------------------------------------------

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = start_loop(self._stop.is_set)
            return self._loop

    async def _run_async(self, item: Taken) -> None:
        with item.lock:
            withdrawn = item.state == _WITHDRAWN
            item.state = _DONE if withdrawn else _RUNNING
        if withdrawn:  # given back by the engine (see withdraw)
            with self._lock:
                self.async_pending -= 1
            return
        try:
            await self._work_async(item)
        except BaseException:  # work_async records what the task raised: this is a bug's trace
            log.exception("job %s: the async runner failed", item.job_id)
            item.dropped = True
        finally:
            self.done.put(item)  # before it stops counting as pending: never in neither
            with self._lock:
                self.async_pending -= 1

    # -- the watchdog -----------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            self._stamp(now)
            with self._lock:
                running = list(self._running)
            for item in running:
                self._note_cancel(item, now)
            for item in running:
                if now >= _due(item)[0]:
                    self._expire(item, now)

    def _note_cancel(self, item: Taken, now: float) -> None:
        """Start the grace period of a job seen cancelled (once)."""
        flag = item.cancel_flag
        if item.cancel_at or flag is None or not flag.is_set():
            return
        item.cancel_at = now + self.cancel_grace_s
        log.info(
            "job %s: cancelled; stopping it in %g s unless it ends first", item.job_id, self.cancel_grace_s
        )

    def _expire(self, item: Taken, now: float) -> None:
        with item.lock:
            if item.state != _RUNNING or item.abandoned or not item.in_task:
                return  # only the task's own call is timed out (see guard)
            due, stop = _due(item)
            if not item.signalled:
                item.signalled = True
                if stop is Cancelled:
                    log.warning(
                        "job %s: cancelled, still running after its grace period: stopping it", item.job_id
                    )
                else:
                    log.warning(
                        "job %s: past its timeout (%s s): raising JobTimeoutException in it",
                        item.job_id,
                        item.timeout,
                    )
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(item.thread), ctypes.py_object(stop)
                )
                return
            if now < due + STUCK_S:
                return
            item.abandoned = True
        self.poisoned = True
        log.error(
            "job %s: still running %.0f s past its %s (a blocking call no exception reaches): "
            "this process takes no more jobs and exits once its others are done; the job's lease "
            "lapses then, and the forwarder delivers it again (or, cancelled, settles it)",
            item.job_id,
            now - due,
            "stop" if stop is Cancelled else "timeout",
        )
        self._on_stuck(item)
        self.done.put(item)
        with self._lock:
            self._running.discard(item)
            self.sync_pending -= 1  # its thread is lost to this process, which is ending


class NotStarted(BaseException):
    """A job's task was not called: its claim, checked just before, is gone (not a failure)."""


def _due(item: Taken) -> tuple[float, type[BaseException]]:
    """When ``item`` is to be stopped, and with what: its timeout, or its cancel's grace end."""
    timeout_at = item.deadline or float("inf")
    cancel_at = item.cancel_at or float("inf")
    if cancel_at < timeout_at:
        return cancel_at, Cancelled
    return timeout_at, JobTimeoutException
