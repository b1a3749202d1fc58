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
import importlib
import os
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.utils import timezone

from hybridq.contrib.django.compat import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskResult,
    signals,
    task_backends,
)
from hybridq.contrib.django.config import (
    KEY_PREFIX,
    RUN_PATH,
    Options,
    check_task_path,
    parse_options,
    queues_of,
)
from hybridq.contrib.django.results import pending_result, read_result
from hybridq.envelope.model import new_job_id, validate_queue_name
from hybridq.errors import EnvelopeError, NotAllowed, NotSerializable
from hybridq.outbox import Outbox
from hybridq.producer.queue import Queue

__all__ = ["RUN_PATH", "HybridqBackend", "resolve_task"]

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
        queues_of(params)  # QUEUES=[] is refused: the framework would take any queue, no worker would
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
            queue = self._queues[name] = Queue(name, journal=self._journal())
        return queue

    def _journal(self) -> str:
        """The journal directory, which must exist: ImproperlyConfigured (one line) otherwise.

        A missing one is not made: a host without the journal (a web host, or a worker host
        whose task enqueues a sub-task) would write jobs into a journal of its own that no
        forwarder reads (docs/django.md, "Where the journal is").
        """
        path = self.config.journal or os.environ.get("HYBRIDQ_JOURNAL")
        setting = f"TASKS[{self.alias!r}]['OPTIONS']['journal']"
        if not path:
            raise ImproperlyConfigured(f"hybridq backend: {setting} (or $HYBRIDQ_JOURNAL) is not set")
        if not os.path.isdir(path):
            raise ImproperlyConfigured(
                f"hybridq backend: the journal directory {path!r} ({setting}) does not exist; "
                "start manage.py hybridq_forward on this host first (it makes it), or set "
                "OPTIONS['always_outbox'] on a host without the journal"
            )
        return path

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Enqueue ``task(*args, **kwargs)``: in the open transaction's outbox, else in the journal."""
        self.validate_task(task)
        job_id = new_job_id()
        options: dict[str, Any] = {
            "job_id": job_id,
            # The task's path rides in the key too: it outlives the arguments once the job's
            # journal segment is compacted, so get_result still finds the Task then.
            "idempotency_key": f"{KEY_PREFIX}{task.module_path}:{job_id}",
            "description": task.module_path,
            "meta": {PRIORITY_META: task.priority},
        }
        if task.run_after is not None:
            options["run_at"] = _timestamp(task.run_after)
        # The result first: the framework normalises the arguments (tuples to lists, ...) and
        # refuses what it cannot, before anything is written; the job carries what it shows.
        result = pending_result(task, job_id, args, kwargs, self.alias, enqueued_at=timezone.now())
        call = (task.module_path, result.args, result.kwargs)
        # The alias it is enqueued on (task.using(backend=...)): the worker checks that one.
        run_kwargs = {"backend": self.alias}
        conn = connections[self.config.database]
        try:
            if _in_transaction(conn) or self.config.always_outbox:
                conn.ensure_connection()
                self.outbox.enqueue(
                    conn.connection, RUN_PATH, *call, queue=task.queue_name, **run_kwargs, **options
                )
            else:
                # Its id and key were minted above, per job: a run_after job may take the
                # delayed chain (docs/django.md). Not through the outbox: its rows keep options only.
                queue = self._queue(task.queue_name)
                queue.enqueue_call(RUN_PATH, call, run_kwargs, _fresh_key=True, **options)
        except NotSerializable as exc:  # name the task, not the entry point every job shares
            raise NotSerializable(
                str(exc).replace(f"job {RUN_PATH}", f"task {task.module_path}", 1)
            ) from None
        signals.task_enqueued.send(type(self), task_result=result)
        return result

    def check(self, **kwargs: Any) -> list[Any]:
        """Django's system checks (``manage.py check``, every command's start): the database.

        E001: ``database`` names no ``DATABASES`` entry; E002: its vendor is not SQLite or
        PostgreSQL (GeoDjango's engines count as theirs); E003: PostgreSQL through psycopg2,
        whose connection the outbox cannot write on (it needs psycopg 3).
        """
        from django.core import checks  # noqa: PLC0415

        found = list(super().check(**kwargs))
        name = self.config.database
        where = f"TASKS[{self.alias!r}]: OPTIONS['database'] {name!r}"
        if name not in settings.DATABASES:
            return [*found, checks.Error(f"{where} is not in DATABASES", id="hybridq_django.E001")]
        try:
            vendor = connections[name].vendor
        except (ImproperlyConfigured, ImportError) as exc:  # an engine Django cannot load
            vendor = str(exc).splitlines()[0]
        if vendor not in ("sqlite", "postgresql"):
            message = f"{where}: the outbox supports SQLite and PostgreSQL, not {vendor!r}"
            found.append(checks.Error(message, id="hybridq_django.E002"))
        elif vendor == "postgresql" and not _psycopg3():
            message = f"{where}: the outbox needs psycopg 3 (pip install 'psycopg[binary]'), not psycopg2"
            found.append(checks.Error(message, id="hybridq_django.E003"))
        return found

    def get_result(self, result_id: str) -> TaskResult:
        """The job's ``TaskResult`` (TaskResultDoesNotExist if no job has this id)."""
        return read_result(self, result_id, resolve_task)


