"""Redis write access is not code execution: signed envelopes, and RQ's own function lookup.

Against a private redis-server and real workers (``hybridq worker``, ``rq worker --job-class
hybridq.worker.Job``, or RQ's ``SimpleWorker`` in this process). ``tests.import_canary`` records
every import of it, in any process, in the file ``HYBRIDQ_TEST_CANARY`` names: where a test says
"never imported", that file must not exist.

A. With a signing key, workers run only jobs whose envelope is signed by one of their keys:
   a job changed in Redis (its arguments, its function) or never signed fails for good, before
   anything is imported or claimed.
B. A job hash written to Redis by hand, naming some other function than hybridq's entry point
   (RQ would import and call it before hybridq's allowlist ever ran), is refused unimported.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue, failed_jobs
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.journal.paths import ensure_journal_dir
from hybridq.protocol import keys
from hybridq.security.signing import ENV_KEY, ENV_KEY_FILE, Keyring
from hybridq.testing.embedded import RedisServer
from hybridq.testing.rq_cli import RQ
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.worker import ENTRY_POINT, Job
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from tests.import_canary import ENV_VAR as CANARY_VAR
from tests.support.processes import ForwarderProcess, WorkerProcess, run_status, wait_until
from tests.support.rqwork import job_data

OWNER = "owner1"
NEW_KEY = "new-" + "n" * 60
OLD_KEY = "old-" + "o" * 60
CANARY = "tests.import_canary"


@pytest.fixture(autouse=True)
def _no_key_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys reach the workers started here only as the tests give them."""
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The canary's record file (absent until something imports the canary), set for every process."""
    path = tmp_path / "canary.txt"
    monkeypatch.setenv(CANARY_VAR, str(path))
    sys.modules.pop(CANARY, None)
    yield path
    sys.modules.pop(CANARY, None)


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    """The workers' keys after a rotation: the new key signs, the old one still verifies."""
    path = tmp_path / "signing.keys"
    path.write_text(f"# rotated\n{NEW_KEY}\n{OLD_KEY}\n", encoding="utf-8")
    os.chmod(path, 0o600)
    return path


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def worker_env(subprocess_env: dict[str, str], *, allow: str) -> dict[str, str]:
    env = {k: v for k, v in subprocess_env.items() if k not in (ENV_KEY, ENV_KEY_FILE)}
    env["HYBRIDQ_ALLOW"] = allow
    return env


def run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run a burst worker to completion; return its output."""
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def hybridq_worker(url: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hybridq",
        "worker",
        "--burst",
        "--simple",
        "--redis",
        url,
        *extra,
        "default",
    ]


def record_job(effects: Path, token: str, **overrides: Any) -> Envelope:
    fields: dict[str, Any] = {
        "id": new_job_id(),
        "func": "tests.tasks.record",
        "queue": "default",
        "idempotency_key": new_job_id(),
        "created_at": time.time(),
        "args": (str(effects), token),
    }
    fields.update(overrides)
    return Envelope(**fields)


def push(transport: RQTransport, env: Envelope) -> None:
    transport.push([Delivery(env, OWNER, ("w", 0, 64))])


def tamper(transport: RQTransport, job_id: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the envelope inside the RQ job hash's ``data``, as someone with Redis access can."""
    key = keys.rq_job(job_id)
    func, instance, args, kwargs = job_data(transport.connection.hget(key, "data"))
    assert func == ENTRY_POINT
    change(args[0]["job"])
    data = zlib.compress(json.dumps([func, instance, args, kwargs]).encode())
    transport.connection.hset(key, "data", data)


def outcomes(transport: RQTransport) -> dict[str, dict[str, Any]]:
    """The completion events workers reported, by job id."""
    return {str(e.body["id"]): dict(e.body) for e in transport.harvest(OWNER, 100) if e.body is not None}


def plant(conn: Any, func: str, args: list[Any] | None = None, **fields: str) -> str:
    """Write an RQ job hash by hand, as whoever can write to Redis can, and queue it."""
    job_id = new_job_id()
    now = utcformat(datetime.now(UTC))
    conn.hset(
        keys.rq_job(job_id),
        mapping={
            "data": zlib.compress(json.dumps([func, None, args or [], {}]).encode()),
            "created_at": now,
            "enqueued_at": now,
            "origin": "default",
            "description": func,
            "status": "queued",
            "timeout": "60",
            **fields,
        },
    )
    conn.rpush(keys.rq_queue("default"), job_id)
    conn.sadd(keys.rq_queues(), keys.rq_queue("default"))
    return job_id


def rq_outcome(conn: Any, job_id: str) -> tuple[str, str]:
    """The RQ job's status and error text (read without resolving its function)."""
    job = RQJob.fetch(job_id, connection=conn, serializer=JSONSerializer)
    result = job.latest_result()
    return job.get_status().value, (result.exc_string or "") if result is not None else ""


