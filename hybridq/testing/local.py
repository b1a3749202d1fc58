"""Jobs run in this process, for testing your own tasks and enqueueing code (docs/testing.md).

While a :class:`LocalQueue` is active (``with LocalQueue() as jobs:``, or the pytest fixtures
``hybridq_queue`` and ``hybridq_eager``), every ``Queue.enqueue`` and ``task.delay`` of the
process hands its jobs to it instead of a journal: no journal is needed or created. The jobs get
what production gives them:

* the same validation (bad options, a lambda, arguments JSON cannot hold raise at ``enqueue``);
* the JSON round trip: the task receives its arguments decoded from the delivery a worker
  decodes (a tuple arrives as a list), and its result is kept as the worker stores it;
* the worker's checks: the signature when a signing key is configured, and the allowlist
  (``@hybridq.task`` functions, ``HYBRIDQ_ALLOW``, plus ``allow=`` like ``worker --allow``);
* ``current_job()`` (id, idempotency key, attempt, max attempts, queue, function);
* ``Retry`` policies (the backoff is recorded, not waited for), ``RetryLater`` (deadlines count
  on a fake clock), and explicit idempotency keys (a second job with a key is a duplicate).

``eager=True`` runs each job at ``enqueue``; otherwise jobs wait for :meth:`LocalQueue.drain`.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Self

from hybridq.context import CurrentJob, _current
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import encode, read_result, result_repr
from hybridq.errors import DuplicateOfFailedJob, RetryLaterExpired
from hybridq.job import Job
from hybridq.journal import RecordId
from hybridq.producer.queue import Queue, Sink, install_sink
from hybridq.protocol import Delivery
from hybridq.protocol.later import resolve as resolve_later
from hybridq.security.allow import resolve as resolve_function
from hybridq.security.signing import expiry_refusal, keyring

__all__ = ["LocalJob", "LocalQueue", "eager"]

log = logging.getLogger("hybridq.testing")

#: Runs one :meth:`LocalQueue.drain` makes at most: a task that enqueues itself forever stops there.
MAX_RUNS = 10_000
_OWNER = "local"


class LocalJob(Job):
    """A job a :class:`LocalQueue` took: what production's :class:`~hybridq.Job` is, plus its run.

    ``status`` is ``queued`` (waiting for a drain), ``started``, ``retrying`` (a run failed with
    attempts left, or said RetryLater), ``finished`` or ``failed``. A duplicate (an explicit
    idempotency key another job had) never runs: it reports that job's status and result.
    """

    __slots__ = ("_due", "_dup", "_exc", "_exc_info", "_later", "_later_since", "_result", "_status", "runs")

    def __init__(self, envelope: Envelope, record: RecordId, duplicate: LocalJob | None) -> None:
        super().__init__(envelope, record, "")
        self._dup = duplicate
        self._status = "queued"
        self._result: Any = None
        self._exc: Exception | None = None
        self._exc_info: str | None = None
        self._later = 0
        self._later_since: float | None = None
        #: When a RetryLater asked to run again, on the queue's fake clock.
        self._due = 0.0
        #: Times the task was called for this job (a duplicate's stays 0).
        self.runs = 0

    @property
    def status(self) -> str:
        """``queued``, ``started``, ``retrying``, ``finished`` or ``failed``."""
        return self._dup.status if self._dup is not None else self._status

    @property
    def result(self) -> Any:
        """What the task returned, through JSON (``repr()`` if JSON cannot hold it); None until finished."""
        return self._dup.result if self._dup is not None else self._result

    @property
    def exc_info(self) -> str | None:
        """The traceback text of the last failed run (as the worker stores it), else ``None``."""
        return self._dup.exc_info if self._dup is not None else self._exc_info

    @property
    def exception(self) -> Exception | None:
        """The exception of the last failed run (the object itself), else ``None``."""
        return self._dup.exception if self._dup is not None else self._exc

    @property
    def attempt(self) -> int:
        """The job's attempt (``current_job().attempt`` of its last run; RetryLaters use none)."""
        return max(1, self.runs - self._later)

    @property
    def duplicate_of(self) -> str | None:
        """The id of the job that had this job's explicit idempotency key first, or ``None``."""
        return self._dup.id if self._dup is not None else None

    def get_status(self) -> str:
        """Production's words: ``accepted`` (queued), ``forwarded`` (started), or :attr:`status`."""
        return {"queued": "accepted", "started": "forwarded"}.get(self.status, self.status)

    def wait(self, timeout: float | None = None) -> Any:  # noqa: ARG002 - production's signature
        """The result of a finished job; its exception if it failed; RuntimeError if not done."""
        status = self.status
        if status == "finished":
            return self.result
        if status == "failed":
            error = self.exception
            raise error if error is not None else DuplicateOfFailedJob(str(self.exc_info))
        raise RuntimeError(f"job {self.id} is {status}: call drain() first")

    def __repr__(self) -> str:
        return f"<hybridq.testing.LocalJob {self.id} {self.envelope.func} {self.status}>"


