"""Group commit for coroutines: how ``enqueue_async`` shares fsyncs without blocking the loop.

A coroutine hands its validated batch to the :class:`Committer` of its queue and event loop and
awaits a future. The committer runs one commit at a time (:data:`MAX_INFLIGHT`) in a worker
thread: a commit takes every batch that waited meanwhile (up to a byte budget) and appends them
as one journal batch under one fsync (the queue's ``_commit``); the batches of the coroutines
that arrive while it runs wait for the next commit, which takes them all. The writer's own group
commit also shares that fsync with threads enqueueing through the same journal. The loop never
waits for the disk: it only builds envelopes and resolves futures.

This module must not import redis or rq.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["MAX_INFLIGHT", "Committer"]

T = TypeVar("T")
R = TypeVar("R")

#: Commits one committer runs at once. One: while it waits for its fsync (the GIL released),
#: the loop builds the next jobs, and the next commit takes all of them. Two or four (the next
#: batch written during the previous fsync) measured slower on 2 cores (scripts/bench-async):
#: smaller batches, more thread hand-offs.
MAX_INFLIGHT = 1
#: Threads shared by every committer of the process (a commit holds one while it waits for
#: its fsync; more committers than this queue for them).
MAX_THREADS = 8

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _commit_executor() -> ThreadPoolExecutor:
    """The process's commit threads (made on first use: importing hybridq starts none)."""
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="hybridq-commit")
    return _executor


def _after_fork_in_child() -> None:
    # The parent's threads do not exist in the child, and its lock may be held.
    global _executor, _executor_lock
    _executor, _executor_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Request(Generic[T, R]):
    __slots__ = ("future", "item", "size")

    def __init__(self, item: T, size: int, future: asyncio.Future[R]) -> None:
        self.item, self.size, self.future = item, size, future


class Committer(Generic[T, R]):
    """Batches the items coroutines submit and runs them through ``run`` in a worker thread.

    Used from one event loop only (its state is touched on that loop's thread alone).

    Args:
        run: called in a worker thread with the items of one commit, in submission order;
            returns one outcome per item, a result or the exception to raise in its coroutine.
        budget: a commit takes items until their sizes add up to this (always at least one).
    """

    def __init__(self, run: Callable[[list[T]], list[R | BaseException]], *, budget: int) -> None:
        self._run = run
        self._budget = budget
        self._pending: list[_Request[T, R]] = []
        self._inflight = 0
        self._scheduled = False  # a _start is due on the loop
        self.pid = os.getpid()  # a committer never crosses a fork (its futures are the parent's)
        #: Commits run so far (each one journal batch; tests and the benchmark read it).
        self.commits = 0

    async def submit(self, item: T, size: int) -> R:
        """Commit ``item`` with whatever else is waiting; return its outcome (or raise it).

        Cancelled before its commit took it, the item is withdrawn (never run); cancelled
        later, its outcome is not known to the caller.
        """
        loop = asyncio.get_running_loop()
        request: _Request[T, R] = _Request(item, size, loop.create_future())
        self._pending.append(request)
        self._schedule(loop)
        try:
            return await request.future
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                self._pending.remove(request)  # still waiting: nothing was written
            raise

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start a commit once the callbacks ready now have run, not at once.

        The coroutines that the last commit woke then submit their next items first, and the
        commit takes them all (started at the first submit, it would take one).
        """
        if not self._scheduled and self._inflight < MAX_INFLIGHT:
            self._scheduled = True
            loop.call_soon(self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start commits while items wait and fewer than :data:`MAX_INFLIGHT` run."""
        self._scheduled = False
        # A cancelled coroutine's future is cancelled at once, its withdrawal runs later: skip it.
        self._pending = [r for r in self._pending if not r.future.done()]
        while self._pending and self._inflight < MAX_INFLIGHT:
            taken, size = 0, 0
            for request in self._pending:
                if taken and size + request.size > self._budget:
                    break
                taken += 1
                size += request.size
            batch, self._pending = self._pending[:taken], self._pending[taken:]
            try:
                done = loop.run_in_executor(_commit_executor(), self._run, [r.item for r in batch])
            except RuntimeError as exc:  # the interpreter is exiting: no new threads
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(exc)
                continue
            self._inflight += 1
            self.commits += 1
            done.add_done_callback(functools.partial(self._finish, loop, batch))

    def _finish(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[_Request[T, R]],
        done: asyncio.Future[list[R | BaseException]],
    ) -> None:
        """On the loop: hand each coroutine its outcome, then start the next commit."""
        self._inflight -= 1
        outcomes: list[R | BaseException]
        if done.cancelled():
            outcomes = [asyncio.CancelledError()] * len(batch)
        elif (error := done.exception()) is not None:
            outcomes = [error] * len(batch)  # ``run`` failed as a whole (not an item's own outcome)
        else:
            outcomes = done.result()
        for request, outcome in zip(batch, outcomes, strict=True):
            if request.future.done():
                continue  # its coroutine was cancelled meanwhile
            if isinstance(outcome, BaseException):
                request.future.set_exception(outcome)
            else:
                request.future.set_result(outcome)
        if self._pending and not loop.is_closed():
            self._schedule(loop)
