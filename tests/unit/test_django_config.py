"""hybridq.contrib.django's settings: OPTIONS checked at start, the outbox DSN of a DATABASES entry."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("django")
from django.core.exceptions import ImproperlyConfigured
from hybridq.contrib.django.config import outbox_dsn, parse_options


def test_options_have_defaults() -> None:
    options = parse_options({})
    assert (options.journal, options.redis_url, options.allow) == (None, None, ())
    assert (options.database, options.outbox_table, options.always_outbox) == (
        "default",
        "hybridq_outbox",
        False,
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"jornal": "/x"}, "unknown OPTIONS 'jornal'"),
        ({"allow": "shop.tasks"}, "must be a list of module prefixes"),
        ({"allow": ["shop", 3]}, "must be a list of module prefixes"),
        ({"outbox_table": "x; DROP TABLE y"}, "outbox_table"),
        ({"journal": ""}, "must be a non-empty string"),
    ],
)
def test_bad_options_are_one_line(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message) as caught:
        parse_options(raw)
    assert "\n" not in str(caught.value)


def test_outbox_dsn_of_each_database(tmp_path: Path) -> None:
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": tmp_path / "app.db"}
    assert outbox_dsn(sqlite) == f"sqlite:///{tmp_path / 'app.db'}"
    pg = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app", "PASSWORD": "p@ss/w"}
    assert (
        outbox_dsn({**pg, "HOST": "db.internal", "PORT": "5433"})
        == "postgresql://app:p%40ss%2Fw@db.internal:5433/shop"
    )
    assert outbox_dsn({**pg, "HOST": "/run/pg", "PASSWORD": ""}) == "postgresql://app@/shop?host=/run/pg"
    assert outbox_dsn({"ENGINE": "django.db.backends.postgresql", "NAME": "shop"}) == "postgresql:///shop"


@pytest.mark.parametrize(
    "database",
    [
        {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
        {"ENGINE": "django.db.backends.mysql", "NAME": "shop"},
    ],
)
def test_outbox_dsn_refuses_what_the_outbox_cannot_read(database: dict[str, str]) -> None:
    with pytest.raises(ImproperlyConfigured):
        outbox_dsn(database)


CHECK = """
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["hybridq.contrib.django"],
    DATABASES={"default": {"ENGINE": "django.db.backends.mysql", "NAME": "shop"}},
    TASKS={
        "default": {"BACKEND": "hybridq.contrib.django.HybridqBackend", "OPTIONS": {}},
        "other": {"BACKEND": "hybridq.contrib.django.HybridqBackend", "OPTIONS": {"database": "nope"}},
    },
)
django.setup()
try:
    from django.tasks import task_backends
except ImportError:
    from django_tasks import task_backends
for alias in ("default", "other"):
    print(*[message.id for message in task_backends[alias].check()])
"""


def test_system_checks_name_a_database_the_outbox_cannot_use(subprocess_env: dict[str, str]) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", CHECK],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["hybridq_django.E002", "hybridq_django.E001"]