class LocalQueue:
    """Takes every enqueue of this process while active, and runs the jobs here.

    Args:
        eager: run each job at ``enqueue`` (its retries too) instead of at :meth:`drain`.
        propagate: in eager mode, a job that fails for good raises its exception from
            ``enqueue`` / ``delay`` (as Celery's ``task_eager_propagates``); with ``False`` the
            returned job holds it (``job.status == "failed"``, ``job.exception``), as RQ's
            ``is_async=False``.
        allow: module prefixes the worker is run with (``hybridq worker --allow``), besides
            ``@hybridq.task`` functions and ``HYBRIDQ_ALLOW``.
    """

    def __init__(
        self, *, eager: bool = False, propagate: bool = True, allow: str | Iterable[str] = ()
    ) -> None:
        self.eager = eager
        self.propagate = propagate
        self.allow = (allow,) if isinstance(allow, str) else tuple(allow)
        #: Every job taken, in enqueue order.
        self.jobs: list[LocalJob] = []
        #: The fake clock RetryLater deadlines count on (Unix seconds); :meth:`drain` moves it.
        self.clock = time.time()
        self._keys: dict[str, LocalJob] = {}
        self._waiting: set[str] = set()  # said RetryLater: runs at the next drain, not this one
        self._lock = threading.RLock()
        self._records = itertools.count(1)
        self._previous: list[Sink | None] = []

    # -- activation ----------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self._previous.append(install_sink(self))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        install_sink(self._previous.pop())

    # -- what a test looks at ------------------------------------------------------------------

    @property
    def pending(self) -> list[LocalJob]:
        """Jobs that will run at a drain (``queued`` or ``retrying``)."""
        return [j for j in self.jobs if j.duplicate_of is None and j.status in ("queued", "retrying")]

    @property
    def finished(self) -> list[LocalJob]:
        """Jobs that ran and succeeded (duplicates of one included)."""
        return [j for j in self.jobs if j.status == "finished"]

    @property
    def failed(self) -> list[LocalJob]:
        """Jobs that failed for good (duplicates of one included)."""
        return [j for j in self.jobs if j.status == "failed"]

    # -- the sink --------------------------------------------------------------------------------

    def accept(self, queue: Queue, envelopes: list[Envelope]) -> list[Job]:  # noqa: ARG002
        """Take validated envelopes (``Queue.enqueue_many`` calls this); run them if eager."""
        with self._lock:
            jobs = [self._take(env) for env in envelopes]
        if self.eager:
            for job in jobs:
                if job.duplicate_of is None:
                    self._run_to_end(job)
            failed = [j.exception for j in jobs if j.status == "failed" and j.exception is not None]
            if self.propagate and failed:
                raise failed[0]  # every job of the call ran first, as each would have
        return list(jobs)

    def _take(self, env: Envelope) -> LocalJob:
        # Enqueue-if-absent (docs/enqueue.md): a key another job has makes a duplicate of it.
        owner = self._keys.get(env.idempotency_key)
        job = LocalJob(env, RecordId(_OWNER, next(self._records)), owner)
        if owner is None:
            self._keys[env.idempotency_key] = job
        self.jobs.append(job)
        return job

    # -- running -------------------------------------------------------------------------------

    def drain(self) -> int:
        """Run every pending job until none is left to run; the number of task runs.

        Jobs enqueued by a task run in the same drain; a failed run with attempts left runs again
        at once (its backoff is not waited for). A job that said ``RetryLater`` runs again at the
        next ``drain()``, which first moves :attr:`clock` on to when it asked to run. Jobs'
        ``delay`` / ``run_at`` are not waited for.
        """
        with self._lock:
            due = [j._due for j in self.jobs if j.id in self._waiting and j.status == "retrying"]
            if due:
                self.clock = max(self.clock, *due)
            self._waiting.clear()
        runs = 0
        while True:
            with self._lock:
                job = next((j for j in self.pending if j.id not in self._waiting), None)
            if job is None:
                return runs
            if runs >= MAX_RUNS:
                raise RuntimeError(f"drain() made {MAX_RUNS} runs and jobs are still pending")
            self._run_once(job)
            runs += 1

    def _run_to_end(self, job: LocalJob) -> None:
        while job.status in ("queued", "retrying") and job.id not in self._waiting:
            self._run_once(job)

    def _run_once(self, job: LocalJob) -> None:
        """One run of ``job``, as a worker makes it from the delivery the forwarder pushed."""
        job.runs += 1
        job._status = "started"
        delivery = Delivery(
            Envelope.from_bytes(job.envelope.to_bytes()),  # the journal record, read back
            _OWNER,
            (_OWNER, 0, job.record.seq),
            job.runs,
            later=job._later,
            later_since=job._later_since,
        )
        # What RQ's JSONSerializer carries to the worker: the task sees what JSON gives back.
        d = Delivery.from_json(json.loads(json.dumps(delivery.to_json())))
        env = d.envelope
        value: Any = None
        error: Exception | None = None
        refused = False
        try:
            func = self._function(env)
        except Exception as exc:  # refused or unimportable: a worker never runs it
            error, refused = exc, True
        else:
            context = _current.set(
                CurrentJob(env.id, env.idempotency_key, d.job_attempt, env.max_attempts, env.queue, env.func)
            )
            try:
                args, kwargs = env.call_args()
                value = _call(func, list(args), dict(kwargs))
            except Exception as exc:
                error = exc
            finally:
                _current.reset(context)
        error, later = resolve_later(d, error, self.clock)
        with self._lock:
            if later is not None:
                job._later, job._later_since = later.count, later.since
                job._due = self.clock + later.delay
                job._status = "retrying"
                self._waiting.add(job.id)
            elif error is None:
                job._status, job._result = "finished", _stored(value, env)
            else:
                job._exc, job._exc_info = error, "".join(traceback.format_exception(error))
                final = refused or isinstance(error, RetryLaterExpired) or d.job_attempt >= env.max_attempts
                job._status = "failed" if final else "retrying"

    def _function(self, env: Envelope) -> Callable[..., Any]:
        """What a worker resolves for ``env`` (signature, allowlist), or raise why it would not."""
        ring = keyring()
        if ring is not None:
            ring.verify(env)
            expired = expiry_refusal(env)
            if expired is not None:
                raise expired
        return resolve_function(env.func, self.allow)


