"""The :func:`task` decorator: a module-level function that ``f.delay(...)`` enqueues.

This module must not import redis or rq.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

from hybridq.envelope.limits import limit_key, priority
from hybridq.envelope.model import function_path, validate_queue_name
from hybridq.job import Job
from hybridq.producer.queue import Queue
from hybridq.security.allow import register
from hybridq.workflows.canvas import SIGNATURE_OPTIONS, Signature, sig

__all__ = ["Task", "task"]

P = ParamSpec("P")
R = TypeVar("R")


class Task(Generic[P, R]):
    """A function that can still be called directly, and enqueued with :meth:`delay`."""

    def __init__(
        self,
        func: Callable[P, R],
        queue: str | Queue,
        journal: str | os.PathLike[str] | None,
        options: Mapping[str, Any],
    ) -> None:
        self.func = func
        self.path = function_path(func)  # refuse lambdas / nested functions at decoration time
        register(self.path)  # a worker that imported this module may run it
        self.options = dict(options)
        self._queue_spec = (queue, journal)
        self._queue: Queue | None = queue if isinstance(queue, Queue) else None
        functools.update_wrapper(self, func)

    @property
    def queue(self) -> Queue:
        """The queue, made on first use (so importing a module of tasks writes nothing)."""
        if self._queue is None:
            name, journal = self._queue_spec
            self._queue = Queue(str(name), journal)
        return self._queue

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the function directly, here and now (what a worker does)."""
        return self.func(*args, **kwargs)

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> Job:
        """Enqueue a call with the decorator's options; return once it is durable."""
        return self.queue.enqueue_call(self.path, args, kwargs, **self.options)

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature of this task for a workflow (Celery's ``.s``), with the decorator's options.

        The keywords ``queue``, ``retry``, ``job_timeout``, ``result_ttl``, ``description``,
        ``meta`` and ``immutable`` are the step's options (as for :func:`hybridq.sig`).
        """
        queue, _ = self._queue_spec
        name = queue.name if isinstance(queue, Queue) else str(queue)
        base = {k: v for k, v in self.options.items() if k in SIGNATURE_OPTIONS}
        signature = sig(self.path, *args, **kwargs)
        return Signature(
            signature.func, signature.args, signature.kwargs, {"queue": name, **base, **signature.options}
        )

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """:meth:`s`, immutable: it does not take the result of what ran before it (Celery's ``.si``)."""
        return self.s(*args, **kwargs).set(immutable=True)

    def enqueue_call(
        self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Job:
        """Enqueue with per-call options (``idempotency_key``, ``delay``, ...)."""
        return self.queue.enqueue_call(self.path, args, kwargs, **{**self.options, **options})


def task(
    queue: str | Queue = "default", *, journal: str | os.PathLike[str] | None = None, **options: Any
) -> Callable[[Callable[P, R]], Task[P, R]]:
    """Decorate a module-level function so ``f.delay(...)`` enqueues it.

    ``options`` are :meth:`Queue.prepare` options applied to every call (``job_timeout``,
    ``retry``, ...). The journal is resolved on the first ``delay``, not at import.
    """
    if isinstance(queue, str):
        validate_queue_name(queue)
    if "priority" in options:
        priority(options["priority"])  # refused at import, not at the first delay()
    if "limit_key" in options:
        limit_key(options["limit_key"])

    def wrap(func: Callable[P, R]) -> Task[P, R]:
        return Task(func, queue, journal, options)

    return wrap
