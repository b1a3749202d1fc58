"""hybridq.contrib.django's edges, each in a small Django project of its own (SQLite, no Redis).

What a job must be for ``get_result`` to name it (the worker's own rule), where ``enqueue``
refuses to write (a journal directory that does not exist), which transactions it joins, and
the one-line errors of ``get_result`` when the outbox table or the journal cannot be read.
Each test runs one child process (Django's settings are per process): about 0.5 s each.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

pytest.importorskip("django")

TASKS_PY = """
try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

@task()
def add(a, b):
    return a + b

@task(backend="other")
def elsewhere(x):
    return x
"""

PRELUDE = """
import json, os, sys
import django
from django.conf import settings
OPTIONS = json.loads(os.environ["T_OPTIONS"])
settings.configure(
    BASE_DIR=os.environ["T_BASE"],
    USE_TZ=True,
    INSTALLED_APPS=["hybridq.contrib.django", "myapp", "vendored"] + (["django_tasks"] if os.environ["T_BACKPORT"] else []),
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["T_DB"],
                           **json.loads(os.environ["T_DATABASE"])}},
    TASKS={
        "default": {"BACKEND": "hybridq.contrib.django.HybridqBackend", "OPTIONS": OPTIONS},
        "other": {"BACKEND": os.environ["T_IMMEDIATE"]},
    },
)
django.setup()
from django.core.management import call_command
from django.db import connection, transaction
from hybridq.contrib.django.compat import task_backends
from hybridq.contrib.django.backend import RUN_PATH
from hybridq.job import fetch_job
from hybridq.producer.queue import Queue
from myapp.tasks import add, elsewhere
backend = task_backends["default"]
J = os.environ["T_JOURNAL"]

