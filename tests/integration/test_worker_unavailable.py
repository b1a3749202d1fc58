"""A worker that cannot import a task, or is not set up to allow it, leaves the job for a worker
that can (issue 12.10, 12.11): no claim, no attempt used, listed for ``status`` and ``doctor``.

A security refusal (a bad signature, a standard-library function) still fails for good.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from hybridq import Queue
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.journal.paths import ensure_journal_dir
from hybridq.ops.metrics import ForwarderMetrics
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery, Probe
from hybridq.transport.rq import RQTransport
from hybridq.worker import waiting
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from tests.support.processes import ForwarderProcess, WorkerProcess, wait_until
from tests.support.rqwork import Work

OWNER = "owner1"
#: The console script of this checkout's venv: ``python -m`` would put the cwd on sys.path itself.
HYBRIDQ = str(Path(sys.executable).with_name("hybridq"))


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def deliver(transport: RQTransport, func: str, *args: object, lease_s: float = 10.0) -> Envelope:
    env = Envelope(
        id=new_job_id(),
        func=func,
        queue="default",
        idempotency_key=new_job_id(),
        created_at=time.time(),
        args=args,
    )
    transport.push([Delivery(env, OWNER, ("w", 0, 64), lease_s=lease_s)])
    return env


def events(transport: RQTransport) -> list[dict[str, object]]:
    return [dict(e.body) for e in transport.harvest(OWNER, 100) if e.body is not None]


def assert_left(transport: RQTransport, env: Envelope, reason: str) -> None:
    """Not claimed, no attempt, nothing reported; listed as waiting; the forwarder redelivers it."""
    conn = transport.connection
    assert events(transport) == []  # the forwarder records no failure: no attempt used
    assert conn.get(keys.result(env.key_id)) is None
    assert conn.hget(keys.rq_job(env.id), "hybridq_started") is None  # the task never started
    error = RQJob.fetch(env.id, connection=conn, serializer=JSONSerializer).latest_result().exc_string  # type: ignore[union-attr]
    assert "TaskUnavailable" in error, error
    assert reason in error, error
    listed = waiting.current(conn)
    assert listed.count == 1, listed
    assert reason in listed.examples[0]["reason"], listed
    # "Taken, never started": after a lease the forwarder delivers the same attempt again.
    [verdict] = transport.probe([Probe(env.id, env.key_id, env.queue)], lease_s=0.0)
    assert verdict == "stranded"


def test_a_task_this_worker_is_not_set_up_to_allow_is_left_for_another(
    transport: RQTransport, monkeypatch: pytest.MonkeyPatch, work: Work
) -> None:
    monkeypatch.setenv("HYBRIDQ_ALLOW", "myapp.tasks")  # not `tests`
    env = deliver(transport, "tests.tasks.never_imported_by_a_refusing_worker")
    work(transport)
    assert_left(transport, env, "is not allowed to run on this worker")
    assert "tests.tasks" not in sys.modules or not hasattr(
        sys.modules["tests.tasks"], "never_imported_by_a_refusing_worker"
    )


def test_a_task_that_does_not_import_here_is_left_for_another_and_says_why(
    transport: RQTransport, work: Work
) -> None:
    env = deliver(transport, "tests.no_such_module.task")
    work(transport)
    assert_left(transport, env, "no module named 'tests.no_such_module'")


def test_a_function_its_module_lacks_fails_for_good_as_no_such_function(
    transport: RQTransport, work: Work
) -> None:
    """Issue 27: a mistyped name in a module the worker imports waited forever (left, again and
    again, never in ``failed list``), with an error that said "not allowed"."""
    for path, where in (
        ("tests.tasks.sendd", "tests.tasks has no attribute 'sendd'"),
        ("tests.no_such_function", "tests has no attribute 'no_such_function'"),  # a package's
        ("tests.guarded_tasks.Tools.nope", "tests.guarded_tasks.Tools has no attribute 'nope'"),
    ):
        env = deliver(transport, path)
        work(transport)
        [event] = [e for e in events(transport) if e["id"] == env.id]
        assert (event["outcome"], event["final"]) == ("failed", True), path
        assert f"no such function {path}: {where}" in str(event["error"]), event["error"]
        assert transport.connection.get(keys.result(env.key_id)) is None  # refused before the claim
    assert waiting.current(transport.connection).count == 0


def test_a_module_a_package_lacks_is_left_for_a_newer_worker(transport: RQTransport, work: Work) -> None:
    """A rolling deploy adds a module: a worker of the old code imports the package, not it."""
    env = deliver(transport, "tests.added_by_the_next_deploy.task")
    work(transport)
    assert_left(transport, env, "no module named 'tests.added_by_the_next_deploy'")


def test_a_standard_library_function_still_fails_for_good(
    transport: RQTransport, tmp_path: Path, work: Work
) -> None:
    pwned = tmp_path / "pwned"
    deliver(transport, "os.system", f"touch {pwned}")
    work(transport)
    [event] = events(transport)
    assert (event["outcome"], event["final"]) == ("failed", True)
    assert not pwned.exists()
    assert waiting.current(transport.connection).count == 0
    assert "standard library" in str(event["error"])
    assert "--allow" not in str(event["error"])  # never a hint to allow os (issue 27)


def test_hybridq_worker_imports_tasks_from_its_current_directory(
    redis_server: RedisServer, transport: RQTransport, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """The README's quick start: `hybridq worker --allow tasks` where tasks.py is."""
    (tmp_path / "tasks.py").write_text(
        "def send(path):\n    open(path, 'a').write('sent\\n')\n    return 'ok'\n", encoding="utf-8"
    )
    effects = tmp_path / "effects.txt"
    env = deliver(transport, "tasks.send", str(effects))
    missing = deliver(transport, "tasks.not_there")
    child_env = {k: v for k, v in subprocess_env.items() if k != "HYBRIDQ_ALLOW"}
    done = subprocess.run(
        [
            HYBRIDQ,
            "worker",
            "--burst",
            "--simple",
            "--allow",
            "tasks",
            "--redis",
            redis_server.url,
            "default",
        ],
        cwd=tmp_path,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert effects.read_text() == "sent\n", done.stderr
    outcomes = {e["id"]: e["outcome"] for e in events(transport)}
    # tasks.py imports here and has no not_there: no such function, failed for good (issue 27)
    assert outcomes == {env.id: "succeeded", missing.id: "failed"}
    assert "no such function tasks.not_there: tasks has no attribute 'not_there'" in done.stderr
    assert "Invalid attribute name" not in done.stderr
    assert waiting.current(transport.connection).count == 0


def test_a_job_no_worker_can_run_waits_visibly_then_runs_once_on_a_worker_that_can(
    redis_server: RedisServer, tmp_path: Path, journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    """A rolling deploy: the old worker is not set up for the task; it uses no attempt, and the
    job runs (attempt 1) once a worker that allows it starts."""
    effects = tmp_path / "effects.txt"
    env = {k: v for k, v in subprocess_env.items() if k != "HYBRIDQ_ALLOW"}
    ensure_journal_dir(journal_dir)
    forwarder = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env=env,
        log_path=tmp_path / "forwarder.log",
        extra_args=("--lease", "1"),
    )
    worker_args = [sys.executable, "-m", "hybridq", "worker", "--simple", "--redis", redis_server.url]
    old = WorkerProcess(
        [*worker_args, "--import", "tests.registered_tasks", "default"],
        env=env,
        log_path=tmp_path / "old.log",
        cwd=tmp_path,
    )
    new: WorkerProcess | None = None
    try:
        job = Queue("default", journal_dir).enqueue("tests.tasks.traced", str(effects), "t")
        # Left, delivered again (the same attempt), left again: it never fails for good.
        wait_until(
            lambda: old.log().count("left for a worker that can run it") >= 2, timeout=60, what="two leaves"
        )
        status = cli_json(
            ["status", "--json", "--journal", str(journal_dir), "--redis", redis_server.url], env
        )
        assert (status["failed"], status["pending"]) == (0, 1)
        assert status["redis"]["waiting_for_a_worker"] == 1
        doctor = cli_json(
            ["doctor", "--json", "--journal", str(journal_dir), "--redis", redis_server.url], env
        )
        assert [w["id"] for w in doctor["waiting"]] == [job.id]  # type: ignore[attr-defined]
        assert not doctor["healthy"]
        new = WorkerProcess(
            [*worker_args, "--allow", "tests", "default"],
            env=env,
            log_path=tmp_path / "new.log",
            cwd=tmp_path,
        )
        wait_until(
            lambda: cli_json(["status", "--json", "--journal", str(journal_dir)], env)["succeeded"] == 1,
            timeout=60,
            what="the job to succeed",
        )
    finally:
        for proc in (old, new, forwarder):
            if proc is not None:
                proc.kill()
    starts = [line.split() for line in effects.read_text().splitlines() if line.startswith("start")]
    assert [s[2] for s in starts] == ["1"]  # ran once, as attempt 1: the leaves used no attempt


def cli_json(args: list[str], env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "hybridq", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode in (0, 4), done.stderr
    out: dict[str, object] = json.loads(done.stdout)
    return out


def test_the_forwarders_metrics_count_the_jobs_waiting_for_a_worker(
    transport: RQTransport, monkeypatch: pytest.MonkeyPatch, work: Work
) -> None:
    monkeypatch.setenv("HYBRIDQ_ALLOW", "myapp.tasks")  # not `tests`
    deliver(transport, "tests.tasks.add", 1, 2)
    metrics = object.__new__(ForwarderMetrics)  # only the Redis part of a scrape
    metrics.forwarder = SimpleNamespace(transport=transport, stats=SimpleNamespace(down_since=None))  # type: ignore[assignment]
    assert metrics.waiting() == 0
    work(transport)
    assert metrics.waiting() == 1
