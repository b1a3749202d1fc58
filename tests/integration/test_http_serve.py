"""``hybridq serve`` and ``hybridq forward --serve`` as real processes (issue 18).

* a server SIGKILLed under concurrent load loses no job it answered 202 for, and POSTs retried
  with the same ``Idempotency-Key`` after the restart get the same id and no second job;
* ``forward --serve`` with a real worker and redis-server: ``GET /v1/jobs/{id}`` reports the
  result after ``FLUSHALL``, and SIGTERM stops the forwarder and its server cleanly;
* the command's errors (one line, exit 1) and its access log, which never shows a token.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader, RecordType
from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer

from tests.integration.test_worker_redis import redis_client
from tests.support.http import ServeProcess, request
from tests.support.processes import WorkerProcess, wait_until

CLIENTS = 8


def journal_ids(journal: Path) -> Counter[str]:
    return Counter(
        Envelope.from_bytes(r.payload).id
        for r in JournalReader(journal).records()
        if r.rtype == RecordType.DATA
    )


def test_the_access_log_never_shows_a_token_and_sigterm_stops_it(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    token = "tok-Zq8v1-never-logged"
    tokens = tmp_path / "tokens"
    tokens.write_text(token + "\n")
    log = tmp_path / "serve.log"
    server = ServeProcess(
        tmp_path / "journal",
        "--tokens-file",
        str(tokens),
        "--allow",
        "tests",
        env=subprocess_env,
        log_path=log,
    )
    try:
        auth = {"Authorization": f"Bearer {token}"}
        assert request(server.url, "POST", "/v1/jobs", {"task": "tests.tasks.add"}, auth).status == 202
        assert (
            request(server.url, "GET", "/v1/stats", None, {"Authorization": "Bearer wrong-guess"}).status
            == 401
        )
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        assert request(server.url, "POST", "/login", f"token={token}".encode(), form).status == 303
        assert request(server.url, "GET", "/healthz").status == 200
        assert server.terminate() == 0
    finally:
        server.kill()
    text = log.read_text()
    assert '"POST /v1/jobs HTTP/1.1" 202' in text  # the access log is on
    assert '"GET /v1/stats HTTP/1.1" 401' in text
    assert token not in text
    assert "wrong-guess" not in text
    assert "Traceback" not in text


def test_sigkill_under_load_loses_no_accepted_job_and_retried_keys_make_no_second_job(
    tmp_path: Path, subprocess_env: dict[str, str], figures
) -> None:
    journal = tmp_path / "journal"
    log = tmp_path / "serve.log"
    server = ServeProcess(journal, "--allow", "tests", env=subprocess_env, log_path=log)
    acked: dict[str, str] = {}  # key -> id answered 202
    sent: dict[str, list[int]] = {}  # key -> body args
    stop = threading.Event()
    lock = threading.Lock()

    def client(n: int) -> None:
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            posts(n, conn)
        finally:
            conn.close()

    def posts(n: int, conn: http.client.HTTPConnection) -> None:
        i = 0
        while not stop.is_set():
            key, args = f"c{n}-{i}", [n, i]
            with lock:
                sent[key] = args
            body = {"task": "tests.tasks.add", "args": args}
            try:
                got = request(server.url, "POST", "/v1/jobs", body, {"Idempotency-Key": key}, conn=conn)
            except (OSError, http.client.HTTPException):
                return  # the server was killed
            assert got.status == 202, got
            with lock:
                acked[key] = got.json["id"]
            i += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(acked) >= 400, timeout=30, what="400 jobs accepted")
        server.kill()  # SIGKILL mid-load
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        server.kill()
    in_journal = journal_ids(journal)
    lost = [job for job in acked.values() if job not in in_journal]
    restarted = ServeProcess(journal, "--allow", "tests", env=subprocess_env, log_path=log)
    try:
        again: dict[str, str] = {}
        host, port = restarted.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            for key, args in sent.items():
                got = request(
                    restarted.url,
                    "POST",
                    "/v1/jobs",
                    {"task": "tests.tasks.add", "args": args},
                    {"Idempotency-Key": key},
                    conn=conn,
                )
                assert got.status == 202, got
                again[key] = got.json["id"]
        finally:
            conn.close()
        assert restarted.terminate() == 0
    finally:
        restarted.kill()
    changed = [key for key, job in acked.items() if again[key] != job]
    after = journal_ids(journal)
    second_jobs = sum(n - 1 for n in after.values())
    figures(
        f"HTTP kill-under-load clients={CLIENTS} sent={len(sent)} acked={len(acked)} "
        f"in_journal_at_kill={len(in_journal)} lost={len(lost)} retried={len(sent)} "
        f"changed_id={len(changed)} second_jobs={second_jobs} jobs_after={len(after)}"
    )
    assert lost == []
    assert changed == []
    assert second_jobs == 0
    assert len(after) == len(sent)  # every key one job: the accepted ones and the retried ones


def test_forward_serve_reports_results_after_flushall_and_stops_on_sigterm(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str]
) -> None:
    journal = tmp_path / "journal"
    ensure_journal_dir(journal)
    with open(tmp_path / "forward.log", "ab") as log:
        forward = subprocess.Popen(
            [sys.executable, "-m", "hybridq", "forward", "--journal", str(journal), "--redis",
             redis_server.url, "--serve", "127.0.0.1:0", "--serve-allow", "tests"],
            env=subprocess_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
        )  # fmt: skip
    worker = WorkerProcess(
        [
            sys.executable,
            "-m",
            "hybridq",
            "worker",
            "--redis",
            redis_server.url,
            "--processes",
            "1",
            "default",
        ],
        env=subprocess_env,
        log_path=tmp_path / "worker.log",
        cwd=tmp_path,
    )
    try:
        assert forward.stdout is not None
        line = forward.stdout.readline().decode()
        assert line.startswith("listening on "), (tmp_path / "forward.log").read_text()
        base = line.split()[-1]
        posted = request(base, "POST", "/v1/jobs", {"task": "tests.tasks.add", "args": [2, 3]},
                         {"Idempotency-Key": "sum-2-3"})  # fmt: skip
        assert posted.status == 202
        location = posted.headers["location"]

        def finished() -> dict[str, object] | None:
            got = request(base, "GET", location).json
            return got if got["status"] == "finished" else None

        done = wait_until(finished, timeout=60, what="the job finished")
        assert (done["result"], done["attempt"]) == (5, 1)
        with redis_client(redis_server) as client:
            client.flushall()
        after = request(base, "GET", location)
        assert after.status == 200
        assert {k: after.json[k] for k in ("status", "result", "attempt")} == {
            "status": "finished",
            "result": 5,
            "attempt": 1,
        }
        replay = request(base, "POST", "/v1/jobs", {"task": "tests.tasks.add", "args": [2, 3]},
                         {"Idempotency-Key": "sum-2-3"})  # fmt: skip
        assert replay.json["id"] == posted.json["id"]
        metrics = request(base, "GET", "/metrics").raw.decode()
        assert "hybridq_succeeded_total 1.0" in metrics  # the forwarder's own collector
        assert 'hybridq_http_posts_total{code="202"} 2.0' in metrics
        assert request(base, "GET", "/v1/stats").json["succeeded"] == 1
        start = time.monotonic()
        forward.send_signal(signal.SIGTERM)
        assert forward.wait(30) == 0
        assert time.monotonic() - start < 20
    finally:
        worker.kill()
        if forward.poll() is None:
            os.kill(forward.pid, signal.SIGKILL)
            forward.wait()
        if forward.stdout is not None:
            forward.stdout.close()
    text = (tmp_path / "forward.log").read_text()
    assert "stopped; checkpoint saved" in text
    assert "Traceback" not in text
