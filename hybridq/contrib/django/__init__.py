"""``hybridq.contrib.django``: a ``django.tasks`` backend over hybridq (the ``django`` extra).

For Django 6's ``django.tasks`` and the ``django-tasks`` backport (Django 5.2)::

    INSTALLED_APPS = [..., "hybridq.contrib.django"]          # the manage.py commands
    TASKS = {
        "default": {
            "BACKEND": "hybridq.contrib.django.HybridqBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"journal": "/var/lib/hybridq/journal", "redis_url": "redis://..."},
        }
    }

Inside ``transaction.atomic()`` an ``enqueue`` goes through the transactional outbox on the
same database connection; outside, straight into the journal. docs/django.md says all of it.
The backend is imported on first use, so listing the app costs Django's start nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridq.extras import require

if TYPE_CHECKING:
    from hybridq.contrib.django.backend import HybridqBackend

__all__ = ["HybridqBackend"]


def __getattr__(name: str) -> Any:
    if name == "HybridqBackend":
        require("django", "hybridq.contrib.django", "django")  # one line naming the extra, not an ImportError
        from hybridq.contrib.django.backend import HybridqBackend  # noqa: PLC0415 - lazily

        return HybridqBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