def error_of(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"

def emit(**out):
    print(json.dumps(out))

def ready():  # the journal directory and the outbox table, as a deployment makes them
    os.makedirs(J, mode=0o700)
    call_command("hybridq_outbox_init", verbosity=0)
"""


Project = Callable[..., dict[str, Any]]


@pytest.fixture
def project(tmp_path: Path, subprocess_env: dict[str, str]) -> Project:
    """``project(body, options=..., database=...)``: :func:`run` in this test's directory."""
    return functools.partial(run, tmp_path, subprocess_env)


def run(tmp_path: Path, env: dict[str, str], body: str, **config: Any) -> dict[str, Any]:
    """Run ``body`` after PRELUDE in a project under ``tmp_path``; its one JSON line."""
    app = tmp_path / "project" / "myapp"
    if not app.exists():
        app.mkdir(parents=True)
        (app / "__init__.py").write_text("")
        (app / "tasks.py").write_text(TASKS_PY)
        # Importing it leaves a mark: get_result must never import a module the worker refuses.
        (app / "__main__.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
        (app / "_private.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
        (tmp_path / "vendor" / "vendored").mkdir(parents=True)  # a third-party app: not under BASE_DIR
        (tmp_path / "vendor" / "vendored" / "__init__.py").write_text("")
    try:
        import django.tasks  # noqa: F401

        backport, immediate = "", "django.tasks.backends.immediate.ImmediateBackend"
    except ImportError:
        backport, immediate = "1", "django_tasks.backends.immediate.ImmediateBackend"
    journal = tmp_path / "journal"
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        env={
            **env,
            "PYTHONPATH": f"{tmp_path / 'project'}:{tmp_path / 'vendor'}:{env['PYTHONPATH']}",
            "T_BASE": str(tmp_path / "project"),
            "T_DB": str(tmp_path / "app.db"),
            "T_JOURNAL": str(journal),
            "T_OPTIONS": json.dumps({"journal": str(journal), **config.get("options", {})}),
            "T_DATABASE": json.dumps(config.get("database", {})),
            "T_BACKPORT": backport,
            "T_IMMEDIATE": immediate,
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_get_result_names_only_jobs_the_worker_would_run(project: Project, tmp_path: Path) -> None:
    """Another function's job shaped like ours, and paths the worker refuses: no job of ours."""
    out = project(
        """
        ready()
        q = Queue("default", journal=J)
        ids = {
            "other_function": q.enqueue_call("some.other.func", ("myapp.tasks.add", [1, 2], {})).id,
            "no_key": q.enqueue_call(RUN_PATH, ("myapp.tasks.add", [1, 2], {})).id,
            "dunder_module": q.enqueue_call(RUN_PATH, ("myapp.__main__.x", [], {})).id,
            "private_module": q.enqueue_call(RUN_PATH, ("myapp._private.x", [], {})).id,
        }
        from hybridq.envelope.model import new_job_id
        for path in ("myapp.__main__.x", "myapp._private.x"):  # keyed as ours are
            job_id = new_job_id()
            ids[path] = q.enqueue_call(
                RUN_PATH, (path, [], {}), idempotency_key=f"django:{path}:{job_id}", job_id=job_id
            ).id
        ours = add.enqueue(1, 2).id
        emit(
            errors={name: error_of(lambda i=i: backend.get_result(i)).split(":")[0] for name, i in ids.items()},
            ours=str(backend.get_result(ours).status),
        )
        """,
    )
    assert set(out["errors"].values()) == {"TaskResultDoesNotExist"}, out
    assert out["ours"] == "READY"
    assert not (tmp_path / "imported").exists()  # nothing the worker refuses was imported


def test_a_missing_journal_directory_is_refused_not_made(project: Project) -> None:
    """A host without the journal must not write one of its own that no forwarder reads."""
    out = project(
        """
        emit(error=error_of(lambda: add.enqueue(1, 2)), made=os.path.exists(J))
        """,
    )
    assert out["error"].startswith("ImproperlyConfigured: hybridq backend: the journal directory"), out
    assert "['journal']" in out["error"]
    assert "always_outbox" in out["error"]
    assert "\n" not in out["error"]
    assert out["made"] is False


def test_autocommit_off_in_databases_joins_the_transaction(project: Project) -> None:
    """``AUTOCOMMIT: False``: the first enqueue, before any connection, is in the transaction too."""
    out = project(
        """
        ready()
        connection.commit()
        connection.close()
        first = add.enqueue(1, 2).id  # no connection open yet
        second = add.enqueue(3, 4).id
        connection.rollback()
        emit(gone=[error_of(lambda i=i: backend.get_result(i)).split(":")[0] for i in (first, second)],
             in_journal=[fetch_job(i, J) is not None for i in (first, second)])
        """,
        database={"AUTOCOMMIT": False},
    )
    assert out == {"gone": ["TaskResultDoesNotExist"] * 2, "in_journal": [False, False]}


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_get_result_errors_are_one_line(
    database: str, request: pytest.FixtureRequest, project: Project
) -> None:
    """No outbox table (inside atomic() too: the caller's transaction goes on), an unreadable journal.

    On PostgreSQL a failed statement aborts the transaction it runs in: the read is in a savepoint.
    """
    entry: dict[str, str] = {}
    if database == "postgresql":
        url = urlsplit(request.getfixturevalue("pg_dsn"))
        host = parse_qs(url.query).get("host", [url.hostname or ""])[0]
        entry = {"ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"), "HOST": host}
        entry.update({"USER": url.username} if url.username else {})
        entry.update({"PORT": str(url.port)} if url.port else {})
    out = project(
        """
        no_table = error_of(lambda: backend.get_result("nope"))
        with transaction.atomic():
            in_atomic = error_of(lambda: backend.get_result("nope"))
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")  # the transaction is still usable
        ready()
        job_id = add.enqueue(1, 2).id
        os.rename(J, J + ".real")
        os.symlink(J + ".real", J)  # a journal hybridq refuses to follow (JournalPathError)
        unreadable = error_of(lambda: backend.get_result(job_id))
        emit(no_table=no_table, in_atomic=in_atomic, unreadable=unreadable)
        """,
        database=entry,
    )
    assert out["no_table"] == out["in_atomic"]
    assert out["no_table"].startswith("ImproperlyConfigured: hybridq backend 'default': database 'default'")
    assert "hybridq_outbox_init" in out["no_table"]
    assert out["unreadable"].startswith("ImproperlyConfigured: hybridq backend 'default': cannot read")
    assert not any("\n" in line for line in out.values())


def test_a_task_enqueued_on_hybridq_with_using_runs(project: Project) -> None:
    """``task.using(backend="default")`` of a task declared for another backend: the job's alias counts."""
    out = project(
        """
        ready()
        from hybridq.contrib.django.run import run_task
        job = elsewhere.using(backend="default").enqueue(5)
        env = fetch_job(job.id, J).envelope
        emit(
            value=run_task(*env.args, **env.kwargs),
            declared=error_of(lambda: run_task("myapp.tasks.elsewhere", [5], {})),
            result=backend.get_result(job.id).task.backend,
        )
        """,
    )
    assert out["value"] == 5
    assert out["declared"].startswith("NotAllowed: task 'myapp.tasks.elsewhere' belongs to backend 'other'")
    assert out["result"] == "default"


def test_default_allow_is_the_project_apps_only(project: Project) -> None:
    """Without ``allow``: apps under BASE_DIR (not a third-party app); private parts refused anywhere."""
    out = project(
        """
        from hybridq.contrib.django.config import allowed_prefixes, check_task_path
        emit(prefixes=list(allowed_prefixes()),
             private=error_of(lambda: check_task_path("myapp._x.tasks.f")))
        """,
    )
    assert out["prefixes"] == ["myapp"]  # not vendored (outside BASE_DIR), nor hybridq's or Django's
    assert out["private"] == "NotAllowed: 'myapp._x.tasks.f' is not a Django task path"


def test_a_run_after_task_takes_the_delayed_chain(project: Project) -> None:
    """Review 2 M1: the backend mints each job's id and key, so a job run an hour later may leave
    the main chain (issue 29). Fails before the prepare's fresh mark: the id's shape read them as
    the caller's, and every ``run_after`` job pinned the main chain."""
    out = project(
        """
        ready()
        import datetime
        from django.utils import timezone
        now = add.enqueue(1, 2)
        later = add.using(run_after=timezone.now() + datetime.timedelta(hours=1)).enqueue(3, 4)
        emit(now=fetch_job(now.id, J).record.writer_id, later=fetch_job(later.id, J).record.writer_id)
        """,
    )
    assert out["now"] != out["later"]
