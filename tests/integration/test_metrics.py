"""``hybridq forward --metrics-port``: the endpoint is scraped and parsed; ``--log-format json``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

from hybridq import Queue
from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from tests.conftest import PYTHON
from tests.support.processes import ForwarderProcess, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or sample.name.endswith("_count")
    }


def test_metrics_endpoint_reports_the_forwarders_numbers(
    tmp_path: Path,
    journal_dir: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    ensure_journal_dir(journal_dir)
    port = free_port()
    forwarder = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env=subprocess_env,
        log_path=tmp_path / "forwarder.log",
        extra_args=("--metrics-port", str(port), "--capacity", "1000"),
    )
    try:
        queue = Queue("default", journal_dir)
        for i in range(20):
            queue.enqueue("tests.tasks.add", i, i)
        wait_until(lambda: redis_server.client().llen("rq:queue:default") == 20, what="20 jobs in RQ")
        conn = redis_server.client()
        rq_queue = RQQueue("default", connection=conn, serializer=JSONSerializer)
        SimpleWorker([rq_queue], connection=conn, serializer=JSONSerializer).work(burst=True)
        metrics = wait_until(
            lambda: (m := scrape(port)).get("hybridq_succeeded_total") == 20 and m,
            what="20 succeeded in metrics",
        )
    finally:
        forwarder.terminate()
    assert metrics["hybridq_accepted_total"] == 20
    assert metrics["hybridq_forwarded_total"] == 20
    assert metrics["hybridq_failed_total"] == 0
    assert metrics["hybridq_pending"] == 0
    assert metrics["hybridq_capacity"] == 1000
    assert metrics["hybridq_redis_up"] == 1
    assert metrics["hybridq_journal_bytes"] > 0
    assert metrics["hybridq_fsync_seconds_count"] > 0
    figures(
        f"METRICS scraped accepted={metrics['hybridq_accepted_total']:.0f} "
        f"succeeded={metrics['hybridq_succeeded_total']:.0f} fsyncs={metrics['hybridq_fsync_seconds_count']:.0f}"
    )


def test_logs_are_json_lines_and_never_carry_the_password(
    journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    ensure_journal_dir(journal_dir)
    url = "redis://user:s3cret@127.0.0.1:1/0"  # nothing listens: the forwarder logs the outage
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "hybridq",
            "--log-format",
            "json",
            "forward",
            "--journal",
            str(journal_dir),
            "--redis",
            url,
        ],
        env=subprocess_env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert lines, stderr
    assert {"ts", "level", "logger", "msg"} <= set(lines[0])
    assert any("transport unavailable" in line["msg"] for line in lines)
    assert "s3cret" not in stderr


def test_the_redis_password_can_come_from_a_file(
    tmp_path: Path, journal_dir: Path, make_redis_server, subprocess_env: dict[str, str]
) -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli
    from hybridq.transport.redisurl import with_password

    secret = "s3cr:et/@pw"  # characters a URL needs escaped
    server = make_redis_server()
    server.client().config_set("requirepass", secret)  # not on its command line: ps shows that
    password_file = tmp_path / "redis-password"
    password_file.write_text(secret + "\n")
    password_file.chmod(0o600)
    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    runner = CliRunner()
    without = runner.invoke(cli, ["status", "--json", "--journal", str(journal_dir), "--redis", server.url])
    assert json.loads(without.stdout)["redis"]["up"] is False  # NOAUTH
    with_file = runner.invoke(
        cli,
        ["status", "--json", "--journal", str(journal_dir), "--redis", server.url],
        env={"HYBRIDQ_REDIS_PASSWORD_FILE": str(password_file)},
    )
    out = json.loads(with_file.stdout)
    assert out["redis"]["up"] is True
    assert secret not in with_file.stdout  # the URL is printed redacted
    worker = runner.invoke(
        cli,
        ["worker", "--burst", "--simple", "--redis", server.url, "--redis-password-file", str(password_file)],
    )
    assert worker.exit_code == 0, worker.output
    assert with_password("redis://u@h:1/0", "p@ss") == "redis://u:p%40ss@h:1/0"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    refused = runner.invoke(
        cli, ["worker", "--burst", "--redis", server.url, "--redis-password-file", str(empty)]
    )
    assert refused.exit_code == 1
    assert "password file is empty" in refused.output
