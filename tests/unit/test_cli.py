"""The minimal CLI: ``hybridq journal verify | dump`` and ``python -m hybridq``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridq.cli import EXIT_CORRUPT, EXIT_ERROR, cli
from hybridq.journal import JournalWriter
from hybridq.testing.embedded import RedisServer

from tests.conftest import PYTHON


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def journal(journal_dir: Path) -> Path:
    with JournalWriter(journal_dir) as writer:
        writer.append(b'{"job": 1}')
        writer.append(b"\xff\x00")
    return journal_dir


def test_verify_a_healthy_journal(runner: CliRunner, journal: Path) -> None:
    result = runner.invoke(cli, ["journal", "verify", "--journal", str(journal)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: 2 records in 1 segments")


def test_verify_json_and_the_environment_variable(runner: CliRunner, journal: Path) -> None:
    result = runner.invoke(cli, ["journal", "verify", "--json"], env={"HYBRIDQ_JOURNAL": str(journal)})
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["ok"] is True
    assert out["records"] == 2
    assert out["torn_tails"] == []


def test_verify_reports_corruption_with_file_offset_and_records(runner: CliRunner, journal: Path) -> None:
    (segment,) = journal.glob("*.wal")
    raw = bytearray(segment.read_bytes())
    raw[64 + 22] ^= 1  # inside the first record's payload
    segment.chmod(0o600)
    segment.write_bytes(bytes(raw))
    segment.chmod(0o400)
    result = runner.invoke(cli, ["journal", "verify", "--journal", str(journal)])
    assert result.exit_code == EXIT_CORRUPT
    assert str(segment) in result.output
    assert "offset 64" in result.output
    assert "records 1" in result.output or "sequence 1" in result.output
    assert "Traceback" not in result.output


def test_a_missing_journal_is_one_line_and_exit_1(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(cli, ["journal", "verify", "--journal", str(tmp_path / "none")])
    assert result.exit_code == EXIT_ERROR
    assert result.output.strip().count("\n") == 0
    assert "does not exist" in result.output
    assert not (tmp_path / "none").exists()  # verify never creates anything


def test_dump_prints_one_json_line_per_record(runner: CliRunner, journal: Path) -> None:
    result = runner.invoke(cli, ["journal", "dump", "--journal", str(journal)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [line["seq"] for line in lines] == [1, 2]
    assert lines[0]["payload"] == '{"job": 1}'
    assert lines[1]["payload_b64"] == "/wA="


@pytest.mark.parametrize(
    "args",
    [
        *(
            [],
            ["forward"],
            ["worker"],
            ["enqueue"],
            ["status"],
            ["doctor"],
            ["demo"],
            ["journal"],
            ["failed"],
        ),
        *(["journal", "verify"], ["journal", "dump"], ["journal", "repair"]),
        *(["failed", "list"], ["failed", "show"], ["failed", "requeue"]),
    ],
)
def test_every_command_has_help_with_an_example(runner: CliRunner, args: list[str]) -> None:
    result = runner.invoke(cli, [*args, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output


def test_python_dash_m_is_the_same_command(journal: Path, subprocess_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [PYTHON, "-m", "hybridq", "journal", "verify", "--journal", str(journal)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: 2 records")


def test_verify_shows_a_progress_bar_on_large_journals(
    runner: CliRunner, journal: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hybridq.cli.journal.PROGRESS_THRESHOLD_BYTES", 1)
    result = runner.invoke(cli, ["journal", "verify", "--journal", str(journal)])
    assert result.exit_code == 0, result.output
    assert "scanning" in result.output


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@h:6379/0", "redis://***@h:6379/0"),
        ("redis://user:s3cret@h/0?db=1", "redis://user:***@h/0?db=1"),
        ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        (
            "rediss://h:6380/0?ssl_ca_certs=/ca.pem&ssl_password=k3y&ssl_cert_reqs=required",
            "rediss://h:6380/0?ssl_ca_certs=/ca.pem&ssl_password=***&ssl_cert_reqs=required",
        ),
        # Percent-encoded parameter names are decoded by redis-py: redact by the decoded name.
        ("redis://h/0?pass%77ord=s3cret", "redis://h/0?pass%77ord=***"),
        ("redis://h/0?%70%61%73%73%77%6F%72%64=s3cret&db=1", "redis://h/0?%70%61%73%73%77%6F%72%64=***&db=1"),
        ("redis://h/0?PASSWORD=s3cret", "redis://h/0?PASSWORD=***"),
        ("redis://h/0?ssl_pass%77ord=s3cret", "redis://h/0?ssl_pass%77ord=***"),
        ("redis://h/0?pass+word=s3cret&password%00=x", "redis://h/0?pass+word=***&password%00=***"),
        ("redis://h/0?db=1&&password", "redis://h/0?db=1&&password=***"),
        ("redis://u:p?ss@h/0", "redis://u:***@h/0"),
        # Userinfo: whatever follows the user name, however encoded, and a user-less secret.
        ("redis://us%3Aer:s3cret@h/0", "redis://us%3Aer:***@h/0"),
        ("redis://s3cret@h/0", "redis://***@h/0"),
        ("redis://u:p@ss@h/0", "redis://u:***@h/0"),
        ("REDIS://u:s3cret@h/0", "REDIS://u:***@h/0"),
        ("redis://h/0#password=s3cret", "redis://h/0#***"),
        # An "@" in a query value is not the end of a userinfo (it showed what followed it).
        ("redis://h:6379/0?password=abc@TOPSECRET", "redis://h:6379/0?password=***"),
        ("redis://u:pw@h/0?password=a@b&db=1", "redis://u:***@h/0?password=***&db=1"),
        (
            "redis+sentinel://h1:26379,h2/mymaster/0?sentinel_password=abc@TOPSECRET",
            "redis+sentinel://h1:26379,h2/mymaster/0?sentinel_password=***",
        ),
    ],
)
def test_redis_passwords_are_redacted(url: str, shown: str) -> None:
    from hybridq.transport.redisurl import redact_url

    assert redact_url(url) == shown


def make_failed_job(journal_dir: Path) -> str:
    """One job that failed for good, through the in-memory transport."""
    from hybridq import Queue
    from hybridq.forwarder.loop import Forwarder
    from hybridq.transport import MemoryTransport

    from tests import tasks

    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()

        def boom(env: object, attempt: int) -> None:
            raise ValueError("boom")

        transport.work(func=boom)
        forwarder.step()
    return job.id


def test_failed_list_show_and_requeue(runner: CliRunner, journal_dir: Path) -> None:
    job_id = make_failed_job(journal_dir)
    listed = runner.invoke(cli, ["failed", "list", "--json", "--journal", str(journal_dir)])
    assert listed.exit_code == 0, listed.output
    [line] = listed.output.splitlines()
    assert json.loads(line)["id"] == job_id
    shown = runner.invoke(cli, ["failed", "show", job_id, "--journal", str(journal_dir)])
    assert json.loads(shown.output)["error"] == "ValueError: boom"
    assert json.loads(shown.output)["args"] == [1, 2]
    requeued = runner.invoke(cli, ["failed", "requeue", job_id, "--journal", str(journal_dir)])
    assert requeued.exit_code == 0, requeued.output
    assert requeued.stdout.strip() == job_id
    again = runner.invoke(cli, ["failed", "list", "--journal", str(journal_dir)])
    assert again.stdout == ""


def test_failed_requeue_of_an_unknown_id_writes_nothing(runner: CliRunner, journal_dir: Path) -> None:
    job_id = make_failed_job(journal_dir)
    result = runner.invoke(cli, ["failed", "requeue", job_id, "nope", "--journal", str(journal_dir)])
    assert result.exit_code == EXIT_ERROR
    assert "job nope is not a failed job" in result.output
    listed = runner.invoke(cli, ["failed", "list", "--json", "--journal", str(journal_dir)])
    assert json.loads(listed.output.splitlines()[0])["id"] == job_id  # still listed: nothing requeued
    usage = runner.invoke(cli, ["failed", "requeue", "--journal", str(journal_dir)])
    assert usage.exit_code == 2
    missing = runner.invoke(cli, ["failed", "show", "nope", "--journal", str(journal_dir)])
    assert missing.exit_code == EXIT_ERROR


def test_failed_list_of_a_missing_journal_is_one_line(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(cli, ["failed", "list", "--journal", str(tmp_path / "nope")])
    assert result.exit_code == EXIT_ERROR
    assert result.output.count("\n") == 1


def test_worker_burst_with_unreachable_redis_exits_1(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["worker", "--burst", "--redis", "redis://127.0.0.1:1/0", "default"])
    assert result.exit_code == 1, result.output


def test_worker_refuses_a_bad_queue_name(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["worker", "--burst", "../etc"])
    assert result.exit_code == EXIT_ERROR
    assert "invalid queue name" in result.output


def test_forward_refuses_a_lease_out_of_range(runner: CliRunner, journal_dir: Path) -> None:
    result = runner.invoke(cli, ["forward", "--lease", "0", "--journal", str(journal_dir)])
    assert result.exit_code == 2


def test_enqueue_prints_the_job_id_and_writes_the_job(runner: CliRunner, journal_dir: Path) -> None:
    from hybridq.envelope.model import Envelope
    from hybridq.journal import JournalReader

    result = runner.invoke(
        cli,
        [
            *("enqueue", "tests.tasks.add", "1", "2", "--key", "k:1", "--queue", "q", "--retry", "3"),
            *("--journal", str(journal_dir)),
        ],
    )
    assert result.exit_code == 0, result.output
    [record] = list(JournalReader(str(journal_dir)).records())
    env = Envelope.from_bytes(record.payload)
    assert env.id == result.stdout.strip()
    assert (env.func, env.args, env.queue, env.idempotency_key, env.max_attempts) == (
        "tests.tasks.add",
        (1, 2),
        "q",
        "k:1",
        3,
    )


def test_enqueue_with_kwargs_and_a_string(runner: CliRunner, journal_dir: Path) -> None:
    from hybridq.envelope.model import Envelope
    from hybridq.journal import JournalReader

    args = ["enqueue", "tests.tasks.record", '"/tmp/x"', "--kwargs", '{"token": "t"}', "--delay", "60"]
    result = runner.invoke(cli, [*args, "--journal", str(journal_dir)])
    assert result.exit_code == 0, result.output
    [record] = list(JournalReader(str(journal_dir)).records())
    env = Envelope.from_bytes(record.payload)
    assert (env.args, dict(env.kwargs)) == (("/tmp/x",), {"token": "t"})
    assert env.run_at is not None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tests.tasks.add", "bob"], "is not JSON (a string needs double quotes"),
        (["tests.tasks.add", "--kwargs", "[1]"], "must be a JSON object"),
        (["tests.tasks.add", "--kwargs", "{nope"], "is not JSON"),
    ],
)
def test_enqueue_refuses_bad_arguments_and_writes_nothing(
    runner: CliRunner, journal_dir: Path, args: list[str], message: str
) -> None:
    result = runner.invoke(cli, ["enqueue", *args, "--journal", str(journal_dir)])
    assert result.exit_code == 2
    assert message in result.output
    assert not journal_dir.exists() or list(journal_dir.glob("*.wal")) == []


def test_enqueue_refuses_a_function_that_is_not_a_dotted_path(runner: CliRunner, journal_dir: Path) -> None:
    result = runner.invoke(cli, ["enqueue", "add", "1", "--journal", str(journal_dir)])
    assert result.exit_code == EXIT_ERROR
    assert "not a dotted path" in result.output
    assert result.output.count("\n") == 1


def test_status_text_and_watch_json(
    runner: CliRunner, journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq import Queue

    Queue("emails", journal=journal_dir).enqueue("tests.tasks.add", 1, 2)
    text = runner.invoke(cli, ["status", "--journal", str(journal_dir)])
    assert text.exit_code == 0, text.output
    assert "pending per queue: emails=1" in text.output
    sleeps: list[float] = []

    def stop_after_two(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt  # Ctrl-C

    monkeypatch.setattr("time.sleep", stop_after_two)
    watched = runner.invoke(
        cli, ["status", "--json", "--watch", "--interval", "0.5", "--journal", str(journal_dir)]
    )
    assert watched.exit_code == 0, watched.output
    lines = watched.output.splitlines()
    assert len(lines) == 2
    assert all(json.loads(line)["pending"] == 1 for line in lines)
    assert sleeps == [0.5, 0.5]


def test_journal_repair_dry_run_then_accept_loss(runner: CliRunner, journal_dir: Path) -> None:
    from hybridq.journal.recovery import verify

    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        for i in range(60):
            writer.append(b"x" * 100 + str(i).encode())
    first = sorted(journal_dir.glob("*.wal"))[0]
    first.chmod(0o600)
    data = bytearray(first.read_bytes())
    data[400] ^= 0xFF  # a flipped bit in a record of a sealed segment
    first.write_bytes(bytes(data))
    first.chmod(0o400)
    before = runner.invoke(cli, ["journal", "verify", "--journal", str(journal_dir)])
    assert before.exit_code == EXIT_CORRUPT
    dry = runner.invoke(cli, ["journal", "repair", "--journal", str(journal_dir)])
    assert dry.exit_code == EXIT_CORRUPT, dry.output
    assert "would drop" in dry.output
    assert "dry run: nothing changed" in dry.output
    assert first.read_bytes() == bytes(data)
    done = runner.invoke(cli, ["journal", "repair", "--accept-loss", "--journal", str(journal_dir)])
    assert done.exit_code == 0, done.output
    assert "dropped" in done.output
    assert "backup" in done.output
    verify(journal_dir)
    again = runner.invoke(cli, ["journal", "repair", "--journal", str(journal_dir)])
    assert again.exit_code == 0
    assert "nothing to repair" in again.output


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:1/0?pass%77ord=s3cret",
        "redis://127.0.0.1:1/0?%70assword=s3cret",
        "redis://u:s3cret@127.0.0.1:1/0",
        "redis://s3cret@127.0.0.1:1/0",
    ],
)
def test_an_encoded_password_never_reaches_logs_or_status_json(
    url: str, journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    from hybridq import Queue

    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    status = subprocess.run(
        [PYTHON, "-m", "hybridq", "status", "--json", "--journal", str(journal_dir), "--redis", url],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["redis"]["up"] is False
    worker = subprocess.run(
        [PYTHON, "-m", "hybridq", "worker", "--burst", "--redis", url, "default"],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "127.0.0.1:1" in worker.stderr  # it did log the URL
    assert "s3cret" not in status.stdout + status.stderr + worker.stdout + worker.stderr


def run_cli(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``python -m hybridq ARGS`` in a child process (its stderr is what a user sees)."""
    return subprocess.run(
        [PYTHON, "-m", "hybridq", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == EXIT_ERROR, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hybridq: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert "s3cret" not in proc.stderr + proc.stdout


BAD_REDIS_URLS = [
    "http://127.0.0.1:6379/0",
    "redis://127.0.0.1:notaport/0",
    "redis://127.0.0.1:6379/zero",
    "redis://127.0.0.1:6379/0/1",
    "redis://127.0.0.1:6379/0?socket_timeout=soon",
    "redis://127.0.0.1:6379/0?PASSWORD=s3cret",
    "redis://127.0.0.1:6379/0?no_such_option=1",
    "redis://:s3cret@127.0.0.1:99999/0",
]


@pytest.mark.parametrize("url", BAD_REDIS_URLS)
@pytest.mark.parametrize("command", ["status", "doctor", "worker", "forward"])
def test_an_invalid_redis_url_is_one_line_and_exit_1(
    command: str, url: str, journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    from hybridq import Queue

    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    args = {
        "status": ["status", "--journal", str(journal_dir)],
        "doctor": ["doctor", "--journal", str(journal_dir)],
        "worker": ["worker", "--burst"],
        "forward": ["forward", "--journal", str(journal_dir)],
    }[command]
    proc = run_cli(subprocess_env, *args, "--redis", url)
    assert_one_line_error(proc, "invalid Redis URL")
    if command != "status":
        return
    # The same through the environment variable.
    proc = run_cli({**subprocess_env, "HYBRIDQ_REDIS_URL": url}, *args)
    assert_one_line_error(proc, "invalid Redis URL")


@pytest.fixture
def acl_redis(redis_server: RedisServer) -> RedisServer:
    """The private server with two ACL users: ``hq`` (allowed everything) and ``nokeys``."""
    admin = redis_server.client()
    try:
        admin.execute_command("ACL", "SETUSER", "hq", "on", ">s3cret", "~*", "&*", "+@all")
        # Logs in, but may touch no key hybridq or RQ uses.
        admin.execute_command("ACL", "SETUSER", "nokeys", "on", ">s3cret", "~other:*", "&*", "+@all")
    finally:
        admin.close()
    return redis_server


def refused_urls(server: RedisServer) -> dict[str, str]:
    base = f"127.0.0.1:{server.port}"
    return {
        "wrong password": f"redis://hq:wrong@{base}/0",
        "unknown user": f"redis://nobody:s3cret@{base}/0",
        "database out of range": f"redis://hq:s3cret@{base}/99",
        "ACL denies the keys": f"redis://nokeys:s3cret@{base}/0",
    }


@pytest.mark.parametrize(
    "case", ["wrong password", "unknown user", "database out of range", "ACL denies the keys"]
)
@pytest.mark.parametrize("command", ["forward", "worker", "worker --burst", "doctor"])
def test_a_configuration_redis_refuses_exits_instead_of_retrying(
    command: str, case: str, acl_redis: RedisServer, journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    from hybridq import Queue

    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    url = refused_urls(acl_redis)[case]
    if command == "doctor":
        # doctor needs a checkpoint: forward once with a user Redis accepts.
        good = url.replace("nokeys:", "hq:").replace(":wrong@", ":s3cret@").replace("nobody:", "hq:")
        good = good.rsplit("/", 1)[0] + "/0"
        from hybridq.forwarder.loop import Forwarder
        from hybridq.transport.rq import RQTransport

        transport = RQTransport(good)
        with Forwarder(journal_dir, transport) as forwarder:
            forwarder.step()
        transport.close()
    args = {
        "forward": ["forward", "--journal", str(journal_dir)],
        "worker": ["worker", "default"],
        "worker --burst": ["worker", "--burst", "default"],
        "doctor": ["doctor", "--journal", str(journal_dir)],
    }[command]
    proc = run_cli(subprocess_env, *args, "--redis", url, timeout=30)
    assert_one_line_error(proc, "Redis refused")


def test_worker_burst_with_redis_down_says_it_exits_without_retrying(subprocess_env: dict[str, str]) -> None:
    proc = run_cli(subprocess_env, "worker", "--burst", "--redis", "redis://127.0.0.1:1/0", "default")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "--burst does not wait for it; exiting 1" in proc.stderr, proc.stderr
    assert "retrying" not in proc.stderr


def test_journal_dump_into_head_exits_quietly(journal_dir: Path, subprocess_env: dict[str, str]) -> None:
    with JournalWriter(journal_dir) as writer:
        for n in range(5000):  # far more than a pipe buffer holds
            writer.append(b'{"job": %d, "pad": "%s"}' % (n, b"x" * 100))
    proc = subprocess.run(
        f"'{PYTHON}' -m hybridq journal dump --journal '{journal_dir}' | head -1; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    assert json.loads(proc.stdout)["seq"] == 1


def test_rq_shutdown_command_stops_the_worker_with_a_warning(
    redis_server: RedisServer, subprocess_env: dict[str, str]
) -> None:
    """Anyone who may PUBLISH on Redis can stop a worker: it must say so, not exit 0 silently."""
    import time

    from rq.command import send_shutdown_command

    proc = subprocess.Popen(
        [PYTHON, "-m", "hybridq", "worker", "--name", "w-shut", "--redis", redis_server.url, "default"],
        env=subprocess_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    conn = redis_server.client()
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            # Until its pub/sub subscription is up, a command is lost: send it again.
            if conn.pubsub_numsub("rq:pubsub:w-shut")[0][1]:
                send_shutdown_command(conn, "w-shut")
            time.sleep(0.2)
        _, stderr = proc.communicate(timeout=30)
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # closes its pipe (left open, it failed a later test at collection)
    assert proc.returncode == 0, stderr
    warnings = [line for line in stderr.splitlines() if "WARNING" in line and "shutdown command" in line]
    assert any("rq:pubsub:w-shut" in line and "Restart=always" in line for line in warnings), stderr


@pytest.mark.parametrize("func", ["__main__.f", "__main__.Klass.method"])
def test_enqueue_refuses_a_function_in_main(runner: CliRunner, journal_dir: Path, func: str) -> None:
    result = runner.invoke(cli, ["enqueue", func, "1", "--journal", str(journal_dir)])
    assert result.exit_code == EXIT_ERROR, result.output
    assert "__main__" in result.output
    assert result.output.count("\n") == 1
    assert not journal_dir.exists() or list(journal_dir.glob("*.wal")) == []


#: ``hybridq worker`` with RQ's signal handlers installed a second late: RQ subscribes to its
#: command channel before it installs them, and a command in between met Python's own SIGINT
#: handler (KeyboardInterrupt: "Aborted!", exit 1). The delay makes that window certain.
_LATE_SIGNAL_HANDLERS = """
import sys, time
from rq.worker.base import BaseWorker
install = BaseWorker._install_signal_handlers
def late(self):
    time.sleep(1.0)
    install(self)
BaseWorker._install_signal_handlers = late
from hybridq.cli import main
sys.argv = ["hybridq", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("mode", [[], ["--rq"]], ids=["pool", "rq"])
def test_an_rq_shutdown_command_before_rqs_signal_handlers_stops_the_worker_warmly(
    redis_server: RedisServer, subprocess_env: dict[str, str], mode: list[str]
) -> None:
    import json
    import time

    proc = subprocess.Popen(
        [
            PYTHON,
            "-c",
            _LATE_SIGNAL_HANDLERS,
            "worker",
            *mode,
            "--name",
            "w-early",
            "--redis",
            redis_server.url,
            "q",
        ],
        env=subprocess_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    conn = redis_server.client()
    try:
        deadline = time.monotonic() + 30
        while not conn.pubsub_numsub("rq:pubsub:w-early")[0][1] and time.monotonic() < deadline:
            time.sleep(0.02)
        conn.publish("rq:pubsub:w-early", json.dumps({"command": "shutdown"}))
        _, stderr = proc.communicate(timeout=30)
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # closes its pipe (left open, it failed a later test at collection)
    assert proc.returncode == 0, stderr


#: Passwords with an unencoded "/", "?" or "#" (issue 27: a piece of each reached the error line).
MISPLACED = [
    "redis://user:se/cretPIECE@127.0.0.1:1/0",
    "redis://user:se?cretPIECE@127.0.0.1:1/0",
    "redis://user:se#cretPIECE@127.0.0.1:1/0",
    "rediss://user:se?a=cretPIECE@127.0.0.1:1/0",
    "redis://:se/cretPIECE@127.0.0.1:1/0",
    "redis+sentinel://user:se/cretPIECE@127.0.0.1:1/svc",
    "redis+sentinel://user:se?a=cretPIECE@127.0.0.1:1/svc",
]


@pytest.mark.parametrize("url", MISPLACED)
def test_a_password_with_an_unencoded_slash_query_or_hash_is_never_shown(url: str) -> None:
    from hybridq.errors import InvalidRedisURL
    from hybridq.transport.redisurl import check_url, redact_url

    with pytest.raises(InvalidRedisURL) as caught:
        check_url(url)
    for shown in (str(caught.value), redact_url(url)):
        assert "cret" not in shown, shown
        assert "PIECE" not in shown, shown
        assert "'se'" not in shown, shown
    assert "percent-encoded" in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379/0?password=abc@TOPSECRET",
        "redis://u:pw@h/0?password=a@b&db=1",
        "redis+sentinel://h1:26379,h2/mymaster/0?sentinel_password=abc@TOPSECRET",
        "redis://u:p%2Fw%3Fo%23rd@h:6379/0",
    ],
)
def test_an_at_in_a_query_value_or_an_encoded_password_is_still_a_url(url: str) -> None:
    from hybridq.transport.redisurl import check_url

    assert check_url(url) == url


def test_a_misplaced_password_through_the_command_line_is_one_line(
    journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    proc = run_cli(subprocess_env, "doctor", "--journal", str(journal_dir), "--redis", MISPLACED[0])
    assert_one_line_error(proc, "percent-encoded")
    assert "cret" not in proc.stdout + proc.stderr


#: What a task's error (or anyone writing to Redis) may hold: clear the screen, retitle the
#: terminal, a hyperlink, a right-to-left override that reverses what follows.
ESCAPES = "\x1b[2J\x1b]0;pwned\x07\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\ \u202etxt.exe\x9b31m"


def _no_control_characters(text: str) -> None:
    import unicodedata

    bad = [c for c in text if c not in "\n\t" and unicodedata.category(c) in ("Cc", "Cf")]
    assert not bad, [hex(ord(c)) for c in bad]


def test_failed_list_shows_control_characters_escaped(runner: CliRunner, journal_dir: Path) -> None:
    """Issue 27: ``failed list`` printed a task's error text raw: escape sequences reached the terminal."""
    from hybridq import Queue
    from hybridq.forwarder.loop import Forwarder
    from hybridq.transport import MemoryTransport

    from tests import tasks

    Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()

        def hostile(env: object, attempt: int) -> None:
            raise ValueError(ESCAPES)

        transport.work(func=hostile)
        forwarder.step()
    listed = runner.invoke(cli, ["failed", "list", "--journal", str(journal_dir)])
    assert listed.exit_code == 0, listed.output
    _no_control_characters(listed.stdout)
    assert "\\x1b[2J" in listed.stdout  # shown, escaped: what the error said stays readable


def test_doctor_shows_a_waiting_reason_with_control_characters_escaped(
    runner: CliRunner, journal_dir: Path, redis_server: RedisServer
) -> None:
    from hybridq import Queue
    from hybridq.forwarder.loop import Forwarder
    from hybridq.transport.rq import RQTransport
    from hybridq.worker import waiting

    job = Queue(journal=journal_dir).enqueue("tests.tasks.add", 1, 2)
    transport = RQTransport(redis_server.url)
    try:
        with Forwarder(journal_dir, transport) as forwarder:
            forwarder.step()
    finally:
        transport.close()
    conn = redis_server.client()
    try:  # what a worker (or anyone who writes to Redis) lists
        waiting.record(conn, job.id, {"func": f"tasks.{ESCAPES}", "reason": ESCAPES}, lease_s=30)
    finally:
        conn.close()
    out = runner.invoke(cli, ["doctor", "--journal", str(journal_dir), "--redis", redis_server.url])
    assert "waiting for a worker" in out.stdout, out.output
    _no_control_characters(out.stdout)
