"""One run of a task in a worker, as the framework sees it: its ``TaskResult``, context and signals.

``task_started`` is sent before the task runs and ``task_finished`` after (SUCCESSFUL, or
FAILED with the exception, sent inside the handler as the framework's own backends do), with a
``TaskResult`` whose id is the job id and whose ``attempts`` is hybridq's attempt (a run a
crash cut short counts). A task declared with ``takes_context=True`` gets a ``TaskContext``
over the same result.
"""

from __future__ import annotations

import traceback
from types import TracebackType
from typing import Any, Self

from django.utils import timezone

from hybridq.context import CurrentJob
from hybridq.contrib.django.compat import (
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultStatus,
    set_field,
    signals,
)
from hybridq.contrib.django.results import WORKER_ID, pending_result

__all__ = ["Run"]


class Run:
    """``with Run(task, current_job(), args, kwargs) as run: task.call(*run.leading, *args, ...)``."""

    def __init__(self, task: Task, job: CurrentJob | None, args: list[Any], kwargs: dict[str, Any]) -> None:
        job_id = job.id if job is not None else ""
        self.result: TaskResult = pending_result(task, job_id, args, kwargs, task.backend, enqueued_at=None)
        attempt = job.attempt if job is not None else 1
        set_field(self.result, "worker_ids", [WORKER_ID] * max(1, attempt))
        #: What goes before the task's own arguments: its context, if it takes one.
        self.leading: tuple[Any, ...] = (TaskContext(task_result=self.result),) if task.takes_context else ()

    def __enter__(self) -> Self:
        from hybridq.contrib.django.backend import HybridqBackend  # noqa: PLC0415 - the sender

        self._sender = HybridqBackend
        now = timezone.now()
        set_field(self.result, "status", TaskResultStatus.RUNNING)
        set_field(self.result, "started_at", now)
        set_field(self.result, "last_attempted_at", now)
        signals.task_started.send(sender=self._sender, task_result=self.result)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        set_field(self.result, "finished_at", timezone.now())
        if error is None:
            set_field(self.result, "status", TaskResultStatus.SUCCESSFUL)
        else:
            set_field(self.result, "status", TaskResultStatus.FAILED)
            name = f"{type(error).__module__}.{type(error).__qualname__}"
            self.result.errors.append(
                TaskError(exception_class_path=name, traceback="".join(traceback.format_exception(error)))
            )
        signals.task_finished.send(sender=self._sender, task_result=self.result)
