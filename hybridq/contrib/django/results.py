"""A job, read back by id, as the framework's ``TaskResult``.

The status, the attempt, the times and the return value come from hybridq's own files (the
forwarder's lookup index, the completion ledger: :func:`hybridq.fetch_job`), never from Redis,
so ``get_result`` answers while Redis is down or after it was wiped. A job still in the outbox
(committed, not yet relayed into the journal) is read from the outbox table: ``READY``.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as dt
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, transaction

from hybridq.contrib.django.compat import (
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    set_field,
)
from hybridq.contrib.django.config import KEY_PREFIX, RUN_PATH
from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, JournalError, NotAllowed, ResultNotKept
from hybridq.job import Job, fetch_job
from hybridq.outbox.schema import first_line

if TYPE_CHECKING:
    from hybridq.contrib.django.backend import HybridqBackend

__all__ = ["STATUS_OF", "pending_result", "read_result"]

#: hybridq's job statuses (``Job.status``) as the framework's; any other (``failed``,
#: ``merged``, ``cancelled``, ...) is FAILED: the job ended without succeeding.
STATUS_OF = {
    "queued": TaskResultStatus.READY,
    "scheduled": TaskResultStatus.READY,
    "forwarded": TaskResultStatus.READY,
    "retrying": TaskResultStatus.READY,
    "started": TaskResultStatus.RUNNING,
    "finished": TaskResultStatus.SUCCESSFUL,
}
#: What a worker id is said to be: hybridq's ledger keeps a job's attempts, not who ran them.
WORKER_ID = "hybridq"


def pending_result(
    task: Task, job_id: str, args: Any, kwargs: Any, alias: str, *, enqueued_at: dt.datetime | None
) -> TaskResult:
    """A READY result: what ``enqueue`` returns, and a job not yet in the journal."""
    return TaskResult(
        task=task,
        id=job_id,
        status=TaskResultStatus.READY,
        enqueued_at=enqueued_at,
        started_at=None,
        last_attempted_at=None,
        finished_at=None,
        args=list(args),
        kwargs=dict(kwargs),
        backend=alias,
        errors=[],
        worker_ids=[],
    )


#: What finds a job's Task: :func:`hybridq.contrib.django.backend.resolve_task`, the worker's
#: own check (passed in: it needs the backend's class, a layer above this module).
Resolver = Callable[[object, object], Task]


def read_result(backend: HybridqBackend, result_id: str, resolve: Resolver) -> TaskResult:
    """The result of job ``result_id``, from the journal's lookup and ledger, else from the outbox."""
    if not isinstance(result_id, str) or not result_id:
        raise TaskResultDoesNotExist(result_id)
    job = _in_journal(backend, result_id)
    if job is None:
        env = _in_outbox(backend, result_id)
        if env is not None:
            task, args, kwargs = _call_of(env, resolve)
            return pending_result(
                task, env.id, args, kwargs, backend.alias, enqueued_at=_time(env.created_at)
            )
        # Relayed between the two looks? The relay appends to the journal before it deletes the
        # row, so a row gone means the job is in the journal now: look there once more.
        job = _in_journal(backend, result_id)
        if job is None:
            raise TaskResultDoesNotExist(result_id)
    task, args, kwargs = _call_of(job.envelope, resolve)
    return _from_job(job, task, args, kwargs, backend.alias)


def _in_journal(backend: HybridqBackend, job_id: str) -> Job | None:
    """The job in the journal, if a journal is configured and made yet.

    A host that only writes to the outbox may have none; nor is there one before the first
    direct enqueue or the forwarder's start: then only the outbox can hold the job. A journal
    this process cannot read is ImproperlyConfigured, in one line.
    """
    path = backend.config.journal or os.environ.get("HYBRIDQ_JOURNAL")
    if not path or not os.path.isdir(path):
        return None
    try:
        return fetch_job(job_id, path)
    except (JournalError, OSError) as exc:
        raise ImproperlyConfigured(
            f"hybridq backend {backend.alias!r}: cannot read the journal {path!r}: {first_line(exc)}"
        ) from None


