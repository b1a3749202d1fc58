"""Completion events are authenticated when signing is on (issue 13.5).

A completion event is what makes a job terminal in the forwarder's ledger. Whoever can write to
Redis could XADD a ``succeeded`` event for a job that never ran, delete its job hash, and the
job was gone: status said succeeded. With a signing key, workers MAC each event (with the
owner's id) and the forwarder drops, counts and logs any event without a valid MAC. Without a
key, it drops a ``succeeded`` event for a job it has not forwarded yet.

An in-process forwarder (``Forwarder.step``) and RQ's SimpleWorker, against a private Redis.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.protocol import keys
from hybridq.rqworker import SimpleWorker as HybridqSimpleWorker
from hybridq.security.signing import ENV_KEY, ENV_KEY_FILE, Keyring
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from hybridq.worker import Job
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from tests.support.rqwork import job_data

KEY = "e" * 64


@pytest.fixture(autouse=True)
def _no_key_from_the_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.delenv(ENV_KEY, raising=False)


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


@pytest.fixture
def forwarder(journal_dir: Path, transport: RQTransport) -> Iterator[Forwarder]:
    Queue("default", journal_dir)  # creates the journal
    forwarder = Forwarder(journal_dir, transport, lease_s=0.2, reconcile_interval_s=0.05)
    forwarder.open()
    yield forwarder
    forwarder.close()


def delivery_of(transport: RQTransport, job_id: str) -> dict[str, Any]:
    data = transport.connection.hget(keys.rq_job(job_id), "data")
    _, _, args, _ = job_data(data)
    return dict(args[0])


def forge_success(transport: RQTransport, owner: str, job_id: str, loc: list[Any], **extra: Any) -> None:
    event = {
        "id": job_id,
        "loc": loc,
        "queue": "default",
        "outcome": "succeeded",
        "final": True,
        "retry_delay": None,
        "attempt": 1,
        "dup": False,
        "error": None,
        "at": time.time(),
        **extra,
    }
    transport.connection.xadd(keys.events(owner), {"e": json.dumps(event)})


def terminal(forwarder: Forwarder, loc: list[Any]) -> bool:
    assert forwarder.completions is not None
    return forwarder.completions.index.is_terminal((str(loc[0]), int(loc[1]), int(loc[2])))


def work(transport: RQTransport) -> None:
    conn = transport.connection
    queue = RQQueue("default", connection=conn, serializer=JSONSerializer, job_class=Job)
    HybridqSimpleWorker([queue], connection=conn, serializer=JSONSerializer, job_class=Job).work(
        burst=True, logging_level="WARNING"
    )


def test_a_forged_success_does_not_end_a_job_when_signing_is_on(
    journal_dir: Path,
    transport: RQTransport,
    forwarder: Forwarder,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv(ENV_KEY, KEY)  # producer, forwarder and worker (all in this process)
    effects = tmp_path / "effects"
    job = Queue("default", journal_dir).enqueue("tests.tasks.record", str(effects), "ran")
    forwarder.step()
    loc = delivery_of(transport, job.id)["loc"]
    owner = forwarder.checkpoint.owner
    # The attack: a success nobody signed (one with a made-up MAC too), and the job hash gone.
    forge_success(transport, owner, job.id, loc)
    forge_success(transport, owner, job.id, loc, mac="hmac-sha256:" + "0" * 64)
    transport.connection.delete(keys.rq_job(job.id))
    forwarder.step()
    assert not terminal(forwarder, loc)
    # The job is delivered again (its hash is missing), runs, and its real event ends it.
    deadline = time.monotonic() + 30
    while not effects.exists() and time.monotonic() < deadline:
        time.sleep(0.25)
        forwarder.step()
        work(transport)
    forwarder.step()
    assert effects.read_text(encoding="utf-8").split() == ["ran"]
    assert terminal(forwarder, loc)


def test_a_forged_success_for_a_job_not_yet_forwarded_is_dropped_without_a_key(
    journal_dir: Path, transport: RQTransport, forwarder: Forwarder
) -> None:
    queue = Queue("default", journal_dir)
    first = queue.enqueue("tests.tasks.add", 1, 2)
    forwarder.step()
    loc = delivery_of(transport, first.id)["loc"]
    owner = forwarder.checkpoint.owner
    # The next record's place is predictable: past the forwarder's position.
    ahead = [loc[0], loc[1], loc[2] + 1000]
    forge_success(transport, owner, "0" * 32, ahead)
    forwarder.step()
    assert not terminal(forwarder, ahead)


def test_events_a_worker_sends_carry_a_mac_the_forwarder_verifies(
    transport: RQTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every event path: a success, a failure, and a kept earlier success (rewritten in Lua)."""
    from hybridq.envelope.model import Envelope, new_job_id
    from hybridq.transport.base import Delivery

    monkeypatch.setenv(ENV_KEY, KEY)
    ring = Keyring((KEY.encode(),))
    envs = [
        ring.sign(
            Envelope(
                id=new_job_id(),
                func=func,
                queue="default",
                idempotency_key=new_job_id(),
                created_at=time.time(),
                args=args,
            )
        )
        for func, args in (
            ("tests.tasks.add", (1, 2)),
            ("tests.tasks.fail", ()),
            ("tests.tasks.race_a_success_then_fail", ()),
        )
    ]
    transport.push([Delivery(env, "owner1", ("w", 0, 64 + n)) for n, env in enumerate(envs)])
    for worker_class in (SimpleWorker, HybridqSimpleWorker):  # execute's own calls, then pipelined
        conn = transport.connection
        queue = RQQueue("default", connection=conn, serializer=JSONSerializer, job_class=Job)
        worker_class([queue], connection=conn, serializer=JSONSerializer, job_class=Job).work(
            burst=True, logging_level="WARNING"
        )
        transport.push(
            [Delivery(env, "owner1", ("w", 0, 64 + n), replace=True) for n, env in enumerate(envs)]
        )
    events = [e.body for e in transport.harvest("owner1", 100)]
    assert len(events) == 6
    for body in events:
        assert body is not None
        assert ring.verify_event("owner1", body), body
        assert not ring.verify_event("owner2", body)  # bound to its owner's stream
    outcomes = sorted((str(b["id"]), str(b["outcome"])) for b in events if b is not None)
    assert "succeeded" in {o for i, o in outcomes if i == envs[2].id}


def test_dropped_events_are_counted(
    journal_dir: Path, transport: RQTransport, forwarder: Forwarder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_KEY, KEY)
    job = Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 2)
    forwarder.step()
    loc = delivery_of(transport, job.id)["loc"]
    assert forwarder.completions is not None
    before = forwarder.completions.dropped_events
    forge_success(transport, forwarder.checkpoint.owner, job.id, loc)
    forwarder.step()
    assert forwarder.completions.dropped_events == before + 1
