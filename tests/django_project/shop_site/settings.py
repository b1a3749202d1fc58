"""A small shop that uses only the tasks framework's public API, with hybridq's backend.

Everything machine-specific comes from the environment the test sets: ``SHOP_DB`` (an SQLite
file path, or a ``postgresql://`` DSN of the test's private PostgreSQL), ``HYBRIDQ_JOURNAL``,
``HYBRIDQ_REDIS_URL`` and ``SHOP_EFFECTS`` (the file the tasks log their effects in).
"""

import os
from urllib.parse import parse_qs, urlsplit

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "hybridq.contrib.django", "shop"]
try:  # the django-tasks backport (Django 5.2) is an app; Django 6's django.tasks is built in
    import django_tasks  # noqa: F401

    INSTALLED_APPS.append("django_tasks")
except ImportError:
    pass


def _database(spec: str) -> dict:
    if not spec.startswith("postgresql://"):
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": spec}
    url = urlsplit(spec)
    query = parse_qs(url.query)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": url.path.lstrip("/"),
        "USER": url.username or "",
        "HOST": query.get("host", [url.hostname or ""])[0],
    }


DATABASES = {"default": _database(os.environ["SHOP_DB"])}
TASKS = {
    "default": {
        "BACKEND": "hybridq.contrib.django.HybridqBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {
            "journal": os.environ["HYBRIDQ_JOURNAL"],
            "redis_url": os.environ.get("HYBRIDQ_REDIS_URL", "redis://127.0.0.1:6379/0"),
            "allow": ["shop.tasks"],
        },
    }
}
LOGGING = {"version": 1, "disable_existing_loggers": False}
