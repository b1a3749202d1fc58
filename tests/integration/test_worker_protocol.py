"""The worker's Redis protocol, step by step, against a real redis-server and RQ's SimpleWorker.

Each test sets up one state Redis can be in (a stored failure of an earlier attempt, a job taken
by a worker that died, a lost completion event, two runs of one key racing) and checks what the
Lua scripts and the probe make of it. Tests that run jobs run them twice: under RQ's own
``SimpleWorker`` (a plain ``rq worker``: ``execute`` sends its claim and outcome itself) and under
hybridq's (``hybridq worker``: both ride in RQ's pipelines, see ``hybridq.rqworker``).
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from hybridq.envelope.model import Envelope, Retry, new_job_id
from hybridq.protocol import Overwrite, keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery, Probe
from hybridq.transport.rq import RQTransport
from rq.utils import utcformat

from tests.support.rqwork import Work

OWNER = "owner1"


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def envelope(func: str = "tests.tasks.add", **overrides: object) -> Envelope:
    fields: dict[str, object] = {
        "id": new_job_id(),
        "func": func,
        "queue": "default",
        "idempotency_key": new_job_id(),
        "created_at": time.time(),
        "args": (1, 2) if func == "tests.tasks.add" else (),
    }
    fields.update(overrides)
    return Envelope(**fields)  # type: ignore[arg-type]


def deliver(transport: RQTransport, env: Envelope, attempt: int = 1, **options: bool) -> None:
    transport.push([Delivery(env, OWNER, ("w", 0, 64), attempt=attempt, **options)])


def probe(transport: RQTransport, env: Envelope, lease_s: float = 10.0) -> str:
    [verdict] = transport.probe([Probe(env.id, env.key_id, env.queue)], lease_s=lease_s)
    return verdict


def events(transport: RQTransport) -> list[dict[str, object]]:
    return [e.body for e in transport.harvest(OWNER, 100) if e.body is not None]


def test_a_stored_failure_of_attempt_1_does_not_make_attempt_2_look_done(
    transport: RQTransport, work: Work
) -> None:
    env = envelope("tests.tasks.fail", retry=Retry(max_attempts=2, backoff_s=0))
    deliver(transport, env)
    work(transport)
    assert probe(transport, env) == "done"  # attempt 1's outcome awaits harvest
    deliver(transport, env, attempt=2, force=True)
    assert probe(transport, env) == "queued"  # attempt 2 waits for a worker: not "done"


def test_a_stale_copy_reports_the_stored_failure_again(transport: RQTransport, work: Work) -> None:
    env = envelope("tests.tasks.fail", retry=Retry(max_attempts=2, backoff_s=0))
    deliver(transport, env)
    work(transport)
    transport.connection.delete(keys.events(OWNER))  # the completion event is lost
    deliver(transport, env, attempt=1, replace=True)  # what the forwarder does after the grace
    work(transport)  # does not run the task again (it would fail again and store attempt 1)
    [event] = events(transport)
    assert (event["outcome"], event["final"], event["attempt"], event["dup"]) == ("failed", False, 1, False)


def test_a_job_rq_just_started_is_not_orphaned_before_the_lease(transport: RQTransport) -> None:
    env = envelope()
    deliver(transport, env)
    # What RQ's prepare_job_execution does before our claim: status started, started_at now.
    transport.connection.hset(
        keys.rq_job(env.id), mapping={"status": "started", "started_at": utcformat(datetime.now(UTC))}
    )
    transport.connection.lrem(keys.rq_queue("default"), 0, env.id)
    assert probe(transport, env, lease_s=10.0) == "running"
    # Its worker died before the claim: the task never started, no attempt was used.
    assert probe(transport, env, lease_s=0.0) == "stranded"
    # Had the claim happened (the task started) and the lease lapsed, it would be an attempt.
    transport.connection.hset(keys.rq_job(env.id), "hybridq_started", "1")
    assert probe(transport, env, lease_s=0.0) == "orphaned"


def test_the_claim_marks_the_run_as_started(transport: RQTransport, work: Work) -> None:
    env = envelope()
    deliver(transport, env)
    work(transport)
    assert transport.connection.hget(keys.rq_job(env.id), "hybridq_started") == b"1"


def test_a_job_a_dead_worker_took_but_never_started_is_stranded(transport: RQTransport) -> None:
    env = envelope()
    other = envelope()
    deliver(transport, env)
    deliver(transport, other)  # the queue list still exists
    conn = transport.connection
    conn.lmove(keys.rq_queue("default"), keys.rq_intermediate("default"), "LEFT", "RIGHT")
    assert probe(transport, env) == "stranded"
    assert probe(transport, other) == "queued"


def test_a_stranded_job_delivered_again_is_queued_and_no_longer_stranded(
    transport: RQTransport, work: Work
) -> None:
    # A worker took the job into RQ's intermediate list and vanished before starting it: killed,
    # or its host cut off while it waited in BLMOVE (Redis moved the job; the reply was lost).
    env, other = envelope(), envelope()
    deliver(transport, env)
    deliver(transport, other)
    conn = transport.connection
    conn.lmove(keys.rq_queue("default"), keys.rq_intermediate("default"), "LEFT", "RIGHT")
    assert probe(transport, env, lease_s=0.0) == "stranded"
    # The reconcile pass delivers the same attempt again, replacing the stranded copy.
    transport.push([Delivery(env, OWNER, ("w", 0, 64), attempt=1, overwrite=Overwrite.ALWAYS)])
    # Queued, once: were it still "stranded", every later pass would delete it and queue it at
    # the back again, a lease apart, so behind a backlog longer than a lease it would never run
    # (found by the multihost tier: tests/multihost, a worker host cut off while idle).
    assert probe(transport, env, lease_s=0.0) == "queued"
    assert conn.lrange(keys.rq_intermediate("default"), 0, -1) == []
    assert conn.lrange(keys.rq_queue("default"), 0, -1) == [other.id.encode(), env.id.encode()]
    work(transport)
    assert sorted(e["id"] for e in events(transport)) == sorted([env.id, other.id])


def test_a_run_that_fails_after_another_run_of_its_key_succeeded_reports_the_success(
    transport: RQTransport, work: Work
) -> None:
    env = envelope("tests.tasks.race_a_success_then_fail")
    deliver(transport, env)
    work(transport)
    [event] = events(transport)
    assert (event["outcome"], event["final"]) == ("succeeded", True)
    stored = json.loads(transport.connection.get(keys.result(env.key_id)))
    assert stored["result"] == "other run"  # the stored success was kept


def test_a_function_nobody_allowed_is_refused_without_being_imported(
    transport: RQTransport, monkeypatch: pytest.MonkeyPatch, work: Work
) -> None:
    monkeypatch.setenv("HYBRIDQ_ALLOW", "myapp.tasks")  # not `tests`
    env = envelope("tests.tasks.never_imported_by_a_refusing_worker")
    deliver(transport, env)
    work(transport)
    # Left for a worker set up for it (issue 12.11; tests/integration/test_worker_unavailable.py):
    # no event, no attempt used.
    assert events(transport) == []
    assert transport.connection.get(keys.result(env.key_id)) is None  # nothing claimed or stored


def test_allowed_prefixes_match_whole_module_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridq.security.allow import allowed

    monkeypatch.setenv("HYBRIDQ_ALLOW", "tests.ta, billing")
    assert not allowed("tests.tasks.add")  # "tests.ta" is not the module "tests.tasks"
    assert allowed("billing.charge")
    monkeypatch.setenv("HYBRIDQ_ALLOW", "*")
    assert allowed("anything.at.all")
    monkeypatch.delenv("HYBRIDQ_ALLOW")
    assert not allowed("tests.tasks.add")
    importlib.import_module("tests.registered_tasks")  # registers its @hybridq.task functions
    assert allowed("tests.registered_tasks.record")


def test_a_claim_or_an_outcome_sent_again_after_a_lost_reply_finds_itself(transport: RQTransport) -> None:
    """The unknown outcome: a script ran in Redis but the worker never heard back, and retries."""
    from hybridq import worker

    conn = transport.connection
    env = envelope()
    result_key, lease_key, events = keys.result(env.key_id), keys.lease(env.key_id), keys.events(OWNER)
    claim = worker._script(conn, worker._CLAIM)
    claim_args = ["token-1", 10_000, env.id, 0, 1]
    assert claim(keys=[result_key, lease_key, keys.rq_job(env.id)], args=claim_args)[0] == 0
    # The same claim again: the lease is its own, so it may run (not "busy" until the lease lapses).
    assert claim(keys=[result_key, lease_key, keys.rq_job(env.id)], args=claim_args)[0] == 0
    # Another delivery's claim is still refused.
    other = ["token-2", 10_000, env.id, 0, 1]
    assert claim(keys=[result_key, lease_key, keys.rq_job(env.id)], args=other)[0] == 3

    finish = worker._script(conn, worker._FINISH)
    outcome = {"outcome": "succeeded", "job_id": env.id, "attempt": 1, "token": "token-1"}
    finish_args = ["token-1", json.dumps(outcome), 60, json.dumps({"job_id": env.id})]
    assert finish(keys=[result_key, lease_key, events], args=finish_args) == 0
    # Sent again: its own outcome is there; no second event, no "ran twice" alarm.
    assert finish(keys=[result_key, lease_key, events], args=finish_args) == 2
    assert conn.xlen(events) == 1
    # A different run of the same attempt finding that success: the task did run twice.
    again = ["token-3", json.dumps({**outcome, "token": "token-3"}), 60, json.dumps({"job_id": env.id})]
    assert finish(keys=[result_key, lease_key, events], args=again) == 1
    # An earlier attempt finishing after a later one succeeded: superseded.
    late = {**outcome, "attempt": 0, "token": "token-4"}
    assert finish(keys=[result_key, lease_key, events], args=["token-4", json.dumps(late), 60, "{}"]) == 3


@pytest.mark.parametrize("implicit", [True, False])
def test_a_finished_job_whose_hash_the_worker_deleted_probes_done(
    transport: RQTransport, work: Work, *, implicit: bool
) -> None:
    # With result_ttl 0 (finished jobs leave Redis) the worker deletes RQ's hash at the end; the
    # stored outcome is what tells a finished job from one Redis lost until the harvest. Read as
    # "missing", the forwarder would deliver it again at once.
    transport.default_result_ttl_s = 0.0
    job_id = new_job_id()
    env = envelope(id=job_id, idempotency_key=job_id) if implicit else envelope()
    deliver(transport, env)
    work(transport)
    assert not transport.connection.exists(keys.rq_job(env.id))
    assert probe(transport, env) == "done"
    other = envelope()  # nothing stored for it: missing
    assert probe(transport, other) == "missing"