def _from_job(job: Job, task: Task, args: Any, kwargs: Any, alias: str) -> TaskResult:
    status = job.status
    state = STATUS_OF.get(status, TaskResultStatus.FAILED)
    result = pending_result(task, job.id, args, kwargs, alias, enqueued_at=_time(job.enqueued_at))
    started = _time(job.started_at)
    set_field(result, "status", state)
    set_field(result, "started_at", started)
    set_field(result, "last_attempted_at", started)
    set_field(result, "worker_ids", [WORKER_ID] * job.attempt)
    if state in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED):
        set_field(result, "finished_at", _time(job.ended_at))
    if state == TaskResultStatus.SUCCESSFUL:
        # Too large to keep: the job succeeded, its value is not held (docs/django.md).
        with contextlib.suppress(ResultNotKept):
            set_field(result, "_return_value", job.result)
    elif state == TaskResultStatus.FAILED:
        error = job.exc_info or status  # the worker's traceback, else what ended it (merged, cancelled)
        result.errors.append(TaskError(exception_class_path=_exception_path(error), traceback=error))
    return result


def _call_of(env: Envelope, resolve: Resolver) -> tuple[Task, list[Any], dict[str, Any]]:
    """The Task, args and kwargs a job of this backend carries (TaskResultDoesNotExist for others).

    A job of this backend names :data:`RUN_PATH` and has a ``django:<path>:<id>`` key; its Task
    is found as the worker finds it (nothing a worker would refuse is imported here either).
    """
    key_path, _, key_id = env.idempotency_key.removeprefix(KEY_PREFIX).rpartition(":")
    if env.func != RUN_PATH or not env.idempotency_key.startswith(KEY_PREFIX) or key_id != env.id:
        raise TaskResultDoesNotExist(env.id)
    path: Any = key_path
    args: Any = []
    kwargs: Any = {}
    alias: Any = None
    if env.args:  # a compacted job's arguments are gone; its key stays
        if len(env.args) != 3:
            raise TaskResultDoesNotExist(env.id)
        path, args, kwargs = env.args
        alias = env.kwargs.get("backend")
    if path != key_path or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise TaskResultDoesNotExist(env.id)
    try:
        task = resolve(path, alias)
    except (NotAllowed, ImportError):
        raise TaskResultDoesNotExist(env.id) from None
    return task, args, kwargs


def _in_outbox(backend: HybridqBackend, job_id: str) -> Envelope | None:
    """The envelope of a committed job the relay has not moved yet (visible to this connection).

    In a transaction, the read runs in a savepoint: on PostgreSQL a failed statement (no outbox
    table) would otherwise abort the caller's transaction. A missing table is
    ImproperlyConfigured (one line); the database's other errors are the caller's, as they come.
    """
    table, alias = backend.config.outbox_table, backend.config.database
    conn = connections[alias]
    guard = contextlib.nullcontext() if conn.get_autocommit() else transaction.atomic(using=alias)
    try:
        with guard, conn.cursor() as cursor:
            cursor.execute(f"SELECT envelope FROM {table} WHERE job_id = %s", [job_id])  # noqa: S608 - a checked name
            row = cursor.fetchone()
    except DatabaseError:
        if table in conn.introspection.table_names():
            raise
        raise ImproperlyConfigured(
            f"hybridq backend {backend.alias!r}: database {alias!r} has no outbox table {table!r} "
            "(manage.py hybridq_outbox_init creates it)"
        ) from None
    if row is None or not isinstance(row[0], bytes | memoryview):
        return None
    try:
        return Envelope.from_bytes(bytes(row[0]))
    except EnvelopeError:
        return None


def _time(unix: float | None) -> dt.datetime | None:
    """A Unix time as Django's datetimes are: aware (UTC) with ``USE_TZ``, naive local without."""
    if unix is None:
        return None
    if settings.USE_TZ:
        return dt.datetime.fromtimestamp(unix, tz=dt.UTC)
    return dt.datetime.fromtimestamp(unix)  # noqa: DTZ006 - Django's naive local time


def _exception_path(error: str) -> str:
    """``module.Class`` of the exception a traceback ends with (a builtin's: ``builtins.``).

    hybridq keeps the worker's formatted traceback, not the exception's type, so the type is read
    from it: the first line at the margin after the last ``Traceback`` header (the message may
    run over several lines, and notes follow it). Anything else: ``builtins.Exception``.
    """
    lines = error.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    after = lines[headers[-1] + 1 :] if headers else lines[-1:]
    first = next((line for line in after if line.strip() and not line[0].isspace()), "")
    name = first.split(":", 1)[0].strip()
    if not name or not all(part.isidentifier() for part in name.split(".")):
        return "builtins.Exception"
    if "." not in name:
        return f"builtins.{name}" if isinstance(getattr(builtins, name, None), type) else "builtins.Exception"
    return name
