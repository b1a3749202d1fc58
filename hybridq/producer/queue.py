"""The enqueue API: :class:`Queue`.

The :class:`~hybridq.job.Job` handle it returns is in :mod:`hybridq.job`, the ``task``
decorator in :mod:`hybridq.producer.task`, the checks of a call's options (``split_call``, importable
from here too) in :mod:`hybridq.producer.calls`.

``enqueue`` validates the call, signs the envelope when a signing key is configured
(:mod:`hybridq.security.signing`), commits it to the journal (acknowledged only after an fsync covers it),
nudges the forwarder and returns. It never touches Redis, so it keeps working
while Redis is down. Bad input raises before anything is written.

This module must not import redis or rq.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hybridq.client.queue import Remote, remote_for
from hybridq.envelope.limits import limit_key as check_limit_key
from hybridq.envelope.limits import priority as check_priority
from hybridq.envelope.model import (
    Envelope,
    Retry,
    new_job_id,
    validate_job_id,
    validate_queue_name,
)
from hybridq.envelope.tagged import tag_call
from hybridq.errors import ConfigError, EnvelopeError
from hybridq.job import Job, fetch_job
from hybridq.journal import MAX_PAYLOAD_BYTES, Durability, JournalWriter
from hybridq.journal.paths import default_journal, ensure_journal_dir
from hybridq.producer.aio import Committer
from hybridq.producer.calls import _OPTIONS as _OPTIONS  # noqa: PLC0414 - re-exported (moved)
from hybridq.producer.calls import _RQ_ONLY_OPTIONS as _RQ_ONLY_OPTIONS  # noqa: PLC0414 - re-exported
from hybridq.producer.calls import (
    _Call,
    _check_retry,
    _run_at,
    _seconds,
    check_options,
    encode_envelopes,
    split_call,
    task_path,
)
from hybridq.producer.capacity import PendingCount
from hybridq.producer.commit import Appender
from hybridq.producer.flows import dependency_ids, is_workflow, with_deps, workflow_envelope
from hybridq.producer.writers import Sink, install_sink, installed_sink, shared_writer
from hybridq.producer.writers import _close_writers as _close_writers  # noqa: PLC0414 - re-exported (moved)
from hybridq.protocol.nudge import address
from hybridq.tracing import enqueue_carrier
from hybridq.workflows.canvas import refuse_step_id

__all__ = ["Job", "Queue", "Sink", "default_journal", "install_sink", "shared_writer", "split_call"]

# -- queues -------------------------------------------------------------------------------------


class Queue:
    """A named queue on a journal, shaped like ``rq.Queue``.

    Args:
        name: the queue (and RQ queue) name.
        journal: the journal directory; default ``$HYBRIDQ_JOURNAL``. Without either, the first
            enqueue raises :class:`~hybridq.errors.ConfigError` (nothing is created in the
            working directory), unless :mod:`hybridq.testing` takes the jobs.
        capacity: the most pending jobs (accepted, not yet terminal) the journal may hold; over
            it, ``enqueue`` raises :class:`QueueFull` and writes nothing. ``None``: no limit.
        durability: :attr:`Durability.FSYNC` unless a weaker mode is asked for by name.
        default_timeout: job timeout in seconds when a call does not give one.
        default_result_ttl: seconds RQ keeps a result when a call does not say.
        default_retry: retry policy when a call does not give one.
        url: ingest nodes (``"http://a:8080,http://b:8080"``) to enqueue through instead of a
            journal (docs/api.md, "A remote queue"); default ``$HYBRIDQ_URL`` when no journal
            is configured. Needs the ``client`` extra.
        token: their bearer token; default ``$HYBRIDQ_TOKEN``.
    """

    def __init__(
        self,
        name: str = "default",
        journal: str | os.PathLike[str] | None = None,
        *,
        capacity: int | None = None,
        durability: Durability = Durability.FSYNC,
        default_timeout: float | None = None,
        default_result_ttl: float | None = None,
        default_retry: Retry | None = None,
        url: str | Sequence[str] | None = None,
        token: str | None = None,
    ) -> None:
        self.name = validate_queue_name(name)
        #: The ingest nodes this queue enqueues through, if it has no journal.
        self.remote: Remote | None = remote_for(url, token, journal)
        if self.remote is not None and capacity is not None:
            raise ConfigError(
                "capacity= is the nodes' own with url= (hybridq serve --capacity): a 429 is QueueFull"
            )
        if capacity is not None and capacity < 1:
            raise ValueError("capacity must be a positive number of jobs, or None")
        self.capacity = capacity
        self.durability = Durability(durability)
        # Checked now (as every call would check them): the error points at the Queue(...) line.
        self.default_timeout = _seconds("default_timeout", default_timeout)
        self.default_result_ttl = _seconds("default_result_ttl", default_result_ttl)
        if default_retry is not None:
            _check_retry(default_retry)
        self.default_retry = default_retry
        #: Its appends to the journal, once one is bound.
        self._appender: Appender | None = None
        #: enqueue_async's group commit, one per event loop (see hybridq.producer.aio).
        self._committers: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, Committer[_Call, list[Job]]
        ] = weakref.WeakKeyDictionary()
        self._journal: str | None = None
        #: Without ``journal``: the ``$HYBRIDQ_JOURNAL`` the journal was resolved from.
        self._from_env: str | None = None
        if journal is not None:
            self._bind(journal)
        elif self.remote is None and os.environ.get("HYBRIDQ_JOURNAL"):
            _ = self.journal
        # else resolved on first use: a module-level Queue() imports in a test (hybridq.testing)

    def _bind(self, journal: str | os.PathLike[str]) -> str:
        path = ensure_journal_dir(journal)
        pending = PendingCount(path) if self.capacity is not None else None
        self._appender = Appender(path, address(path), pending)
        self._journal = path
        return path

    @property
    def journal(self) -> str:
        """The journal directory: the one given, else ``$HYBRIDQ_JOURNAL`` (ConfigError without).

        Without ``journal=``, the variable is read again at each enqueue (a test may change it).
        """
        if self._journal is not None and self._from_env is None:
            return self._journal  # given
        env = os.environ.get("HYBRIDQ_JOURNAL")
        if env and env == self._from_env and self._journal is not None:
            return self._journal
        path = self._bind(default_journal())
        self._from_env = env
        return path

    def __repr__(self) -> str:
        if self.remote is not None:
            return f"<hybridq.Queue {self.name!r} url={','.join(self.remote.urls)!r}>"
        return f"<hybridq.Queue {self.name!r} journal={self._journal!r}>"

    def enqueue(
        self, f: Callable[..., Any] | str, *args: Any, idempotency_key: str | None = None, **kwargs: Any
    ) -> Job:
        """Enqueue ``f(*args, **kwargs)``; return once the job is durable.

        Like ``rq.Queue.enqueue``, these keyword arguments are options, not the function's:
        ``job_timeout``, ``result_ttl``, ``description``, ``meta``, ``retry``, ``job_id``,
        ``delay`` (seconds or a timedelta), ``run_at`` (a datetime or Unix time), ``priority``
        (0-9, higher forwarded first) and ``limit_key`` (the key the forwarder's limits and
        fairness count the job under: docs/api.md). Use
        :meth:`enqueue_call` when the function itself takes one of those names.
        """
        if is_workflow(f):  # a signature or a shape: its anchor, one record (docs/workflows.md)
            if args:
                raise EnvelopeError(
                    "enqueue(workflow) takes no positional arguments: put them in the signatures"
                )
            options = {
                **kwargs,
                **({"idempotency_key": idempotency_key} if idempotency_key is not None else {}),
            }
            return self.enqueue_many([workflow_envelope(self, f, options)])[0]
        if not kwargs:
            return self.enqueue_call(f, args, None, idempotency_key=idempotency_key)
        args, call_kwargs, options = split_call(args, kwargs)
        return self.enqueue_call(f, args, call_kwargs, idempotency_key=idempotency_key, **options)

    def enqueue_call(
        self,
        func: Callable[..., Any] | str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Job:
        """Enqueue with the call's arguments and options given separately (see :meth:`prepare`)."""
        return self.enqueue_many([self.prepare(func, args, kwargs, **options)])[0]

    def enqueue_many(self, jobs: Iterable[Envelope]) -> list[Job]:
        """Enqueue envelopes made by :meth:`prepare` under one fsync: all are acknowledged, or none.

        A :class:`~hybridq.errors.JournalIOError` means none was acknowledged and the outcome is
        unknown (``docs/journal.md``): retry them under the same idempotency keys (``job_ids``
        and ``idempotency_keys`` on the error name them).

        With a signing key configured (``HYBRIDQ_SIGNING_KEY_FILE``), each envelope is signed
        first, and the returned jobs hold the signed envelopes.
        """
        if self.remote is not None and installed_sink() is None:
            return self.remote.enqueue(jobs)  # each POST waits for its node's fsync
        call = encode_envelopes(jobs)
        sink = installed_sink()
        if sink is not None:
            return sink.accept(self, call[0])
        (outcome,) = self._commit([call])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def enqueue_async(
        self, f: Callable[..., Any] | str, *args: Any, idempotency_key: str | None = None, **kwargs: Any
    ) -> Job:
        """:meth:`enqueue` for coroutines: return once the job is durable, never blocking the loop.

        The same arguments, validation (bad input raises here, before anything is written) and
        result. The fsync is waited for off the event loop, and the jobs of coroutines that
        enqueue meanwhile share it (docs/api.md, "asyncio").
        """
        if kwargs:
            args, call_kwargs, options = split_call(args, kwargs)
            env = self.prepare(f, args, call_kwargs, idempotency_key=idempotency_key, **options)
        else:
            env = self.prepare(f, args, None, idempotency_key=idempotency_key)
        return (await self.enqueue_many_async([env]))[0]

    async def enqueue_many_async(self, jobs: Iterable[Envelope]) -> list[Job]:
        """:meth:`enqueue_many` for coroutines: one fsync, all acknowledged or none, off the loop.

        Cancelled while it waits, the jobs may or may not have been written (as after a
        :class:`~hybridq.errors.JournalIOError`): enqueue them again under the same idempotency
        keys if it matters. A remote queue's call is never withdrawn: its POSTs go on in their
        thread (each job's key is its ``idempotency_key``, else ``hq-<envelope id>``).
        """
        if self.remote is not None and installed_sink() is None:
            return await asyncio.to_thread(self.remote.enqueue, list(jobs))  # off the loop
        envelopes, payloads = encode_envelopes(jobs)
        sink = installed_sink()
        if sink is not None:
            return sink.accept(self, envelopes)  # hybridq.testing: in process, as enqueue_many does
        if not envelopes:
            return []
        _ = self.journal  # ConfigError when none is configured: raised here, for this call alone
        loop = asyncio.get_running_loop()
        committer = self._committers.get(loop)
        if committer is None or committer.pid != os.getpid():
            committer = self._committers[loop] = Committer(self._commit, budget=MAX_PAYLOAD_BYTES)
        return await committer.submit((envelopes, payloads), sum(map(len, payloads)))

    def _commit(self, calls: list[_Call]) -> list[list[Job] | BaseException]:
        """Each call's outcome, appended under one fsync per chain (:mod:`hybridq.producer.commit`)."""
        _ = self.journal  # ConfigError when none is configured; binds the appender
        assert self._appender is not None
        return self._appender.commit(calls, self.capacity, self.durability)

    def _use_writer(self, writer: JournalWriter) -> None:
        """Append every call through ``writer`` (:mod:`hybridq.scheduler`: its ticks' own chain)."""
        _ = self.journal
        assert self._appender is not None
        self._appender.use(writer)

    def prepare(
        self,
        func: Callable[..., Any] | str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        job_timeout: float | None = None,
        result_ttl: float | None = None,
        description: str | None = None,
        meta: Mapping[str, Any] | None = None,
        retry: Retry | None = None,
        job_id: str | None = None,
        delay: float | dt.timedelta | None = None,
        run_at: float | dt.datetime | None = None,
        priority: int = 0,
        limit_key: str | None = None,
        depends_on: object = None,
        _fresh_key: bool = False,
    ) -> Envelope:
        """Validate a call and build its envelope (nothing is written). For :meth:`enqueue_many`.

        ``depends_on`` (a job, a job id, or a list of them, in this queue's journal): the job
        runs once all of them succeeded, and is cancelled if one fails (docs/workflows.md).

        Raises :class:`EnvelopeError` (a ``ValueError``) or :class:`NotSerializable` (a
        ``TypeError``) for input a worker could not run.
        """
        check_options(args, kwargs, idempotency_key, description, meta, retry)
        if job_id is not None and self.remote is not None:
            raise EnvelopeError(
                "a remote queue cannot take job_id=: the node makes the id (pass idempotency_key=)"
            )
        now = time.time()
        job = refuse_step_id(validate_job_id(job_id)) if job_id is not None else new_job_id(now)
        path = task_path(func)
        call_args, call_kwargs, tags = tag_call(
            path, args if type(args) is tuple else tuple(args), dict(kwargs) if kwargs else {}
        )
        env = Envelope(  # positionally: keywords cost ~0.3 us per job here
            job,
            path,
            self.name,
            idempotency_key if idempotency_key is not None else job,
            now,
            call_args,
            call_kwargs,
            self.default_timeout if job_timeout is None else _seconds("job_timeout", job_timeout),
            self.default_result_ttl if result_ttl is None else _seconds("result_ttl", result_ttl),
            None if delay is None and run_at is None else _run_at(now, delay, run_at),
            retry if retry is not None else self.default_retry,
            description,
            dict(meta) if meta else {},
        )
        if tags:
            env.tags = tags
        # Fresh: the id (and key) made here, or ``_fresh_key`` from an entry point that mints a
        # unique one per job; the caller's own keys stay in the main chain (docs/journal.md).
        env._fresh_key = _fresh_key or (job_id is None and idempotency_key is None)
        if type(priority) is not int or priority:  # 0 is the default; "", None, False, 0.0 are not
            env.priority = check_priority(priority)
        if limit_key is not None:
            env.limit_key = check_limit_key(limit_key)
        carrier = enqueue_carrier(job, path, self.name)  # None, at a look-up's cost, untraced
        if carrier is not None:
            env.trace = carrier
        env.to_bytes(keys_checked=True)  # raises NotSerializable now, not in enqueue_many
        if depends_on is not None:
            if self.remote is not None:
                raise EnvelopeError("depends_on needs a queue on a journal (it works within one journal)")
            if env.run_at is not None:
                raise EnvelopeError("depends_on cannot be combined with delay or run_at")
            return with_deps(env, dependency_ids(depends_on, self.journal))
        return env

    def fetch_job(self, job_id: str) -> Job | None:
        """The job with id ``job_id`` in this queue's journal; ``None`` if it holds none.

        See :func:`hybridq.fetch_job` (any queue of the journal: the id names one job). A remote
        queue asks the node that holds it.
        """
        if self.remote is not None:
            return self.remote.fetch(job_id)
        return fetch_job(job_id, self.journal)