def eager(*, propagate: bool = True, allow: str | Iterable[str] = ()) -> LocalQueue:
    """A :class:`LocalQueue` that runs each job at ``enqueue``: ``with hybridq.testing.eager():``."""
    return LocalQueue(eager=True, propagate=propagate, allow=allow)


def _call(func: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Call the task; an ``async def`` one on an event loop of its own, as the worker's runner."""
    if not inspect.iscoroutinefunction(inspect.unwrap(func)):
        return func(*args, **kwargs)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(func(*args, **kwargs))
    # An async test enqueued it: its loop is busy here, so the task gets a thread and a loop.
    out: list[Any] = []
    errors: list[BaseException] = []
    context = contextvars.copy_context()  # current_job() goes along

    def run() -> None:
        try:
            out.append(asyncio.run(func(*args, **kwargs)))
        except BaseException as exc:  # handed back to the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=context.run, args=(run,), name="hybridq-local-async")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def _stored(value: Any, env: Envelope) -> Any:
    """``value`` as the worker stores it (tagged JSON), or its ``repr()`` if that cannot hold it."""
    try:
        return read_result(json.dumps(encode(value)[0]))
    except Exception:  # as the worker (hybridq.worker.values.jsonable)
        log.warning("job %s (%s) returned a value JSON cannot hold; storing its repr()", env.id, env.func)
        return result_repr(value)
