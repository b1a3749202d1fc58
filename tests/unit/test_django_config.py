"""hybridq.contrib.django's settings: OPTIONS checked at start, the outbox DSN of a DATABASES entry."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("django")
from django.core.exceptions import ImproperlyConfigured
from hybridq.contrib.django.config import outbox_dsn, parse_options, queues_of


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
    assert outbox_dsn(sqlite, "sqlite") == f"sqlite:///{tmp_path / 'app.db'}"
    spatialite = {**sqlite, "ENGINE": "django.contrib.gis.db.backends.spatialite"}
    assert outbox_dsn(spatialite, "sqlite") == f"sqlite:///{tmp_path / 'app.db'}"  # by vendor
    pg = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app", "PASSWORD": "p@ss/w"}
    assert (
        outbox_dsn({**pg, "HOST": "db.internal", "PORT": "5433"}, "postgresql")
        == "postgresql://app:p%40ss%2Fw@db.internal:5433/shop"
    )
    assert (
        outbox_dsn({**pg, "HOST": "/run/pg", "PASSWORD": ""}, "postgresql")
        == "postgresql://app@/shop?host=/run/pg"
    )
    assert outbox_dsn({"ENGINE": "django.db.backends.postgresql", "NAME": "shop"}, "postgresql") == (
        "postgresql:///shop"
    )


def test_outbox_dsn_keeps_the_port_without_a_host_and_the_libpq_options() -> None:
    """HOST "" is libpq's default socket, on PORT; OPTIONS' libpq keys ride along, Django's do not."""
    pg = {"ENGINE": "django.contrib.gis.db.backends.postgis", "NAME": "shop", "HOST": "", "PORT": 5433}
    assert outbox_dsn(pg, "postgresql") == "postgresql:///shop?port=5433"
    options = {"sslmode": "verify-full", "sslrootcert": "/etc/ca.pem", "isolation_level": 3, "pool": True}
    assert (
        outbox_dsn({**pg, "HOST": "db", "PORT": "", "OPTIONS": options}, "postgresql")
        == "postgresql://db/shop?sslmode=verify-full&sslrootcert=/etc/ca.pem"
    )


@pytest.mark.parametrize(
    ("database", "vendor"),
    [
        ({"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}, "sqlite"),
        ({"ENGINE": "django.db.backends.mysql", "NAME": "shop"}, "mysql"),
    ],
)
def test_outbox_dsn_refuses_what_the_outbox_cannot_read(database: dict[str, str], vendor: str) -> None:
    with pytest.raises(ImproperlyConfigured):
        outbox_dsn(database, vendor)


def test_always_outbox_is_a_bool_and_queues_not_empty() -> None:
    """``"false"`` is truthy: a string is refused, not read as True; ``QUEUES: []`` too."""
    with pytest.raises(ImproperlyConfigured, match="must be True or False"):
        parse_options({"always_outbox": "false"})
    with pytest.raises(ImproperlyConfigured, match="QUEUES must be a non-empty list"):
        queues_of({"QUEUES": []})
    assert queues_of({}) == ["default"]


CHECK = """
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["hybridq.contrib.django"],
    DATABASES={
        "default": {"ENGINE": "django.db.backends.mysql", "NAME": "shop"},
        "pg": {"ENGINE": "django.db.backends.postgresql", "NAME": "shop"},
    },
    TASKS={
        "default": {"BACKEND": "hybridq.contrib.django.HybridqBackend", "OPTIONS": {}},
        "other": {"BACKEND": "hybridq.contrib.django.HybridqBackend", "OPTIONS": {"database": "nope"}},
        "pg": {"BACKEND": "hybridq.contrib.django.HybridqBackend", "OPTIONS": {"database": "pg"}},
    },
)
django.setup()
from django.db import connections
from django.db.backends.postgresql import psycopg_any
connections["pg"].vendor  # its module loaded on psycopg 3, then:
psycopg_any.is_psycopg3 = False  # as where only psycopg2 is installed
try:
    from django.tasks import task_backends
except ImportError:
    from django_tasks import task_backends
for alias in ("default", "other", "pg"):
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
    assert done.stdout.split("\n")[:3] == [
        "hybridq_django.E002",
        "hybridq_django.E001",
        "hybridq_django.E003",
    ]


def test_the_exception_class_of_a_traceback() -> None:
    """The type line after the last Traceback header, whatever the message's lines and notes say."""
    from hybridq.contrib.django.results import _exception_path

    tb = 'Traceback (most recent call last):\n  File "t.py", line 1, in f\n    raise ValueError(m)\n'
    assert _exception_path(tb + "ValueError: first line\nsecond: line\nnote: x\n") == "builtins.ValueError"
    chained = tb + "KeyError: 'a'\n\nDuring handling of the above exception, another exception occurred:\n\n"
    assert _exception_path(chained + tb + "shop.errors.OutOfStock: no\n") == "shop.errors.OutOfStock"
    assert _exception_path("cancelled") == "builtins.Exception"
    assert _exception_path(tb + "not a type: at all\n") == "builtins.Exception"
