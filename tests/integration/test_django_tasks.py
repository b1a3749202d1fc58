"""hybridq.contrib.django against a real Django project (tests/django_project), on SQLite and PostgreSQL.

The project uses the tasks framework's public API only (``@task``, ``enqueue``, ``aenqueue``,
``get_result``, ``aget_result``, ``transaction.atomic``) and runs hybridq through its
management commands (``hybridq_outbox_init``, ``hybridq_forward``, ``hybridq_worker``). On
Python 3.11 the framework is the ``django-tasks`` backport on Django 5.2 (the default run); in
``scripts/test-django6`` it is Django 6's ``django.tasks`` on Python 3.12, the same tests.

One scenario per database: a rolled-back order leaves no job; a process SIGKILLed right after
its commit loses no job enqueued inside the transaction (one from ``on_commit`` is lost); a committed one is in the
outbox (READY) before the relay moves it; the worker is SIGKILLed while the committed job runs,
Redis is wiped (FLUSHALL), a new worker runs it again and it completes once; every job's
``get_result`` gives its status and return value.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq.contrib.django.backend import RUN_PATH
from hybridq.job import fetch_job
from hybridq.ops.status import stats
from hybridq.producer.queue import Queue
from hybridq.testing.embedded import RedisServer

from tests.support.processes import WorkerProcess, wait_until

PROJECT = Path(__file__).resolve().parent.parent / "django_project"
pytest.importorskip("django")


@pytest.fixture
def processes() -> Iterator[list[WorkerProcess]]:
    procs: list[WorkerProcess] = []
    yield procs
    for proc in procs:
        proc.kill()


class Shop:
    """The test project, its environment, and its manage.py."""

    def __init__(self, tmp_path: Path, db: str, redis_url: str, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.journal = tmp_path / "journal"
        # The deployment makes it (enqueue refuses a missing one: no journal nobody forwards).
        self.journal.mkdir(mode=0o700)
        self.effects = tmp_path / "effects.log"
        self.gate = tmp_path / "first-run-hangs"
        self.env = {
            **env,
            "PYTHONPATH": os.pathsep.join([str(PROJECT), env["PYTHONPATH"]]),
            "DJANGO_SETTINGS_MODULE": "shop_site.settings",
            "SHOP_DB": db,
            "SHOP_EFFECTS": str(self.effects),
            "SHOP_HANG_FIRST": str(self.gate),
            "HYBRIDQ_JOURNAL": str(self.journal),
            "HYBRIDQ_REDIS_URL": redis_url,
        }
        self.env.pop("HYBRIDQ_ALLOW", None)  # the worker's allowlist comes from the settings

    def manage(self, *args: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, str(PROJECT / "manage.py"), *args],
            env=self.env,
            cwd=self.tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"manage.py {args} exited {done.returncode}:\n{done.stderr[-3000:]}"
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return out

    def start(self, name: str, *args: str) -> WorkerProcess:
        return WorkerProcess(
            [sys.executable, str(PROJECT / "manage.py"), *args],
            env=self.env,
            log_path=self.tmp_path / f"{name}.log",
            cwd=self.tmp_path,
        )

    def status(self) -> dict[str, Any]:
        """``hybridq status --json``'s counts, read here from the journal (no child process)."""
        return stats(self.journal, redis_url=None, outbox=None, redis_for=None)

    def effects_of(self, order: int) -> list[str]:
        if not self.effects.exists():
            return []
        return [
            line.split()[0] for line in self.effects.read_text().splitlines() if line.split()[1] == str(order)
        ]


