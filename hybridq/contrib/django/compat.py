"""The tasks framework this process has: Django 6's ``django.tasks``, else the ``django-tasks`` backport.

Both have the same API (the backport is the code that became ``django.tasks``); only the module
and two exception names differ. Everything else in :mod:`hybridq.contrib.django` imports the
framework from here, so the backend works on Django 6 (Python >= 3.12) and on Django 5.2 with
``django-tasks`` (Python 3.11) alike. ``django.tasks`` wins when both are importable: on
Django 6 that is the framework ``@task`` declares tasks with.
"""

from __future__ import annotations

from typing import Any

from hybridq.extras import require

#: What needs the ``django`` extra, as its one-line error says.
FEATURE = "hybridq.contrib.django (the django.tasks backend)"

try:  # Django >= 6.0
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, signals, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.utils.json import normalize_json

    FRAMEWORK = "django.tasks"
except ImportError:  # Django 5.2 with the django-tasks backport
    require("django", FEATURE, "django", "django_tasks")  # which one is missing, in one line
    from django_tasks import TaskContext, TaskResult, TaskResultStatus, signals, task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskError
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.utils import normalize_json

    FRAMEWORK = "django_tasks"

__all__ = [
    "FRAMEWORK",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "set_field",
    "signals",
    "task_backends",
]


def set_field(obj: Any, name: str, value: Any) -> None:
    """Set a field of the framework's frozen dataclasses, as its own backends do."""
    object.__setattr__(obj, name, value)
