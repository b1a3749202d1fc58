"""The web API example (examples/web_api, issue 17 "Done when"): a Starlette app under uvicorn.

Real processes: a private redis-server, ``python -m hybridq forward``, ``python -m hybridq worker``
for the queue ``web`` (running the example's ``async def`` task), and ``uvicorn app:app`` on a
socket this test binds (``--fd``, no fixed port). Forty clients POST at once (``enqueue_async``
in the handler), every answer is a 202 with the job id and a ``Location``, and ``GET`` on each
location reports the job's durable status until it is ``finished``. The example's one command
(``run.py --demo``, its README) runs too.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer

from tests.conftest import ROOT
from tests.integration.test_worker_redis import alive, wait_status
from tests.support.processes import ForwarderProcess, WorkerProcess, wait_until

EXAMPLE = ROOT / "examples" / "web_api"
CLIENTS = 40


def http(
    base: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers, json.loads(err.read())


def test_posted_jobs_are_accepted_with_their_id_and_get_reports_them_finished(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str]
) -> None:
    journal = tmp_path / "journal"
    ensure_journal_dir(journal)
    env = {
        **subprocess_env,
        "HYBRIDQ_JOURNAL": str(journal),
        "PYTHONPATH": f"{EXAMPLE}:{subprocess_env['PYTHONPATH']}",
    }
    forwarder = ForwarderProcess(journal, redis_server.url, env=env, log_path=tmp_path / "forwarder.log")
    worker_args = ["-m", "hybridq", "worker", "--redis", redis_server.url, "--allow", "textjobs"]
    worker = WorkerProcess(
        [sys.executable, *worker_args, "--processes", "1", "web"],
        env=env,
        log_path=tmp_path / "worker.log",
        cwd=tmp_path,
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        uvicorn = WorkerProcess(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--fd",
                str(sock.fileno()),
                "--log-level",
                "warning",
                "app:app",
            ],
            env=env,
            log_path=tmp_path / "uvicorn.log",
            cwd=EXAMPLE,
            pass_fds=(sock.fileno(),),
        )
    running = alive(forwarder, worker, uvicorn)
    try:

        def serving() -> bool:
            running()
            try:
                return http(base, "GET", "/jobs/unknown")[0] == 404
            except OSError:
                return False

        wait_until(serving, what="the app to answer")
        texts = [f"word {i} " * (i % 5 + 1) for i in range(CLIENTS)]
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            posted = list(pool.map(lambda t: http(base, "POST", "/jobs", {"text": t}), texts))
        assert [code for code, _, _ in posted] == [202] * CLIENTS
        ids = [body["id"] for _, _, body in posted]
        assert len(set(ids)) == CLIENTS
        assert [headers["Location"] for _, headers, _ in posted] == [f"/jobs/{i}" for i in ids]
        # A client that retries a POST under the same Idempotency-Key: one run, two accepted requests.
        retried = [
            http(base, "POST", "/jobs", {"text": "once"}, {"Idempotency-Key": "order-42"}) for _ in range(2)
        ]
        assert [code for code, _, _ in retried] == [202, 202]
        ids += [body["id"] for _, _, body in retried]

        def all_finished() -> bool:
            running()
            states = [http(base, "GET", f"/jobs/{i}") for i in ids]
            assert all(code == 200 for code, _, _ in states), states
            return all(body["status"] == "finished" for _, _, body in states)

        wait_until(all_finished, timeout=60, interval=0.25, what="every job finished")
        status = wait_status(journal, env, lambda s: s["pending"] == 0, what="no job pending", alive=running)
        assert status["accepted"] == CLIENTS + 2
        assert status["duplicates_suppressed"] == 1  # the retried POST did not run again
        assert status["failed"] == 0
        # Bad requests are refused, and nothing is enqueued for them.
        assert http(base, "POST", "/jobs", b"not json")[0] == 400
        assert http(base, "POST", "/jobs", {"text": 42})[0] == 400
        assert http(base, "GET", "/jobs/0123456789abcdef")[0] == 404
        assert wait_status(journal, env, lambda s: True, what="status")["accepted"] == CLIENTS + 2
    finally:
        uvicorn.kill()
        worker.kill()
        forwarder.kill()


def test_the_examples_one_command_runs_and_tallies(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "run.py"),
            "--demo",
            "10",
            "--port",
            "0",
            "--dir",
            str(tmp_path / "run"),
        ],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("posted=10 accepted=10 finished=10 failed=0 "), done.stdout
