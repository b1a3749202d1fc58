"""``HybridqBackend``: the ``django.tasks`` backend that enqueues into hybridq.

``task.enqueue(...)`` inside ``transaction.atomic()`` on the backend's database inserts the job
into hybridq's transactional outbox **on that very connection** (docs/outbox.md): a rollback
leaves no job, a commit never loses one, and no ``on_commit`` hook is involved (a process that
dies between its commit and its hook loses the job; one that dies after a commit here does not:
the row is committed with the order, and the relay moves it into the journal). Outside a
transaction (autocommit) the job is appended to the journal directly, fsync'd before
``enqueue`` returns (docs/enqueue.md), unless ``always_outbox`` is set.

Every job runs :func:`hybridq.contrib.django.run.run_task` with the task's path, its arguments
and its keyword arguments; the worker resolves the path to the framework's ``Task`` and calls it.
``get_result`` reads the job back by id (:mod:`hybridq.contrib.django.results`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db import connections
from django.utils import timezone

from hybridq.contrib.django.compat import BaseTaskBackend, InvalidTask, Task, TaskResult, signals
from hybridq.contrib.django.config import Options, parse_options
from hybridq.contrib.django.results import pending_result, read_result
from hybridq.envelope.model import new_job_id, validate_queue_name
from hybridq.errors import EnvelopeError, NotSerializable
from hybridq.outbox import Outbox
from hybridq.producer.queue import Queue

__all__ = ["RUN_PATH", "HybridqBackend"]

#: The function every job of this backend names: the worker-side entry point.
RUN_PATH = "hybridq.contrib.django.run.run_task"
#: The meta key holding the task's priority (hybridq's envelope has no priority of its own).
PRIORITY_META = "django_priority"


class HybridqBackend(BaseTaskBackend):
    """A ``TASKS`` backend: ``{"BACKEND": "hybridq.contrib.django.HybridqBackend", ...}``.

    ``QUEUES`` lists the queue names tasks may use (hybridq queue names); ``OPTIONS`` are read by
    :func:`hybridq.contrib.django.config.parse_options`.
    """

    supports_defer = True  # run_after: the envelope's run_at, held by the forwarder
    supports_async_task = True  # async def tasks run through the framework's Task.call
    supports_get_result = True  # from the journal and the ledger, in any process of the host
    # Accepted and stored in the job's meta; hybridq runs a queue in order, not by priority
    # (docs/django.md, "The task's options"): give urgent tasks their own queue instead.
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.config: Options = parse_options(self.options)
        self.outbox = Outbox(self.config.outbox_table)
        self._queues: dict[str, Queue] = {}

    def validate_task(self, task: Task) -> None:
        """The framework's checks, then hybridq's rule for queue names (one line, nothing written)."""
        super().validate_task(task)
        try:
            validate_queue_name(task.queue_name)  # no Queue yet: that would make the journal directory
        except EnvelopeError as exc:
            raise InvalidTask(f"Queue {task.queue_name!r} is not a valid hybridq queue name: {exc}") from None

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = Queue(name, journal=self.config.journal)
        return queue

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Enqueue ``task(*args, **kwargs)``: in the open transaction's outbox, else in the journal."""
        self.validate_task(task)
        job_id = new_job_id()
        options: dict[str, Any] = {
            "job_id": job_id,
            # The task's path rides in the key too: it outlives the arguments once the job's
            # journal segment is compacted, so get_result still finds the Task then.
            "idempotency_key": f"django:{task.module_path}:{job_id}",
            "description": task.module_path,
            "meta": {PRIORITY_META: task.priority},
        }
        if task.run_after is not None:
            options["run_at"] = _timestamp(task.run_after)
        # The result first: the framework normalises the arguments (tuples to lists, ...) and
        # refuses what it cannot, before anything is written; the job carries what it shows.
        result = pending_result(task, job_id, args, kwargs, self.alias, enqueued_at=timezone.now())
        call = (task.module_path, result.args, result.kwargs)
        conn = connections[self.config.database]
        try:
            if _in_transaction(conn) or self.config.always_outbox:
                conn.ensure_connection()
                self.outbox.enqueue(conn.connection, RUN_PATH, *call, queue=task.queue_name, **options)
            else:
                self._queue(task.queue_name).enqueue_call(RUN_PATH, call, None, **options)
        except NotSerializable as exc:  # name the task, not the entry point every job shares
            raise NotSerializable(
                str(exc).replace(f"job {RUN_PATH}", f"task {task.module_path}", 1)
            ) from None
        signals.task_enqueued.send(type(self), task_result=result)
        return result

    def check(self, **kwargs: Any) -> list[Any]:
        """Django's system checks (``manage.py check``, every command's start): the database."""
        from django.conf import settings  # noqa: PLC0415
        from django.core import checks  # noqa: PLC0415

        found = list(super().check(**kwargs))
        database = settings.DATABASES.get(self.config.database)
        if database is None:
            found.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]: OPTIONS['database'] names {self.config.database!r}, "
                    "which DATABASES lacks",
                    id="hybridq_django.E001",
                )
            )
        elif not str(database.get("ENGINE", "")).endswith(("sqlite3", "postgresql")):
            found.append(
                checks.Error(
                    f"TASKS[{self.alias!r}]: the outbox supports SQLite and PostgreSQL, not "
                    f"{database.get('ENGINE')!r}",
                    id="hybridq_django.E002",
                )
            )
        return found

    def get_result(self, result_id: str) -> TaskResult:
        """The job's ``TaskResult`` (TaskResultDoesNotExist if no job has this id)."""
        return read_result(self, result_id)


def _in_transaction(conn: Any) -> bool:
    """Whether ``conn`` has a transaction open: ``atomic()``, or autocommit turned off by hand."""
    # No connection open: no transaction either (get_autocommit() would connect to ask).
    return bool(conn.in_atomic_block) or (conn.connection is not None and not conn.autocommit)


def _timestamp(when: dt.datetime) -> float:
    """Unix time of ``run_after`` (a naive one is in the current time zone, as Django's are)."""
    if timezone.is_naive(when):
        when = timezone.make_aware(when)
    return when.timestamp()