def scenario(
    shop: Shop, redis: RedisServer, processes: list[WorkerProcess], figures: Callable[[str], None]
) -> None:
    out = shop.manage("shop", "setup", "enqueue")
    assert out["setup"]["outbox_rows"] == 0
    blob = "bytea" if shop.env["SHOP_DB"].startswith("postgresql:") else "BLOB"
    assert f"envelope {blob} NOT NULL" in out["setup"]["sql"]  # --print-sql: the database's dialect
    # The transaction decides: a rollback leaves no row (no job), a commit leaves its row.
    assert out["rows_after_rollback"] == 0
    assert out["rows_after_commit"] == 1
    assert out["status_at_enqueue"] == out["status_in_outbox"] == "READY"
    assert out["rows_after_nested"] == 2  # the savepoint rolled back its own job only
    assert out["rows_after_manual"] == 2  # set_autocommit(False) + rollback: joined, and gone
    assert out["manual_after_rollback"].startswith("TaskResultDoesNotExist")
    assert out["rows_after_direct"] == 2  # outside a transaction: straight into the journal
    assert out["bad_queue"].startswith("InvalidTask")
    assert out["not_json"].startswith("TypeError: Unsupported type")
    assert out["nan"].startswith("NotSerializable: task shop.tasks.add: arguments must be JSON")
    assert out["missing"].startswith("TaskResultDoesNotExist")
    assert out["rows_at_end"] == 2  # the bad calls wrote nothing

    # A process killed right after its commit: the job enqueued inside the transaction is
    # committed with the order; the one an on_commit hook would have enqueued never is.
    killed = subprocess.run(
        [sys.executable, str(PROJECT / "manage.py"), "shop", "die", str(shop.tmp_path / "died.json")],
        env=shop.env,
        cwd=shop.tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    died = json.loads((shop.tmp_path / "died.json").read_text())
    # Jobs that name the backend's entry point with what is not an allowed @task (a Redis writer,
    # or a producer of another app): they fail for good, and nothing outside the allowed modules
    # is imported for them.
    forged = [
        Queue("default", journal=shop.journal).enqueue(RUN_PATH, path, args, {}).id
        for path, args in (
            ("os.system", ["id"]),
            ("shop.tasks.log", ["id"]),
            ("shop.tasks._private", ["id"]),
            ("shop.tasks.add", "12"),  # an allowed task, its arguments not a list
        )
    ]
    forwarder = shop.start("forwarder", "hybridq_forward", "--lease", "1")
    processes.append(forwarder)
    worker = shop.start("worker", "hybridq_worker", "--processes", "1", "--threads", "4")
    processes.append(worker)
    others = ("nested_kept", "direct", "async", "boom", "whoami", "double")

    def first_run_hangs_and_the_others_ended() -> bool:
        forwarder.assert_alive()
        worker.assert_alive()
        status = shop.status()
        ended = status["succeeded"] + status["failed"]
        return shop.gate.exists() and ended == len(others) + len(forged) + 1  # + the killed process's job

    wait_until(first_run_hangs_and_the_others_ended, timeout=90, interval=0.05, what="the jobs to run")
    worker.kill()  # SIGKILL, the pool's process and the parent, mid-run
    redis.flushall()  # nothing in Redis remembers the job
    worker = shop.start("worker2", "hybridq_worker", "--processes", "1", "--threads", "2")
    processes.append(worker)

    def committed_job_succeeded() -> bool:
        forwarder.assert_alive()
        worker.assert_alive()
        return shop.status()["succeeded"] == len(others) + 1

    wait_until(committed_job_succeeded, timeout=90, interval=0.05, what="the committed job to run again")
    gone = ("rolled_back", "nested_dropped", "manual_rolled_back")
    ids = [out["committed"], died["a_job"], out["deferred"], *(out[name] for name in (*gone, *others))]
    results = shop.manage("shop", "results", *ids)
    committed = results[out["committed"]]
    effects = shop.effects_of(out["order"])
    figures(
        f"django {'postgresql' if shop.env['SHOP_DB'].startswith('postgresql:') else 'sqlite'}: committed job starts={effects.count('start')} "
        f"done={effects.count('done')} attempts={committed['attempts']}; rolled-back jobs: "
        f"{results[out['rolled_back']]}; process SIGKILLed after its commit: job in the transaction "
        f"ran {shop.effects_of(died['a']).count('ship')}x, job from on_commit ran "
        f"{shop.effects_of(died['b']).count('ship')}x"
    )
    assert effects == ["start", "start", "done"]  # killed once, completed once
    assert shop.effects_of(died["a"]) == ["ship"]  # its process died right after the commit
    assert shop.effects_of(died["b"]) == []  # on_commit: lost with the process
    assert results[died["a_job"]]["return_value"] == f"shipped {died['a']}"
    assert committed["status"] == "SUCCESSFUL"
    assert committed["return_value"] == {"order": out["order"], "state": "fulfilled"}
    # The attempt counter lives in Redis until the outcome is harvested: FLUSHALL resets it.
    assert committed["attempts"] in (1, 2)
    assert committed["task"] == "shop.tasks.fulfil"
    assert (
        results[out["rolled_back"]] == results[out["nested_dropped"]] == {"error": "TaskResultDoesNotExist"}
    )
    assert results[out["nested_kept"]]["return_value"] == 2
    assert results[out["direct"]]["return_value"] == 5
    assert results[out["async"]]["return_value"] == 42
    assert results[out["double"]]["return_value"] == 42  # an async def task
    assert results[out["whoami"]]["return_value"] == {"id": out["whoami"], "attempt": 1, "tag": "ctx"}
    failed = results[out["boom"]]
    assert (failed["status"], failed["errors"], failed["finished"]) == (
        "FAILED",
        ["builtins.ValueError"],
        True,
    )
    assert "out of stock" in failed["traceback"]
    refused = [fetch_job(job_id, shop.journal) for job_id in forged]
    assert [job.status if job else None for job in refused] == ["failed"] * len(forged)
    reasons = [(job.exc_info or "").strip().splitlines()[-1] for job in refused if job]
    assert "not under an allowed prefix" in reasons[0], reasons
    assert "is not a task made with @task" in reasons[1], reasons
    assert "is not a Django task path" in reasons[2], reasons
    assert "arguments in a list and a dict, not str" in reasons[3], reasons
    assert results["aget_result"] == {"id": out["committed"], "status": "SUCCESSFUL"}


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_django_tasks(
    database: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    processes: list[WorkerProcess],
    figures: Callable[[str], None],
) -> None:
    db = str(tmp_path / "shop.db") if database == "sqlite" else request.getfixturevalue("pg_dsn")
    scenario(Shop(tmp_path, db, redis_server.url, subprocess_env), redis_server, processes, figures)
