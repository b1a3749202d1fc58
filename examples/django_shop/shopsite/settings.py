"""The example shop's settings: SQLite, and hybridq as the tasks backend (docs/django.md).

``SHOP_DIR`` holds the database and the journal (run.py sets it; default ``./var``);
``HYBRIDQ_REDIS_URL`` names the Redis (run.py starts a private one).
"""

import os
from pathlib import Path

DIR = Path(os.environ.get("SHOP_DIR", Path(__file__).resolve().parent.parent / "var"))
SECRET_KEY = "example-only"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
ROOT_URLCONF = "shopsite.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "hybridq.contrib.django", "orders"]
try:  # Django 5.2: the django-tasks backport is an app; Django 6 has django.tasks built in
    import django_tasks  # noqa: F401

    INSTALLED_APPS.append("django_tasks")
except ImportError:
    pass
MIDDLEWARE = ["django.middleware.common.CommonMiddleware"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": DIR / "shop.db"}}

TASKS = {
    "default": {
        "BACKEND": "hybridq.contrib.django.HybridqBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {
            "journal": str(DIR / "journal"),
            "redis_url": os.environ.get("HYBRIDQ_REDIS_URL", "redis://127.0.0.1:6379/0"),
            "allow": ["orders.tasks"],
        },
    }
}
