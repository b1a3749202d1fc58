"""Shared fixtures. Every file a test makes lives under ``tmp_path``.

Scenario tests (docs/reliability.md S1-S15) report one figure line each through the ``figures``
fixture; the lines are printed together at the end of the run, e.g.
``S1 producer-kill cycles=40 acked=5210 lost=0``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Workers run only functions they are allowed to (hybridq.security.allow): the suite's tasks live in
# `tests`. Set here, so every worker the tests start, in-process or as a child, inherits it.
os.environ.setdefault("HYBRIDQ_ALLOW", "tests")

# Private redis-server fixtures (`redis_server`, `make_redis_server`) for every test module, and
# a private PostgreSQL (`postgres_server`, `pg_dsn`, `make_postgres_server`) for the outbox's.
pytest_plugins = ["tests.support.redis", "tests.support.postgres", "tests.support.sentinel"]

_FIGURES: list[str] = []

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def figures() -> Callable[[str], None]:
    """Record a scenario's figure line (printed in the terminal summary)."""

    def report(line: str) -> None:
        _FIGURES.append(line)
        print(line)

    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("scenario figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True, scope="session")
def _rq_workers_exit_promptly() -> Iterator[None]:
    """RQ's own worker classes, run in-process by tests, stop as hybridq's do at exit.

    RQ's ``unsubscribe`` can wait 60 s for its pub/sub thread under redis-py 8.2
    (tests/integration/test_worker_shutdown.py): a third-party race at exit, not what any test
    checks, and it cost the suite minutes under load.
    """
    from hybridq.rqworker import unsubscribe_promptly
    from rq.worker.base import BaseWorker

    mp = pytest.MonkeyPatch()
    mp.setattr(BaseWorker, "unsubscribe", unsubscribe_promptly)
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _close_shared_writers() -> Iterator[None]:
    """Seal the producer's per-process writers after each test (no fd or lock outlives it)."""
    yield
    from hybridq.producer.queue import _close_writers

    _close_writers()


@pytest.fixture(autouse=True)
def _take_ahead_depth_kept() -> Iterator[None]:
    """The pool's take-ahead depth in this process is the default again after each test.

    hybridq.testing.ahead (what a pool under test imports: ``--import``) sets it when imported,
    and the tests that import every module (test_errors_tree, test_public_api) import it too:
    without this, every test after them in the process would take four jobs per thread ahead
    whatever runs (tests/unit/test_worker_quick.py, in-process engines).
    """
    from hybridq.worker import runner

    depth = runner.AHEAD
    yield
    runner.AHEAD = depth


@pytest.fixture
def journal_dir(tmp_path: Path) -> Path:
    """A path for a journal directory (not yet created)."""
    return tmp_path / "journal"


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child Python processes that import hybridq from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("HYBRIDQ_CRASH_POINT", None)
    return env


PYTHON = sys.executable
