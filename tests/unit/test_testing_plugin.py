"""The pytest plugin, as a user's test suite gets it: a separate pytest run on a test file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

USER_TESTS = """
import pytest
import hybridq
from hybridq import RetryLater, current_job

READY = set()


@hybridq.task(queue="mail", retry=hybridq.Retry(max_attempts=2))
def welcome(user):
    job = current_job()
    if user < 0 and job.attempt == 1:
        raise ValueError("first attempt fails")
    if user == 0:
        raise KeyError("always fails")
    return [user, job.attempt, job.queue]


@hybridq.task()
def when_ready(name):
    if name not in READY:
        raise RetryLater(5)
    return name


def signup(user):  # the application code under test: it enqueues
    return welcome.delay(user).id


def test_drain(hybridq_queue):
    job_id = signup(1)
    retried = welcome.delay(-1)
    broken = welcome.delay(0)
    assert [j.id for j in hybridq_queue.pending][0] == job_id
    assert hybridq_queue.drain() == 1 + 2 + 2
    assert hybridq_queue.jobs[0].result == [1, 1, "mail"]
    assert retried.result == [-1, 2, "mail"]
    assert hybridq_queue.failed == [broken]
    assert "KeyError" in broken.exc_info


def test_retry_later(hybridq_queue):
    job = when_ready.delay("x")
    hybridq_queue.drain()
    assert job.status == "retrying"
    READY.add("x")
    hybridq_queue.drain()
    assert job.result == "x"


def test_eager(hybridq_eager):
    assert welcome.delay(2).result == [2, 1, "mail"]
    with pytest.raises(KeyError):
        welcome.delay(0)


def test_no_mode_leaks_from_the_tests_before():
    with pytest.raises(hybridq.HybridqError, match="no journal configured"):
        welcome.delay(3)
"""


def test_the_fixtures_in_a_users_test_run(tmp_path: Path) -> None:
    (tmp_path / "test_user_app.py").write_text(USER_TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("HYBRIDQ_JOURNAL", "HYBRIDQ_ALLOW")}
    env.pop("PYTEST_ADDOPTS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user_app.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["test_user_app.py"]