def work_in_process(conn: Any) -> None:
    """RQ's SimpleWorker in this process, with hybridq's job class (what `hybridq worker` uses)."""
    queue = RQQueue("default", connection=conn, serializer=JSONSerializer, job_class=Job)
    SimpleWorker([queue], connection=conn, serializer=JSONSerializer, job_class=Job).work(
        burst=True, logging_level="WARNING"
    )


# -- A. signed envelopes ------------------------------------------------------------------------


def test_signed_jobs_run_on_a_worker_holding_the_key_old_key_included(
    redis_server: RedisServer,
    transport: RQTransport,
    key_file: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    effects = tmp_path / "effects.txt"
    new = Keyring((NEW_KEY.encode(),)).sign(record_job(effects, "signed-with-the-new-key"))
    old = Keyring((OLD_KEY.encode(),)).sign(record_job(effects, "signed-with-the-old-key"))
    push(transport, new)
    push(transport, old)
    env = worker_env(subprocess_env, allow="tests")
    log = run(hybridq_worker(redis_server.url, "--signing-key-file", str(key_file)), env, tmp_path)
    assert effects.read_text().split() == ["signed-with-the-new-key", "signed-with-the-old-key"]
    events = outcomes(transport)
    assert {events[j.id]["outcome"] for j in (new, old)} == {"succeeded"}
    assert "verifying envelope signatures" in log
    assert NEW_KEY not in log
    assert OLD_KEY not in log


def test_a_job_changed_in_redis_is_refused_before_its_module_is_imported(
    redis_server: RedisServer,
    transport: RQTransport,
    key_file: Path,
    canary: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    effects = tmp_path / "effects.txt"
    signer = Keyring((NEW_KEY.encode(),))
    new_args = signer.sign(record_job(effects, "as-signed"))
    # The canary is allowed (HYBRIDQ_ALLOW=tests): only the signature can stop it.
    new_func = signer.sign(record_job(effects, "as-signed-2"))
    # Not allowed either: the signature is checked first, and says why.
    not_allowed = signer.sign(record_job(effects, "as-signed-3"))
    for env in (new_args, new_func, not_allowed):
        push(transport, env)
    tamper(transport, new_args.id, lambda job: job.update(args=[str(effects), "tampered"]))
    tamper(transport, new_func.id, lambda job: job.update(func=f"{CANARY}.run"))
    tamper(transport, not_allowed.id, lambda job: job.update(func="os.system", args=["true"]))
    env = worker_env(subprocess_env, allow="tests")
    log = run(hybridq_worker(redis_server.url, "--signing-key-file", str(key_file)), env, tmp_path)
    assert not effects.exists(), effects.read_text()
    assert not canary.exists(), canary.read_text()
    events = outcomes(transport)
    for job in (new_args, new_func, not_allowed):
        event = events[job.id]
        assert (event["outcome"], event["final"]) == ("failed", True)
        assert "the signature does not match" in str(event["error"])
        # Refused before the claim: the task never started, nothing stored under its key.
        assert transport.connection.hget(keys.rq_job(job.id), "hybridq_started") is None
        assert transport.connection.get(keys.result(job.key_id)) is None
    assert NEW_KEY not in log
    assert OLD_KEY not in log


def test_an_unsigned_job_is_refused_by_a_worker_holding_a_key(
    redis_server: RedisServer,
    transport: RQTransport,
    key_file: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    effects = tmp_path / "effects.txt"
    unsigned = record_job(effects, "unsigned")
    push(transport, unsigned)
    env = worker_env(subprocess_env, allow="tests")
    env[ENV_KEY_FILE] = str(key_file)  # the environment variable, as a plain rq worker gets it
    run(hybridq_worker(redis_server.url), env, tmp_path)
    assert not effects.exists()
    event = outcomes(transport)[unsigned.id]
    assert (event["outcome"], event["final"]) == ("failed", True)
    assert "the job is not signed" in str(event["error"])
    assert transport.connection.get(keys.result(unsigned.key_id)) is None


def test_a_worker_whose_key_file_is_gone_runs_nothing_and_reports_nothing(
    transport: RQTransport, key_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail closed: never fall back to running unsigned jobs; the forwarder delivers it again later."""
    effects = tmp_path / "effects.txt"
    signed = Keyring((NEW_KEY.encode(),)).sign(record_job(effects, "signed"))
    push(transport, signed)
    monkeypatch.setenv(ENV_KEY_FILE, str(tmp_path / "moved-away"))
    work_in_process(transport.connection)
    assert not effects.exists()
    assert outcomes(transport) == {}  # not failed for good: a key file can be put back
    status, error = rq_outcome(transport.connection, signed.id)
    assert status == "failed"
    assert "SigningKeyError" in error


def test_producer_signs_forwarder_carries_worker_verifies(
    redis_server: RedisServer,
    key_file: Path,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end: the forwarder re-encodes the envelope, and the signature survives it."""
    effects = tmp_path / "effects.txt"
    env = worker_env(subprocess_env, allow="tests")
    ensure_journal_dir(journal_dir)
    forwarder = ForwarderProcess(journal_dir, redis_server.url, env=env, log_path=tmp_path / "forwarder.log")
    worker = WorkerProcess(
        [
            *(sys.executable, "-m", "hybridq", "worker", "--simple", "--redis", redis_server.url),
            *("--signing-key-file", str(key_file), "default"),
        ],
        env=env,
        log_path=tmp_path / "worker.log",
        cwd=tmp_path,
    )
    try:
        queue = Queue("default", journal_dir)
        unsigned = queue.enqueue("tests.tasks.record", str(effects), "unsigned")
        monkeypatch.setenv(ENV_KEY_FILE, str(key_file))  # the producer holds the key from here
        signed = queue.enqueue("tests.tasks.record", str(effects), "signed")
        status = wait_until(
            lambda: (s := run_status(journal_dir, env))["pending"] == 0 and s,
            timeout=60,
            what="both jobs terminal",
        )
    finally:
        worker.kill()
        forwarder.kill()
    assert signed.envelope.signature is not None
    assert effects.read_text().split() == ["signed"]
    assert (status["succeeded"], status["failed"]) == (1, 1)
    [failed] = failed_jobs(str(journal_dir))
    assert failed.id == unsigned.id
    assert "the job is not signed" in (failed.error or "")


# -- B. RQ resolves no function but hybridq's entry point ---------------------------------------


@pytest.mark.parametrize("worker", ["hybridq worker --simple", "rq worker --job-class hybridq.worker.Job"])
def test_a_job_hash_naming_another_function_is_refused_without_importing_it(
    worker: str,
    redis_server: RedisServer,
    canary: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
) -> None:
    with contextlib.closing(redis_server.client()) as conn:
        job_id = plant(conn, f"{CANARY}.run", ["planted"])
    env = worker_env(subprocess_env, allow="tests.tasks")  # not the canary's module
    if worker.startswith("hybridq"):
        args = hybridq_worker(redis_server.url)
    else:  # forking: the work-horse would import it
        args = [*RQ, "worker", "--burst", "--serializer", "rq.serializers.JSONSerializer"]
        args += ["--job-class", "hybridq.worker.Job", "-u", redis_server.url, "default"]
    log = run(args, env, tmp_path)
    assert not canary.exists(), canary.read_text()
    with contextlib.closing(redis_server.client()) as conn:
        status, error = rq_outcome(conn, job_id)
    assert status == "failed"
    assert "NotAllowed" in error
    assert f"{CANARY}.run is not allowed to run on this worker" in error
    assert "without importing anything" in log


def test_a_job_hash_naming_os_system_runs_nothing(redis_server: RedisServer, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    with contextlib.closing(redis_server.client()) as conn:
        job_id = plant(conn, "os.system", [f"touch {pwned}"])
        work_in_process(conn)
        status, error = rq_outcome(conn, job_id)
    assert not pwned.exists()
    assert status == "failed"
    assert "os.system is not allowed to run on this worker" in error


def test_callbacks_a_job_hash_names_are_refused_without_importing_them(
    redis_server: RedisServer,
    transport: RQTransport,
    canary: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYBRIDQ_ALLOW", "tests.tasks")  # not the canary's module
    effects = tmp_path / "effects.txt"
    conn = transport.connection
    # A hybridq job given an on_success callback: refused before the task runs.
    job = record_job(effects, "with-a-callback")
    push(transport, job)
    conn.hset(keys.rq_job(job.id), "success_callback_name", f"{CANARY}.callback")
    # A job that fails (its delivery is garbage): RQ then calls its on_failure callback.
    failing = plant(conn, ENTRY_POINT, [{"garbage": True}], failure_callback_name=f"{CANARY}.callback")
    work_in_process(conn)
    assert not canary.exists(), canary.read_text()
    assert not effects.exists()
    for job_id in (job.id, failing):
        status, error = rq_outcome(conn, job_id)
        assert status == "failed"
        assert f"callback {CANARY}.callback is not allowed" in error


def test_with_a_signing_key_a_job_hash_naming_an_allowed_task_directly_is_refused(
    redis_server: RedisServer, tmp_path: Path, key_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else a job hash naming a task would run it with any arguments, and no signature."""
    effects = tmp_path / "effects.txt"
    with contextlib.closing(redis_server.client()) as conn:
        direct = plant(conn, "tests.tasks.record", [str(effects), "unsigned-but-allowed"])
        work_in_process(conn)  # no key: an allowed function named directly runs, as in RQ
        assert effects.read_text().split() == ["unsigned-but-allowed"]
        assert rq_outcome(conn, direct)[0] == "finished"
        monkeypatch.setenv(ENV_KEY_FILE, str(key_file))
        refused = plant(conn, "tests.tasks.record", [str(effects), "refused"])
        work_in_process(conn)
        status, error = rq_outcome(conn, refused)
    assert effects.read_text().split() == ["unsigned-but-allowed"]
    assert status == "failed"
    assert "this worker verifies signatures" in error
