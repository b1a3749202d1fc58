"""RQ's own tools against hybridq's jobs (issue 12.3): rq requeue, rq info, cancel, empty, the
key prefix, and what RQ records for a stale delivery. docs/worker.md, "Using RQ's tools".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope, Retry, new_job_id
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery, Probe
from hybridq.transport.rq import RQTransport
from rq.job import Job as RQJob
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from tests.support.rqwork import Work

OWNER = "owner1"
RQ = str(Path(sys.executable).with_name("rq"))


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def envelope(func: str, *args: object, attempts: int = 1) -> Envelope:
    return Envelope(
        id=new_job_id(),
        func=func,
        queue="default",
        idempotency_key=new_job_id(),
        created_at=time.time(),
        args=args,
        retry=Retry(max_attempts=attempts, backoff_s=0) if attempts > 1 else None,
    )


def deliver(transport: RQTransport, env: Envelope, attempt: int = 1, **options: object) -> None:
    transport.push([Delivery(env, OWNER, ("w", 0, 64), attempt=attempt, **options)])  # type: ignore[arg-type]


def failed_registry(transport: RQTransport) -> FailedJobRegistry:
    return FailedJobRegistry("default", connection=transport.connection, serializer=JSONSerializer)


def rq_cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RQ, *args, "-u", url, "--serializer", "rq.serializers.JSONSerializer"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def runs(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("run ")]


def test_a_retried_job_leaves_rqs_failed_registry(
    transport: RQTransport, redis_server: RedisServer, tmp_path: Path, work: Work
) -> None:
    """Its retry succeeded: rq info shows no failure, and rq requeue --all finds nothing."""
    effects = tmp_path / "effects.txt"
    env = envelope("tests.tasks.flaky", str(effects), "t", 1, attempts=2)
    deliver(transport, env)
    work(transport)  # attempt 1 fails: RQ lists it as failed
    assert failed_registry(transport).get_job_ids() == [env.id]
    deliver(transport, env, attempt=2, force=True)  # the forwarder's retry
    work(transport)  # attempt 2 succeeds
    failed_after_success = failed_registry(transport).get_job_ids()
    # RQ's finished job expires (result_ttl); a failed-registry entry left behind named nothing.
    transport.connection.delete(keys.rq_job(env.id))
    done = rq_cli("requeue", "--all", "--queue", "default", url=redis_server.url)
    assert "NoSuchJobError" not in done.stderr
    assert done.returncode == 0, done.stderr
    assert failed_after_success == []  # rq info showed a failure on an all-success queue
    assert len(runs(effects)) == 2


def test_rq_requeue_after_the_key_lifetime_does_not_run_a_failed_job_again(
    transport: RQTransport, redis_server: RedisServer, tmp_path: Path, work: Work
) -> None:
    """RQ keeps failed jobs a year by default; hybridq's outcome only for the key lifetime."""
    effects = tmp_path / "effects.txt"
    env = envelope("tests.tasks.flaky", str(effects), "t", 100)  # always fails; one attempt
    deliver(transport, env, key_ttl_s=3.0)
    work(transport)
    assert len(runs(effects)) == 1
    conn = transport.connection
    job_ttl, key_ttl = conn.ttl(keys.rq_job(env.id)), conn.ttl(keys.result(env.key_id))
    time.sleep(3.2)  # the outcome under the key expired
    assert conn.get(keys.result(env.key_id)) is None
    done = rq_cli("requeue", "--all", "--queue", "default", url=redis_server.url)
    assert done.returncode == 0, done.stderr
    work(transport)
    assert len(runs(effects)) == 1, "rq requeue ran a job that had failed for good again"
    assert job_ttl < key_ttl  # RQ's failed job went before the outcome


def test_a_stale_delivery_is_recorded_failed_in_rq(transport: RQTransport, work: Work) -> None:
    env = envelope("tests.tasks.fail", attempts=2)
    deliver(transport, env)
    work(transport)
    deliver(transport, env, attempt=1, replace=True)  # attempt 1 again: its event was lost
    work(transport)  # reports attempt 1's failure again, runs nothing
    job = RQJob.fetch(env.id, connection=transport.connection, serializer=JSONSerializer)
    assert job.get_status() == "failed"  # as hybridq has it, not "finished"
    assert "StaleDelivery" in (job.latest_result().exc_string or "")  # type: ignore[union-attr]


def test_rq_cancel_and_empty_are_undone_by_the_forwarder(
    transport: RQTransport, redis_server: RedisServer
) -> None:
    """What docs/worker.md says they do: the job comes back (stranded / missing)."""
    canceled, emptied = envelope("tests.tasks.add", 1, 2), envelope("tests.tasks.add", 3, 4)
    deliver(transport, canceled)
    deliver(transport, emptied)
    conn = transport.connection
    RQJob.fetch(canceled.id, connection=conn, serializer=JSONSerializer).cancel()
    done = rq_cli("empty", "default", url=redis_server.url)
    assert done.returncode == 0, done.stderr
    verdicts = transport.probe([Probe(e.id, e.key_id, e.queue) for e in (canceled, emptied)], lease_s=0.0)
    assert verdicts == ["stranded", "missing"]  # the forwarder delivers both again
    deliver(transport, canceled, replace=True)  # what it does with a stranded job
    assert conn.zscore(keys.rq_registry("canceled", "default"), canceled.id) is None


def test_rq_key_prefix_is_followed(redis_server: RedisServer, subprocess_env: dict[str, str]) -> None:
    """RQ_KEY_PREFIX (RQ 3.0): the forwarder pushes where workers with that prefix look."""
    script = """
import json, sys, time
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.rqworker import SimpleWorker
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from rq import Queue
from rq.serializers import JSONSerializer

t = RQTransport(sys.argv[1])
env = Envelope(id=new_job_id(), func="tests.tasks.add", queue="default", idempotency_key="k",
               created_at=time.time(), args=(1, 2))
t.push([Delivery(env, "owner1", ("w", 0, 64))])
q = Queue("default", connection=t.connection, serializer=JSONSerializer)
SimpleWorker([q], connection=t.connection, serializer=JSONSerializer).work(burst=True)
events = [e.body for e in t.harvest("owner1", 10)]
print(json.dumps({"events": events, "keys": sorted(k.decode() for k in t.connection.keys("*"))}))
"""
    env = {**subprocess_env, "RQ_KEY_PREFIX": "myrq"}
    done = subprocess.run(
        [sys.executable, "-c", script, redis_server.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=os.getcwd(),
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [e["outcome"] for e in out["events"]] == ["succeeded"], done.stderr
    assert not [k for k in out["keys"] if k.startswith("rq:")], out["keys"]


def test_an_invalid_rq_key_prefix_stops_the_worker_with_one_line(subprocess_env: dict[str, str]) -> None:
    env = {**subprocess_env, "RQ_KEY_PREFIX": "bad prefix!"}
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("hybridq")),
            "worker",
            "--burst",
            "--redis",
            "redis://127.0.0.1:1/0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "hybridq: error: Invalid RQ_KEY_PREFIX 'bad prefix!': only letters, digits, and _ . : - { } are allowed"
    ]
