"""The worker side: :func:`run_task`, the function every job of the Django backend names.

A job carries the task's path (``myapp.tasks.send_receipt``), its arguments and its keyword
arguments. The worker runs :func:`run_task`, which sets Django up in the worker's process if
it is not yet (``$DJANGO_SETTINGS_MODULE``; ``manage.py hybridq_worker`` has done it before the
pool forks), finds the framework's ``Task`` at that path and calls it, with the database
connections checked before and closed after, as Django does around a request.

What may run: only an object the framework's ``@task`` made (a ``Task``), whose backend is a
:class:`~hybridq.contrib.django.HybridqBackend`, in a module under the backend's ``allow``
prefixes (default: the project's ``INSTALLED_APPS`` outside ``django.``). The module is
checked against them *before* it is imported: a job naming anything else fails for good and
imports nothing (docs/security.md). The worker itself must allow this module
(``--allow hybridq.contrib.django.run``; ``manage.py hybridq_worker`` passes it).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from hybridq.context import current_job
from hybridq.contrib.django.config import allowed_prefixes, under
from hybridq.errors import NotAllowed

__all__ = ["run_task"]


def run_task(task_path: str, args: Any, kwargs: Any) -> Any:
    """Run the ``@task`` at ``task_path`` with ``args`` and ``kwargs``; its JSON-normalised value."""
    _setup_django()
    from django.db import close_old_connections  # noqa: PLC0415 - after setup

    from hybridq.contrib.django.compat import normalize_json  # noqa: PLC0415 - after setup
    from hybridq.contrib.django.lifecycle import Run  # noqa: PLC0415 - after setup

    task = _resolve(task_path)
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        kinds = f"{type(args).__name__} and {type(kwargs).__name__}"
        raise TypeError(f"a Django task's job carries its arguments in a list and a dict, not {kinds}")
    close_old_connections()
    try:
        with Run(task, current_job(), args, kwargs) as run:
            value = task.call(*run.leading, *args, **kwargs)
        return normalize_json(value)
    finally:
        close_old_connections()


def _setup_django() -> None:
    """``django.setup()`` once per process, if the worker was not started by manage.py."""
    from django.apps import apps  # noqa: PLC0415 - Django is the extra this module belongs to

    if apps.ready:
        return
    if not os.environ.get("DJANGO_SETTINGS_MODULE"):
        from django.conf import settings  # noqa: PLC0415

        if not settings.configured:
            raise RuntimeError(
                "a Django task needs Django's settings: run the worker with `manage.py hybridq_worker` "
                "or set DJANGO_SETTINGS_MODULE"
            )
    import django  # noqa: PLC0415

    django.setup()


def _resolve(path: str) -> Any:
    """The ``Task`` at ``path``, checked before anything is imported; NotAllowed otherwise."""
    from hybridq.contrib.django.backend import HybridqBackend  # noqa: PLC0415
    from hybridq.contrib.django.compat import Task, task_backends  # noqa: PLC0415 - after setup

    module, _, name = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    if not module or not name or name.startswith("_") or "__" in path:
        raise NotAllowed(f"{path!r} is not a Django task path")
    prefixes = allowed_prefixes()
    if not under(module, prefixes):
        raise NotAllowed(
            f"Django task {path!r} is not under an allowed prefix ({', '.join(prefixes) or 'none'}); "
            "add its module to the hybridq backend's OPTIONS['allow']"
        )
    found = getattr(importlib.import_module(module), name, None)
    if not isinstance(found, Task) or found.module_path != path:
        raise NotAllowed(f"{path!r} is not a task made with @task")
    if not isinstance(task_backends[found.backend], HybridqBackend):
        raise NotAllowed(f"task {path!r} belongs to backend {found.backend!r}, which is not hybridq's")
    return found
