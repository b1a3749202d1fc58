"""The worker side: :func:`run_task`, the function every job of the Django backend names.

A job carries the task's path (``myapp.tasks.send_receipt``), its arguments, its keyword
arguments and the ``TASKS`` alias it was enqueued on. The worker runs :func:`run_task`, which
sets Django up in the worker's process if it is not yet (``$DJANGO_SETTINGS_MODULE``;
``manage.py hybridq_worker`` has done it before the pool forks), finds the framework's
``Task`` at that path and calls it, with the database connections checked before and closed
after, as Django does around a request.

What may run (:func:`hybridq.contrib.django.backend.resolve_task`, which ``get_result`` uses
too): only an object the framework's ``@task`` made (a ``Task``), enqueued on a
:class:`~hybridq.contrib.django.HybridqBackend`, in a module under the backends' ``allow``
prefixes (default: the project's own apps). The path is checked *before* anything is
imported: a job naming anything else fails for good and imports nothing (docs/security.md).
The worker itself must allow this module (``--allow hybridq.contrib.django.run``;
``manage.py hybridq_worker`` passes it).
"""

from __future__ import annotations

import os
from typing import Any

from hybridq.context import current_job

__all__ = ["run_task"]


def run_task(task_path: str, args: Any, kwargs: Any, backend: str | None = None) -> Any:
    """Run the ``@task`` at ``task_path`` with ``args`` and ``kwargs``; its JSON-normalised value.

    ``backend`` is the ``TASKS`` alias the job was enqueued on (``task.using(backend=...)``):
    that one must be a hybridq backend, not the one the task was declared with. A job without it
    (enqueued before the alias was carried) is checked against the declared one.
    """
    _setup_django()
    from django.db import close_old_connections  # noqa: PLC0415 - after setup

    from hybridq.contrib.django.backend import resolve_task  # noqa: PLC0415 - after setup
    from hybridq.contrib.django.compat import normalize_json  # noqa: PLC0415 - after setup
    from hybridq.contrib.django.lifecycle import Run  # noqa: PLC0415 - after setup

    task = resolve_task(task_path, backend)
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