def _in_transaction(conn: Any) -> bool:
    """Whether ``conn`` has a transaction open: ``atomic()``, or autocommit turned off.

    Autocommit is off by hand (``set_autocommit(False)``), or for every connection of a database
    whose ``DATABASES`` entry says ``"AUTOCOMMIT": False``: then a connection not open yet opens
    in a transaction, and the job must wait for its commit too (get_autocommit() would connect).
    """
    if conn.in_atomic_block:
        return True
    if conn.connection is None:
        return conn.settings_dict.get("AUTOCOMMIT", True) is False
    return not conn.autocommit


def _psycopg3() -> bool:
    """Whether Django's PostgreSQL backend runs on psycopg 3 (it takes psycopg2 when 3 is missing)."""
    from django.db.backends.postgresql.psycopg_any import is_psycopg3  # noqa: PLC0415

    return bool(is_psycopg3)


def _timestamp(when: dt.datetime) -> float:
    """Unix time of ``run_after`` (a naive one is in the current time zone, as Django's are)."""
    if timezone.is_naive(when):
        when = timezone.make_aware(when)
    return when.timestamp()


def resolve_task(path: object, alias: object = None) -> Task:
    """The ``Task`` at ``path``, as enqueued on backend ``alias``; NotAllowed (one line) otherwise.

    The worker runs what this returns and ``get_result`` names it, so both check alike: the
    path first, before anything is imported (:func:`~hybridq.contrib.django.config.check_task_path`),
    then that the object there is the framework's ``Task`` at exactly that path, and that the
    backend the job was enqueued on (default: the one the task was declared with) is a hybridq
    backend of this project's ``TASKS``.
    """
    module = check_task_path(path)
    found = getattr(importlib.import_module(module), str(path).rpartition(".")[2], None)
    if not isinstance(found, Task) or found.module_path != path:
        raise NotAllowed(f"{path!r} is not a task made with @task")
    alias = found.backend if alias is None else alias
    if not isinstance(alias, str) or alias not in getattr(settings, "TASKS", {}):
        raise NotAllowed(f"task {path!r} names backend {alias!r}, which TASKS lacks")
    if not isinstance(task_backends[alias], HybridqBackend):
        raise NotAllowed(f"task {path!r} belongs to backend {alias!r}, which is not hybridq's")
    if alias == found.backend:
        return found
    try:
        return found.using(backend=alias)
    except (InvalidTask, ImproperlyConfigured) as exc:
        raise NotAllowed(f"task {path!r} on backend {alias!r}: {exc}") from None
