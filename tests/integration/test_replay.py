"""A signed job runs only from its own queue, under its own id, before it expires (issue 13.3).

Against a private redis-server and RQ's SimpleWorker in this process with hybridq's job class
(or ``hybridq worker`` where the queues it serves matter). The worker holds the signing key.
What this cannot stop, and the docs say so: the same delivery pushed again, after its stored
outcome was deleted from Redis, before it expires (replay protection depends on Redis state).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import keys
from hybridq.security.signing import ENV_KEY, ENV_KEY_FILE, Keyring, _mac, canonical
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.worker import Job
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer

OWNER = "owner1"
KEY = "k" * 64
DAY = 86400.0


@pytest.fixture(autouse=True)
def _the_worker_holds_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setenv(ENV_KEY, KEY)
    monkeypatch.delenv("HYBRIDQ_SIGNATURE_TTL", raising=False)


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def job(effects: Path, token: str, **overrides: Any) -> Envelope:
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


def signed(env: Envelope) -> Envelope:
    return Keyring((KEY.encode(),)).sign(env)


def signed_the_old_way(env: Envelope) -> Envelope:
    """As a producer before ``not_after`` existed signed it: no expiry field."""
    return dataclasses.replace(env, signature=_mac(KEY.encode(), canonical(env)))


def push(transport: RQTransport, env: Envelope) -> None:
    transport.push([Delivery(env, OWNER, ("w", 0, 64))])


def work(conn: Any, queue: str = "default") -> None:
    q = RQQueue(queue, connection=conn, serializer=JSONSerializer, job_class=Job)
    SimpleWorker([q], connection=conn, serializer=JSONSerializer, job_class=Job).work(
        burst=True, logging_level="WARNING"
    )


def ran(effects: Path) -> list[str]:
    return effects.read_text(encoding="utf-8").split() if effects.exists() else []


def events(transport: RQTransport) -> dict[str, dict[str, Any]]:
    return {str(e.body["id"]): dict(e.body) for e in transport.harvest(OWNER, 100) if e.body is not None}


def move(conn: Any, job_id: str, to: str, *, origin: bool) -> None:
    """Take a queued job off its queue and onto ``to`` (its hash's origin too, if ``origin``)."""
    conn.lrem(keys.rq_queue("default"), 0, job_id)
    conn.rpush(keys.rq_queue(to), job_id)
    conn.sadd(keys.rq_queues(), keys.rq_queue(to))
    if origin:
        conn.hset(keys.rq_job(job_id), "origin", to)


def test_a_signed_job_moved_to_another_queue_does_not_run(transport: RQTransport, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    env = signed(job(effects, "moved"))
    push(transport, env)
    move(transport.connection, env.id, "other", origin=True)  # as RQ's own enqueue_job would
    work(transport.connection, "other")
    assert ran(effects) == []
    # Not reported: a tampered hash must not fail the real job (the forwarder delivers it again).
    assert events(transport) == {}


def test_a_signed_job_copied_under_another_id_does_not_run(transport: RQTransport, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    env = signed(job(effects, "copied"))
    push(transport, env)
    conn = transport.connection
    copy = new_job_id()
    conn.hset(keys.rq_job(copy), mapping=conn.hgetall(keys.rq_job(env.id)))
    conn.lrem(keys.rq_queue("default"), 0, env.id)
    conn.rpush(keys.rq_queue("default"), copy)
    work(conn)
    assert ran(effects) == []
    assert events(transport) == {}


def test_hybridq_worker_runs_only_jobs_signed_for_the_queues_it_serves(
    redis_server: RedisServer, transport: RQTransport, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    effects = tmp_path / "effects"
    env = signed(job(effects, "pushed-onto-other"))
    push(transport, env)
    move(transport.connection, env.id, "other", origin=False)  # the hash still says "default"
    worker_env = {**subprocess_env, ENV_KEY: KEY, "HYBRIDQ_ALLOW": "tests"}
    worker_env.pop(ENV_KEY_FILE, None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridq",
            "worker",
            "--burst",
            "--simple",
            "--redis",
            redis_server.url,
            "other",
        ],
        env=worker_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert ran(effects) == []
    assert events(transport) == {}


def test_an_expired_signed_job_fails_for_good_without_running(transport: RQTransport, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    expired = signed(job(effects, "expired", created_at=time.time() - 8 * DAY))
    fresh = signed(job(effects, "fresh"))
    for env in (expired, fresh):
        push(transport, env)
    work(transport.connection)
    assert ran(effects) == ["fresh"]
    event = events(transport)[expired.id]
    assert (event["outcome"], event["final"]) == ("failed", True)
    assert "expired" in str(event["error"])
    assert transport.connection.get(keys.result(expired.key_id)) is None


def test_the_expiry_counts_from_a_delayed_jobs_run_time(transport: RQTransport, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    delayed = signed(job(effects, "delayed", created_at=time.time() - 8 * DAY, run_at=time.time() - 1))
    push(transport, delayed)
    work(transport.connection)
    assert ran(effects) == ["delayed"]


def test_an_old_signature_without_an_expiry_expires_by_its_signed_creation_time(
    transport: RQTransport, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    old = signed_the_old_way(job(effects, "old", created_at=time.time() - 8 * DAY))
    recent = signed_the_old_way(job(effects, "recent"))
    assert "not_after" not in old.extra
    for env in (old, recent):
        push(transport, env)
    work(transport.connection)
    assert ran(effects) == ["recent"]
    assert "expired" in str(events(transport)[old.id]["error"])


def test_a_changed_expiry_breaks_the_signature(transport: RQTransport, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    env = signed(job(effects, "extended", created_at=time.time() - 8 * DAY))
    extended = dataclasses.replace(env, extra={**env.extra, "not_after": time.time() + DAY})
    push(transport, extended)
    work(transport.connection)
    assert ran(effects) == []
    assert "the signature does not match" in str(events(transport)[env.id]["error"])
