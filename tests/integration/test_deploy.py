"""The files in ``deploy/``, checked as far as this machine allows.

* The systemd units: ``systemd-analyze verify`` (and ``security --offline``) when systemd-analyze
  is installed; a structural check of the keys that matter always runs.
* ``docker-compose.yml``: parsed by a strict parser for the YAML subset it uses (PyYAML is not a
  dependency), cross-checked with PyYAML when some Python here has it; its commands are checked.
* The ``Procfile``: a forwarder and a worker line.
* Every command the files run is accepted by the real ``hybridq`` CLI (``--help`` appended).
* ``deploy/redis/redis.conf`` and ``users.acl``: a real redis-server (6.2, from the ``embedded``
  extra) starts with the shipped files, and as the ``hybridq`` ACL user a whole cycle runs
  (enqueue, forward, RQ worker, harvest) while dangerous commands are refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.ops.status import collect_status
from hybridq.testing.embedded import find_redis_server
from hybridq.transport.rq import RQTransport
from hybridq.worker import run_worker
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from tests import tasks

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNITS = DEPLOY / "systemd"
FORWARDER_UNIT = UNITS / "hybridq-forwarder.service"
WORKER_UNIT = UNITS / "hybridq-worker@.service"
REDIS_CONF = DEPLOY / "redis" / "redis.conf"
USERS_ACL = DEPLOY / "redis" / "users.acl"
#: Where the units expect hybridq to be installed.
INSTALLED_HYBRIDQ = "/opt/hybridq/venv/bin/hybridq"
#: The password hash users.acl ships with: a SHA-256 no password has, so nobody can log in.
PLACEHOLDER_HASH = "#" + "0" * 64
HYBRIDQ_BIN = str(Path(sys.executable).parent / "hybridq")
#: redis-py retries connection errors, and a refused login is one: fail at once instead.
NO_RETRY = Retry(NoBackoff(), 0)


# -- systemd units ------------------------------------------------------------------------------


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit file as {section: [(key, value), ...]} (keys may repeat, order kept)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):  # a continuation line
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"{path.name}:{number}: bad section header {line!r}"
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path.name}:{number}: assignment before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}:{number}: not KEY=value: {line!r}"
        assert re.fullmatch(r"[A-Za-z0-9]+", key.strip()), f"{path.name}:{number}: bad key {key!r}"
        current.append((key.strip(), value.strip()))
    assert not pending, f"{path.name}: ends in a continuation"
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= set {len(found)} times: {found}"
    return found[0]


def assert_hardened(unit: dict[str, list[tuple[str, str]]]) -> None:
    svc = "Service"
    assert one(unit, svc, "User") == "hybridq"
    assert one(unit, svc, "Group") == "hybridq"
    assert one(unit, svc, "ProtectSystem") == "strict"
    for key in ("ProtectHome", "PrivateTmp", "NoNewPrivileges", "PrivateDevices", "RestrictSUIDSGID"):
        assert one(unit, svc, key) == "yes", key
    assert one(unit, svc, "CapabilityBoundingSet") == ""
    # Always: an exit 0 nobody asked systemd for (RQ's pub/sub shutdown command, sent by anyone
    # who may PUBLISH on Redis) must not leave the service down. `systemctl stop` still stops it.
    assert one(unit, svc, "Restart") == "always"
    assert one(unit, svc, "RestartSec").endswith("s")
    assert one(unit, svc, "KillSignal") == "SIGTERM"
    # SIGTERM to the main process only: RQ's work-horse must not get it (it would kill the job).
    assert one(unit, svc, "KillMode") == "mixed"
    assert one(unit, svc, "TimeoutStopSec")
    # The Redis password comes from the environment file, never from the command line.
    assert "/etc/hybridq/hybridq.env" in [v.lstrip("-") for v in values(unit, svc, "EnvironmentFile")]
    assert "redis://" not in one(unit, svc, "ExecStart")
    assert "--redis" not in one(unit, svc, "ExecStart")
    # Nothing writable besides what StateDirectory= grants (the forwarder) or nothing (workers).
    assert values(unit, svc, "ReadWritePaths") == []
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_forwarder_unit_structure() -> None:
    unit = parse_unit(FORWARDER_UNIT)
    assert_hardened(unit)
    svc = "Service"
    assert shlex.split(one(unit, svc, "ExecStart")) == [INSTALLED_HYBRIDQ, "forward"]
    assert one(unit, svc, "StateDirectory") == "hybridq"
    assert one(unit, svc, "StateDirectoryMode") == "0700"
    assert one(unit, svc, "Environment") == "HYBRIDQ_JOURNAL=/var/lib/hybridq/journal"
    # A corrupt journal (3) or bad usage (2) is not retried in a loop.
    assert set(one(unit, svc, "RestartPreventExitStatus").split()) == {"2", "3"}


def test_worker_unit_structure() -> None:
    unit = parse_unit(WORKER_UNIT)
    assert_hardened(unit)
    svc = "Service"
    argv = shlex.split(one(unit, svc, "ExecStart"))
    assert argv == [INSTALLED_HYBRIDQ, "worker", "$HYBRIDQ_QUEUES"]
    assert one(unit, svc, "Environment") == "HYBRIDQ_QUEUES=%i"  # the instance name is the queue
    assert "/etc/hybridq/worker-%i.env" in [v.lstrip("-") for v in values(unit, svc, "EnvironmentFile")]
    # Workers run task code: they get no state directory, and the forwarder's is hidden.
    assert values(unit, svc, "StateDirectory") == []
    assert one(unit, svc, "InaccessiblePaths").lstrip("-") == "/var/lib/hybridq"
    # Longer than RQ's default job_timeout (180 s), so a warm shutdown can finish the job.
    assert int(one(unit, svc, "TimeoutStopSec").removesuffix("s")) > 180


def units_for_verify(tmp_path: Path) -> Path:
    """The units, with ExecStart pointing at this checkout's hybridq (verify checks it exists)."""
    directory = tmp_path / "units"
    directory.mkdir()
    for unit in (FORWARDER_UNIT, WORKER_UNIT):
        text = unit.read_text(encoding="utf-8")
        assert INSTALLED_HYBRIDQ in text
        (directory / unit.name).write_text(text.replace(INSTALLED_HYBRIDQ, HYBRIDQ_BIN), encoding="utf-8")
    return directory


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed; test_*_unit_structure checked the units instead",
)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    directory = units_for_verify(tmp_path)
    names = [directory / "hybridq-forwarder.service", directory / "hybridq-worker@emails.service"]
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "--generators=no", *map(str, names)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # verify exits 0 even for unknown keys or unparsable values: any output at all is a finding.
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")
    help_text = subprocess.run(
        ["systemd-analyze", "security", "--help"], capture_output=True, text=True, check=False
    ).stdout
    if "--offline" in help_text and "--threshold" in help_text:
        for name in names:
            # Exposure on systemd's 0-10 scale, times ten: at most 3.0 ("OK").
            sec = subprocess.run(
                ["systemd-analyze", "security", "--offline=yes", "--threshold=30", str(name)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert sec.returncode == 0, sec.stdout[-2000:] + sec.stderr


def test_sysusers_file_creates_the_hybridq_user(tmp_path: Path) -> None:
    lines = [
        line.split()
        for line in (UNITS / "hybridq.sysusers.conf").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert [line[:2] for line in lines] == [["u", "hybridq"]]
    if shutil.which("systemd-sysusers") is not None:
        root = tmp_path / "root"
        (root / "etc").mkdir(parents=True)
        proc = subprocess.run(
            ["systemd-sysusers", f"--root={root}", "--dry-run", str(UNITS / "hybridq.sysusers.conf")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert "Creating user 'hybridq'" in proc.stdout + proc.stderr


def env_assignments(name: str) -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in (UNITS / name).read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    )


def test_env_files_set_each_role_its_own_redis_user_and_nothing_secret_by_default() -> None:
    shared = env_assignments("hybridq.env")
    assert set(shared) == {"HYBRIDQ_ALLOW"}  # no Redis URL: each role has its own ACL user
    assert shared["HYBRIDQ_ALLOW"] != "*"  # the example must not allow everything
    for name, user in (("forwarder.env", "hybridq-forwarder"), ("worker.env", "hybridq-worker")):
        assignments = env_assignments(name)
        assert set(assignments) == {"HYBRIDQ_REDIS_URL"}
        url = redis.connection.parse_url(assignments["HYBRIDQ_REDIS_URL"])
        assert (url["username"], url["password"]) == (user, "CHANGE-ME")
    # Each unit reads the shared file, then its own role's.
    forwarder_files = [
        v.lstrip("-") for v in values(parse_unit(FORWARDER_UNIT), "Service", "EnvironmentFile")
    ]
    worker_files = [v.lstrip("-") for v in values(parse_unit(WORKER_UNIT), "Service", "EnvironmentFile")]
    assert forwarder_files == ["/etc/hybridq/hybridq.env", "/etc/hybridq/forwarder.env"]
    assert worker_files[:2] == ["/etc/hybridq/hybridq.env", "/etc/hybridq/worker.env"]


# -- docker-compose.yml and Procfile -------------------------------------------------------------


class YamlSubsetError(ValueError):
    pass


def parse_yaml_subset(text: str) -> Any:
    """Parse block mappings, block sequences of scalars, flow sequences and quoted scalars.

    Strict: tabs, odd indentation, duplicate keys and anything else outside the subset raise
    YamlSubsetError, so a file this accepts is valid YAML with the structure returned.
    """
    lines: list[tuple[int, int, str]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw:
            raise YamlSubsetError(f"line {number}: tab")
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        lines.append((number, len(raw) - len(raw.lstrip(" ")), stripped))
    pos = 0

    def scalar(number: int, text: str) -> Any:
        if text.startswith(("[", '"')):
            try:
                return json.loads(text)  # flow sequences of double-quoted strings are JSON
            except json.JSONDecodeError as exc:
                raise YamlSubsetError(f"line {number}: {exc}") from None
        if " #" in text:
            text = text.split(" #", 1)[0].rstrip()
        if text[:1] in "{'&*!|>%@`" or text.startswith("- ") or ": " in text:
            raise YamlSubsetError(f"line {number}: outside the subset: {text!r}")
        # YAML 1.1 (PyYAML, docker compose) reads these as booleans, null and integers.
        lowered = text.lower()
        if lowered in {"true", "yes", "on"}:
            return True
        if lowered in {"false", "no", "off"}:
            return False
        if lowered in {"null", "~"}:
            return None
        if re.fullmatch(r"[-+]?[0-9]+", text):
            return int(text)
        if re.fullmatch(r"[-+]?[0-9]*\.[0-9]+", text):
            raise YamlSubsetError(f"line {number}: a float, outside the subset: {text!r}")
        return text

    def block(indent: int) -> Any:
        nonlocal pos
        if lines[pos][2].startswith("- ") or lines[pos][2] == "-":
            items = []
            while pos < len(lines) and lines[pos][1] == indent and lines[pos][2].startswith("- "):
                items.append(scalar(lines[pos][0], lines[pos][2][2:].strip()))
                pos += 1
            return items
        mapping: dict[str, Any] = {}
        while pos < len(lines) and lines[pos][1] == indent:
            number, _, content = lines[pos]
            match = re.fullmatch(r"([A-Za-z0-9_.-]+):(?:\s+(.*))?", content)
            if match is None:
                raise YamlSubsetError(f"line {number}: expected `key: value`: {content!r}")
            key, rest = match.group(1), match.group(2)
            if key in mapping:
                raise YamlSubsetError(f"line {number}: duplicate key {key!r}")
            pos += 1
            if rest is not None and not rest.startswith("#"):
                mapping[key] = scalar(number, rest)
            elif pos < len(lines) and lines[pos][1] > indent:
                mapping[key] = block(lines[pos][1])
            else:
                mapping[key] = None
        return mapping

    if not lines or lines[0][1] != 0:
        raise YamlSubsetError("the document must start at column 0")
    result = block(0)
    if pos != len(lines):
        number, _, content = lines[pos]
        raise YamlSubsetError(f"line {number}: bad indentation: {content!r}")
    return result


def pyyaml_load(path: Path) -> tuple[str, Any] | None:
    """PyYAML's reading of ``path``: from this venv, else from a python3 on PATH; or None."""
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        pass
    else:
        return sys.executable, yaml.safe_load(path.read_text(encoding="utf-8"))
    for python in ("python3", "/usr/bin/python3"):
        exe = shutil.which(python)
        if exe is None:
            continue
        proc = subprocess.run(
            [exe, "-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))", path],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if proc.returncode == 0:
            return exe, json.loads(proc.stdout)
    return None


def test_yaml_subset_parser_rejects_what_it_does_not_understand() -> None:
    assert parse_yaml_subset('a:\n  b: ["x", "y"]\n  c:\n    - d\n    - e\nf:\ng: true\nh: 30s\ni: 7\n') == {
        "a": {"b": ["x", "y"], "c": ["d", "e"]},
        "f": None,
        "g": True,
        "h": "30s",
        "i": 7,
    }
    for bad in ("a:\n\tb: 1\n", "a: 1\na: 2\n", "a:\n  b: 1\n c: 2\n", "a: {b: 1}\n", "a: &x 1\n", " a: 1\n"):
        with pytest.raises(YamlSubsetError):
            parse_yaml_subset(bad)


def assert_cli_accepts(argv: list[str]) -> None:
    """``hybridq`` parses this command (``--help`` appended: nothing runs)."""
    assert argv[0] == "hybridq", argv
    proc = subprocess.run(
        [HYBRIDQ_BIN, *argv[1:], "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"


def test_docker_compose_file() -> None:
    path = DEPLOY / "docker-compose.yml"
    compose = parse_yaml_subset(path.read_text(encoding="utf-8"))
    checked = pyyaml_load(path)
    if checked is not None:
        assert checked[1] == compose, f"PyYAML ({checked[0]}) reads it differently"
    services = compose["services"]
    assert set(services) == {"redis", "forwarder", "worker"}
    assert compose["volumes"] == {"journal": None}

    redis_cmd = services["redis"]["command"]
    assert redis_cmd[:2] == ["redis-server", "/usr/local/etc/redis/redis.conf"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in services["redis"]["volumes"]}
    assert redis_cmd[redis_cmd.index("--aclfile") + 1] in mounts
    for source in mounts.values():
        assert (DEPLOY / source).is_file(), source

    forwarder, worker = services["forwarder"], services["worker"]
    assert forwarder["command"] == ["hybridq", "forward"]
    assert worker["command"][:2] == ["hybridq", "worker"]
    assert len(worker["command"]) > 2  # names its queues
    assert "journal:/var/lib/hybridq" in forwarder["volumes"]
    assert forwarder["environment"]["HYBRIDQ_JOURNAL"].startswith("/var/lib/hybridq/")
    for service, role in ((forwarder, "forwarder"), (worker, "worker")):
        assert_cli_accepts(service["command"])
        url = service["environment"]["HYBRIDQ_REDIS_URL"]
        # Each role its own ACL user; no password in the file.
        assert url.startswith(f"redis://hybridq-{role}:${{HYBRIDQ_{role.upper()}_REDIS_PASSWORD"), url
        assert url.endswith("@redis:6379/0")
        assert service["stop_signal"] == "SIGTERM"
        assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
        assert service["depends_on"] == ["redis"]
    assert (ROOT / forwarder["build"]["dockerfile"]).is_file()


def test_procfile() -> None:
    entries = {}
    for line in (DEPLOY / "Procfile").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, command = line.partition(":")
            assert sep, line
            assert re.fullmatch(r"[a-z][a-z0-9_-]*", name), line
            entries[name] = shlex.split(command)
    assert set(entries) == {"forwarder", "worker"}
    assert entries["forwarder"][:2] == ["hybridq", "forward"]
    assert entries["worker"][:2] == ["hybridq", "worker"]
    for argv in entries.values():
        assert_cli_accepts(argv)


def test_unit_commands_are_accepted_by_the_cli() -> None:
    for path, queues in ((FORWARDER_UNIT, ""), (WORKER_UNIT, "emails default")):
        argv = shlex.split(one(parse_unit(path), "Service", "ExecStart").replace("$HYBRIDQ_QUEUES", queues))
        assert_cli_accepts(["hybridq", *argv[1:]])


# -- Redis: the shipped redis.conf and users.acl on a real redis-server ----------------------------


@dataclass
class DeployedRedis:
    port: int
    passwords: dict[str, str]  # ACL user -> password

    def url(self, user: str) -> str:
        return f"redis://{user}:{self.passwords[user]}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), socket_timeout=5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def run_deployed_redis(workdir: Path, aclfile: Path, ready_user: str | None, passwords: dict[str, str]):
    """redis-server with deploy/redis/redis.conf as its config file, on a private port.

    Only what cannot be right on a test machine is overridden on the command line: the port,
    the bind address and where the ACL file is. Not the fixture ``make_redis_server``: its start
    check is an unauthenticated INFO, which the shipped ACL refuses (that is the point).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "redis.log"
    for _attempt in range(3):
        port = _free_port()
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [
                    find_redis_server(),
                    str(REDIS_CONF),
                    *("--port", str(port), "--bind", "127.0.0.1", "--aclfile", str(aclfile)),
                    *("--daemonize", "no"),
                ],
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 10
            while True:
                if proc.poll() is not None:
                    break
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        pass
                except OSError:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"redis-server did not listen: {log_path.read_text()}") from None
                    time.sleep(0.02)
                    continue
                if ready_user is not None:
                    client = redis.Redis(port=port, username=ready_user, password=passwords[ready_user])
                    try:
                        client.ping()
                    finally:
                        client.close()
                break
            if proc.poll() is not None:
                if "Address already in use" in log_path.read_text():
                    continue
                raise AssertionError(f"redis-server exited {proc.returncode}: {log_path.read_text()}")
            yield DeployedRedis(port, passwords)
            return
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    raise AssertionError("no free port for redis-server")


def acl_with_passwords(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The shipped users.acl with each placeholder hash replaced by a new password's hash.

    That replacement is the one edit docs/deploy.md tells the operator to make.
    """
    passwords: dict[str, str] = {}
    out = []
    for line in USERS_ACL.read_text(encoding="utf-8").splitlines():
        words = line.split()
        assert words[0] == "user", line  # Redis 6.2 allows nothing else (not even comments)
        if PLACEHOLDER_HASH in words:
            passwords[words[1]] = secrets.token_hex(16)
            digest = hashlib.sha256(passwords[words[1]].encode()).hexdigest()
            words[words.index(PLACEHOLDER_HASH)] = "#" + digest
        out.append(" ".join(words))
    assert set(passwords) == {"hybridq-forwarder", "hybridq-worker", "hybridq-monitor", "admin"}
    path = tmp_path / "users.acl"
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path, passwords


@pytest.fixture
def deployed_redis(tmp_path: Path) -> Iterator[DeployedRedis]:
    aclfile, passwords = acl_with_passwords(tmp_path)
    with run_deployed_redis(tmp_path / "redis", aclfile, "admin", passwords) as server:
        yield server


def test_shipped_acl_file_loads_and_lets_nobody_in_until_passwords_are_set(tmp_path: Path) -> None:
    guesses = {"hybridq-forwarder": "CHANGE-ME", "hybridq-worker": "CHANGE-ME", "admin": ""}
    with run_deployed_redis(tmp_path / "redis", USERS_ACL, None, guesses) as server:
        for user, password in [*guesses.items(), ("default", ""), ("hybridq-worker", ""), ("hybridq", "")]:
            client = redis.Redis(port=server.port, username=user, password=password or None, retry=NO_RETRY)
            with pytest.raises(redis.exceptions.AuthenticationError):
                client.ping()
            client.close()


def test_redis_conf_is_the_one_running(deployed_redis: DeployedRedis) -> None:
    admin = deployed_redis.client("admin")
    try:
        config = admin.config_get("*")
        assert config["maxmemory-policy"] == "noeviction"
        assert int(config["maxmemory"]) == 1024**3
        assert config["save"] == ""
        assert config["appendonly"] == "no"
        assert config["protected-mode"] == "yes"
        assert config["timeout"] == "0"
        users = {line.split()[1]: line for line in admin.acl_list()}
        assert set(users) == {"default", "hybridq-forwarder", "hybridq-worker", "hybridq-monitor", "admin"}
        assert " off " in users["default"]
    finally:
        admin.close()
    anonymous = redis.Redis(port=deployed_redis.port, retry=NO_RETRY)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()  # the default user is off
    anonymous.close()


def test_full_cycle_as_the_forwarder_and_worker_acl_users(
    tmp_path: Path, deployed_redis: DeployedRedis
) -> None:
    journal = tmp_path / "journal"
    url = deployed_redis.url("hybridq-forwarder")
    worker_url = deployed_redis.url("hybridq-worker")
    queue = Queue("deploy", journal=journal)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(5)]
    # Two jobs with one idempotency key: the second is a suppressed duplicate (the claim script's
    # other path, and its completion event). One journal's forwarder would not push the second
    # (enqueue-if-absent): it comes from another producer's journal, through its own forwarder.
    queue.enqueue(tasks.add, 1, 1, idempotency_key="deploy-key")
    other = tmp_path / "journal-b"
    Queue("deploy", journal=other).enqueue(tasks.add, 1, 1, idempotency_key="deploy-key")
    forwarder = Forwarder(journal, RQTransport(url))
    forwarder.open()
    forwarder_b = Forwarder(other, RQTransport(url))
    forwarder_b.open()
    conn = deployed_redis.client("hybridq-worker")
    try:
        # INFO is allowed: the forwarder sees Redis's run_id (it detects restarts with it).
        assert forwarder.transport.state_token(forwarder.checkpoint.owner).run_id  # type: ignore[attr-defined]
        forwarder.step()
        forwarder_b.step()
        assert collect_status(str(journal))["forwarded"] == 6
        rq_queue = RQQueue("deploy", connection=conn, serializer=JSONSerializer)
        SimpleWorker([rq_queue], connection=conn, serializer=JSONSerializer).work(
            burst=True, logging_level="WARNING"
        )
        forwarder.step()
        forwarder_b.step()
        status = collect_status(str(journal), redis_url=url)
        status_b = collect_status(str(other))
        assert status["accepted"] == 6
        assert status["succeeded"] == status["accepted"]
        assert (status["failed"], status["pending"]) == (0, 0)
        assert (status_b["accepted"], status_b["succeeded"]) == (1, 1)
        assert status["duplicates_suppressed"] + status_b["duplicates_suppressed"] == 1
        assert status["redis"]["up"] is True
        assert [job.get_status() for job in jobs] == ["finished"] * 5

        # `hybridq worker --burst --simple`, the command the units run, on a second batch.
        more = [queue.enqueue(tasks.add, i, 100) for i in range(3)]
        forwarder.step()
        assert run_worker(["deploy"], url=worker_url, burst=True, simple=True) == 0
        forwarder.step()
        status = collect_status(str(journal))
        assert (status["accepted"], status["succeeded"], status["pending"]) == (9, 9, 0)
        assert [job.get_status() for job in more] == ["finished"] * 3

        # Both forwarders published their stats snapshots (status --all), as the forwarder user;
        # the worker user can neither forge one nor read them.
        from hybridq.ops.fleet import fleet
        from redis.exceptions import NoPermissionError

        seen = fleet(url)
        assert (seen["fresh"], seen["stale"]) == (2, 0)
        assert {f["owner"] for f in seen["forwarders"]} == {
            forwarder.checkpoint.owner,
            forwarder_b.checkpoint.owner,
        }
        with pytest.raises(NoPermissionError):
            conn.set("hybridq:stats:forged", "{}")
        with pytest.raises(NoPermissionError):
            conn.zadd("hybridq:forwarders", {"forged": 1.0})
        # The read-only monitor user sees the same view, and can write nothing.
        monitored = fleet(deployed_redis.url("hybridq-monitor"))
        assert (monitored["fresh"], monitored["invalid"]) == (2, 0)
        assert [f["owner"] for f in monitored["forwarders"]] == [f["owner"] for f in seen["forwarders"]]
        monitor = deployed_redis.client("hybridq-monitor")
        try:
            with pytest.raises(NoPermissionError):
                monitor.set("hybridq:stats:forged", "{}")
        finally:
            monitor.close()
    finally:
        for f in (forwarder, forwarder_b):
            f.close()
            f.transport.close()  # type: ignore[attr-defined]
        conn.close()
    admin = deployed_redis.client("admin")
    try:
        refused = [(e["username"], e["object"], e["reason"]) for e in admin.acl_log()]
    finally:
        admin.close()
    # Nothing hybridq or RQ did was refused, except redis-py's optional CLIENT SETINFO on connect
    # (which Redis 6.2 does not even have; redis-py ignores the error).
    # The worker user's forged stats snapshot, refused on purpose above.
    forged = {
        ("hybridq-worker", "hybridq:stats:forged", "key"),
        ("hybridq-worker", "hybridq:forwarders", "key"),
        ("hybridq-monitor", "set", "command"),
    }
    assert (
        set(refused)
        <= {
            (user, "client", "command") for user in ("hybridq-forwarder", "hybridq-worker", "hybridq-monitor")
        }
        | forged
    ), refused


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"),
        ("KEYS", "*"),
        ("DEBUG", "SLEEP", "0"),
        ("SHUTDOWN", "NOSAVE"),
        ("ACL", "LIST"),
        ("CLIENT", "LIST"),
        ("CLIENT", "KILL", "TYPE", "normal"),
        ("SAVE",),
        ("REPLICAOF", "127.0.0.1", "1"),
        ("SWAPDB", "0", "1"),
        ("SET", "somebody-else:key", "x"),  # keys outside rq:* and hybridq:*
        ("GET", "somebody-else:key"),
        ("PUBLISH", "somebody-else", "x"),  # channels outside rq:pubsub:*
    ],
    ids=" ".join,
)
@pytest.mark.parametrize("user", ["hybridq-forwarder", "hybridq-worker"])
def test_the_hybridq_users_cannot_run_dangerous_commands(
    deployed_redis: DeployedRedis, command: tuple[str, ...], user: str
) -> None:
    client = deployed_redis.client(user)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
        assert client.ping()  # still up
    finally:
        client.close()


@pytest.mark.parametrize(
    "command",
    [
        # (The forwarders' epoch keys: the worker's claim reads them, and Redis 6.2 cannot grant a
        # key for reading only; redis.conf says to use %R~ on Redis 7.)
        # Any hybridq key but the three a worker writes (results, leases, events).
        ("SET", "hybridq:other", "x"),
        # RQ's worker commands (shutdown, kill-horse, stop-job) to every other worker.
        ("PUBLISH", "rq:pubsub:some-worker", '{"command": "shutdown"}'),
    ],
    ids=" ".join,
)
def test_the_worker_user_cannot_write_what_only_forwarders_write(
    deployed_redis: DeployedRedis, command: tuple[str, ...]
) -> None:
    client = deployed_redis.client("hybridq-worker")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    finally:
        client.close()
    # ... which the forwarder user may (PUBLISH aside: no hybridq process publishes).
    if command[0] == "PUBLISH":
        return
    forwarder = deployed_redis.client("hybridq-forwarder")
    try:
        forwarder.execute_command(*command)
    finally:
        forwarder.close()


def test_the_forwarder_user_has_no_pubsub(deployed_redis: DeployedRedis) -> None:
    client = deployed_redis.client("hybridq-forwarder")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command("PUBLISH", "rq:pubsub:some-worker", '{"command": "shutdown"}')
    finally:
        client.close()


def test_the_worker_unit_with_the_worker_user_serves_and_a_shutdown_command_needs_admin(
    tmp_path: Path, deployed_redis: DeployedRedis, subprocess_env_for_deploy: dict[str, str]
) -> None:
    """`hybridq worker` as hybridq-worker subscribes to its command channel; only admin can publish."""
    proc = subprocess.Popen(
        [HYBRIDQ_BIN, "worker", "--name", "w-acl", "deploy"],
        env={**subprocess_env_for_deploy, "HYBRIDQ_REDIS_URL": deployed_redis.url("hybridq-worker")},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    admin = deployed_redis.client("admin")
    try:
        deadline = time.monotonic() + 30
        while not admin.pubsub_numsub("rq:pubsub:w-acl")[0][1]:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the worker never subscribed"
            time.sleep(0.1)
        worker = deployed_redis.client("hybridq-worker")
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                worker.publish("rq:pubsub:w-acl", json.dumps({"command": "shutdown"}))
        finally:
            worker.close()
        assert proc.poll() is None
        admin.publish("rq:pubsub:w-acl", json.dumps({"command": "shutdown"}))
        assert proc.wait(30) == 0
    finally:
        admin.close()
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate(timeout=30)
    assert "Traceback" not in stderr
    assert "RQ shutdown command received on rq:pubsub:w-acl" in stderr


@pytest.fixture
def subprocess_env_for_deploy(subprocess_env: dict[str, str]) -> dict[str, str]:
    env = dict(subprocess_env)
    env.pop("HYBRIDQ_ALLOW", None)
    return env


def test_the_worker_user_may_write_every_key_a_worker_writes(deployed_redis: DeployedRedis) -> None:
    """A key a worker writes and the ACL forgot would stop every worker (exit 1: refused)."""
    from hybridq.protocol import keys

    client = deployed_redis.client("hybridq-worker")
    try:
        client.set(keys.result("k"), "x")
        client.set(keys.lease("k"), "x")
        client.xadd(keys.events("owner"), {"e": "x"})
        client.zadd(keys.waiting(), {"job": 1.0})
        client.hset(keys.waiting_info(), "job", "x")
        client.hset(keys.rq_job("job"), "status", "queued")
        client.rpush(keys.rq_queue("default"), "job")
    finally:
        client.close()
