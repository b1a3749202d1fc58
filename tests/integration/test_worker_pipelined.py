"""hybridq's worker classes (``hybridq.rqworker``): the claim and the outcome inside RQ's pipelines.

Against a private redis-server, in-process workers. Each test pins one promise of the pipelined
path: the claim and the outcome travel in RQ's own round trips (and the plain RQ worker keeps its
own calls); a stored outcome still means no run; a lost reply, a script Redis forgot and a taken
lease are handled as ``execute`` handles them on its own; RQ's job statuses are what RQ's own
worker writes; a job RQ refuses is never claimed; RQ's worker heartbeat is one round trip, and
skipped only right after one with the same TTL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import keys
from hybridq.rqworker import SimpleWorker as HybridqSimpleWorker
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.worker import _CLAIM, _FINISH, Job
from redis.client import Pipeline
from redis.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

OWNER = "owner1"
CLAIM_SHA = hashlib.sha1(_CLAIM.encode()).hexdigest()
FINISH_SHA = hashlib.sha1(_FINISH.encode()).hexdigest()


class RecordingConnection(Connection):
    """Records the command names of every send (one send is one round trip)."""

    sends: ClassVar[list[list[str]]] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        data = command if isinstance(command, bytes) else b"".join(bytes(c) for c in command)
        RecordingConnection.sends.append(_names(data))
        super().send_packed_command(command, check_health)


def _names(data: bytes) -> list[str]:
    """Command names in RESP-packed ``data`` (EVALSHA followed by the script's name)."""
    names, i = [], 0
    while i < len(data):
        end = data.index(b"\r\n", i)
        count, i = int(data[i + 1 : end]), end + 2
        args = []
        for _ in range(count):
            end = data.index(b"\r\n", i)
            size, i = int(data[i + 1 : end]), end + 2
            args.append(data[i : i + size])
            i += size + 2
        name = args[0].decode().upper()
        if name == "EVALSHA":
            name = {CLAIM_SHA: "CLAIM", FINISH_SHA: "FINISH"}.get(args[1].decode(), "EVALSHA")
        names.append(name)
    return names


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def envelope(func: str = "tests.tasks.add", *args: object, key: str | None = None) -> Envelope:
    job_id = new_job_id()
    return Envelope(
        id=job_id,
        func=func,
        queue="default",
        idempotency_key=key or job_id,
        created_at=time.time(),
        args=args if args or func != "tests.tasks.add" else (1, 2),
    )


def deliver(transport: RQTransport, env: Envelope, *, lease_s: float = 10.0) -> None:
    transport.push([Delivery(env, OWNER, ("w", 0, 64), lease_s=lease_s)])


def work(url: str, worker_class: type[SimpleWorker] = HybridqSimpleWorker, *, record: bool = False) -> None:
    """Run the queue's jobs in this process (hybridq's worker class unless told otherwise)."""
    conn = redis.Redis.from_url(url, connection_class=RecordingConnection if record else Connection)
    try:
        queue = RQQueue("default", connection=conn, serializer=JSONSerializer)
        worker_class([queue], connection=conn, serializer=JSONSerializer, job_class=Job).work(
            burst=True, logging_level="WARNING"
        )
    finally:
        conn.close()


def warm_up(url: str, transport: RQTransport, worker_class: type[SimpleWorker] = HybridqSimpleWorker) -> None:
    """Run one job, so that Redis knows both scripts (a fresh server answers NOSCRIPT once)."""
    deliver(transport, envelope())
    work(url, worker_class)
    transport.connection.delete(keys.events(OWNER))


def events(transport: RQTransport) -> list[dict[str, Any]]:
    return [e.body for e in transport.harvest(OWNER, 100) if e.body is not None]


def stored(transport: RQTransport, env: Envelope) -> dict[str, Any]:
    raw = transport.connection.get(keys.result(env.key_id))
    assert raw is not None, "no outcome stored"
    return dict(json.loads(raw))


def rq_job(transport: RQTransport, env: Envelope) -> RQJob:
    return RQJob.fetch(env.id, connection=transport.connection, serializer=JSONSerializer)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


Fault = Callable[[str, bool], list[int]]


@pytest.fixture
def lose_first_reply(monkeypatch: pytest.MonkeyPatch) -> Fault:
    """``arm(sha, ran)``: the first pipeline holding that script fails with a ConnectionError.

    With ``ran`` it ran in Redis and only its reply was lost (the unknown outcome); without, it
    never reached Redis. Returns a list counting how often such a pipeline was sent.
    """

    def arm(sha: str, ran: bool) -> list[int]:
        sent = [0]
        original = Pipeline.execute

        def execute(self: Pipeline, raise_on_error: bool = True) -> Any:
            if not any(args[:2] == ("EVALSHA", sha) for args, _ in self.command_stack):
                return original(self, raise_on_error)
            sent[0] += 1
            if sent[0] > 1:
                return original(self, raise_on_error)
            if ran:
                original(self, raise_on_error)
            else:
                self.reset()
            raise RedisConnectionError("injected: the reply was lost")

        monkeypatch.setattr(Pipeline, "execute", execute)
        return sent

    return arm


# -- where the scripts travel -------------------------------------------------------------------


def per_job_sends(
    url: str, transport: RQTransport, make: Callable[[], None], worker_class: type
) -> list[list[str]]:
    """The sends of a burst of 4 jobs made by ``make``, less those of a burst of 1 (startup)."""
    counts = []
    for n in (1, 5):
        for _ in range(n):
            make()
        RecordingConnection.sends = []
        work(url, worker_class, record=True)
        counts.append(list(RecordingConnection.sends))
    return counts[1][len(counts[0]) :]  # the later jobs' share, in order (startup is alike)


def test_the_claim_and_the_outcome_ride_in_rqs_own_pipelines(
    redis_server: RedisServer, transport: RQTransport
) -> None:
    warm_up(redis_server.url, transport)
    env = envelope()
    deliver(transport, env)
    RecordingConnection.sends = []
    work(redis_server.url, record=True)
    sends = RecordingConnection.sends
    scripts = [s for s in sends if "CLAIM" in s or "FINISH" in s]
    assert len(scripts) == 2, sends
    claim, finish = scripts
    # The claim last in RQ's MULTI/EXEC before the job (after its status "started").
    assert claim[0] == "MULTI"
    assert claim[-2:] == ["CLAIM", "EXEC"]
    assert "PERSIST" in claim
    # The outcome with the job heartbeat RQ writes as the job returns.
    assert finish == ["HSET", "FINISH"]
    assert stored(transport, env)["outcome"] == "succeeded"
    assert [e["id"] for e in events(transport)] == [env.id]
    assert rq_job(transport, env).get_status() == "finished"
    assert rq_job(transport, env).return_value() == 3
    assert transport.connection.hget(keys.rq_job(env.id), "hybridq_started") == b"1"


def test_a_plain_rq_worker_still_sends_the_claim_and_the_outcome_itself(
    redis_server: RedisServer, transport: RQTransport
) -> None:
    warm_up(redis_server.url, transport, SimpleWorker)
    env = envelope()
    deliver(transport, env)
    RecordingConnection.sends = []
    work(redis_server.url, SimpleWorker, record=True)
    scripts = [s for s in RecordingConnection.sends if "CLAIM" in s or "FINISH" in s]
    assert scripts == [["CLAIM"], ["FINISH"]]
    assert stored(transport, env)["outcome"] == "succeeded"
    assert [e["id"] for e in events(transport)] == [env.id]
    assert rq_job(transport, env).get_status() == "finished"


def test_a_hybridq_job_costs_fewer_round_trips_than_an_rq_job_under_rq(
    redis_server: RedisServer, transport: RQTransport
) -> None:
    url = redis_server.url
    rq_queue = RQQueue("default", connection=transport.connection, serializer=JSONSerializer)
    hybridq = per_job_sends(url, transport, lambda: deliver(transport, envelope()), HybridqSimpleWorker)
    plain_on_hybridq = per_job_sends(url, transport, lambda: deliver(transport, envelope()), SimpleWorker)
    rq_alone = per_job_sends(url, transport, lambda: rq_queue.enqueue("tests.tasks.add", 1, 2), SimpleWorker)
    # Four jobs each. Today 14, 22 and 20 round trips per job (docs/benchmarks.md, W1).
    assert len(hybridq) < len(rq_alone) < len(plain_on_hybridq), (hybridq, rq_alone, plain_on_hybridq)
    assert len(plain_on_hybridq) - len(rq_alone) == 2 * 4  # execute()'s own claim and outcome


# -- the guarantees, on the pipelined path ------------------------------------------------------


def test_a_stored_success_means_no_run_under_the_pipelined_claim(
    redis_server: RedisServer, transport: RQTransport, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.txt"
    first = envelope("tests.tasks.record", str(effects), "one", key="k")
    deliver(transport, first)
    work(redis_server.url)
    again = envelope("tests.tasks.record", str(effects), "two", key="k")  # another job, same key
    deliver(transport, again)
    work(redis_server.url)
    assert lines(effects) == ["one"]  # the second delivery did not run the task
    _, dup_event = events(transport)
    assert (dup_event["id"], dup_event["dup"], dup_event["outcome"]) == (again.id, True, "succeeded")
    assert rq_job(transport, again).return_value() == "one"  # the stored result


def test_a_stored_final_failure_means_no_run_under_the_pipelined_claim(
    redis_server: RedisServer, transport: RQTransport
) -> None:
    deliver(transport, envelope("tests.tasks.fail", key="k"))
    work(redis_server.url)
    again = envelope("tests.tasks.race_a_success_then_fail", key="k")  # would store a success
    deliver(transport, again)
    work(redis_server.url)
    _, dup = events(transport)
    assert (dup["id"], dup["dup"], dup["outcome"]) == (again.id, True, "failed")
    assert rq_job(transport, again).get_status() == "failed"  # DuplicateOfFailedJob
    assert stored(transport, again)["outcome"] == "failed"  # the task never ran


@pytest.mark.parametrize("ran", [True, False], ids=["claim-ran", "never-sent"])
def test_a_lost_reply_of_the_pipeline_before_the_job_is_sent_again_and_the_claim_finds_itself(
    redis_server: RedisServer, transport: RQTransport, tmp_path: Path, lose_first_reply: Fault, ran: bool
) -> None:
    warm_up(redis_server.url, transport)  # the scripts are loaded: the claim rides in the pipeline
    effects = tmp_path / "effects.txt"
    env = envelope("tests.tasks.record", str(effects), "once")
    deliver(transport, env, lease_s=60.0)  # a claim taken by someone else would wait a minute
    sent = lose_first_reply(CLAIM_SHA, ran)
    started = time.monotonic()
    work(redis_server.url)
    assert sent == [2]  # the reply was lost; the pipeline went again, with the same token
    assert time.monotonic() - started < 10  # a claim that had run found the lease its own
    assert lines(effects) == ["once"]
    [event] = events(transport)
    assert (event["id"], event["attempt"], event["outcome"]) == (env.id, 1, "succeeded")
    assert rq_job(transport, env).get_status() == "finished"
    assert transport.connection.hget(keys.rq_job(env.id), "hybridq_started") == b"1"


@pytest.mark.parametrize("ran", [True, False], ids=["outcome-ran", "never-sent"])
def test_a_lost_reply_of_the_outcome_is_sent_again_and_finds_itself(
    redis_server: RedisServer,
    transport: RQTransport,
    lose_first_reply: Fault,
    caplog: pytest.LogCaptureFixture,
    ran: bool,
) -> None:
    warm_up(redis_server.url, transport)
    env = envelope()
    deliver(transport, env)
    sent = lose_first_reply(FINISH_SHA, ran)
    caplog.set_level(logging.INFO, logger="hybridq")
    RecordingConnection.sends = []
    work(redis_server.url, record=True)
    assert sent == [1]  # the pipeline failed once ...
    scripts = [s for s in RecordingConnection.sends if "FINISH" in s]
    assert scripts[-1] == ["FINISH"]  # ... and the outcome went again, on its own
    assert [e["id"] for e in events(transport)] == [env.id]  # one event, not two
    assert stored(transport, env)["outcome"] == "succeeded"
    assert "ran twice" not in caplog.text  # a retry finds its own outcome (2), not another's
    assert rq_job(transport, env).get_status() == "finished"


def test_scripts_redis_forgot_are_loaded_again(
    redis_server: RedisServer, transport: RQTransport, tmp_path: Path
) -> None:
    warm_up(redis_server.url, transport)
    transport.connection.script_flush()  # what a Redis restart does
    effects = tmp_path / "effects.txt"
    env = envelope("tests.tasks.record", str(effects), "once")
    deliver(transport, env)
    RecordingConnection.sends = []
    work(redis_server.url, record=True)  # NOSCRIPT in both pipelines: each sent again on its own
    scripts = [s for s in RecordingConnection.sends if "CLAIM" in s or "FINISH" in s]
    assert ["CLAIM"] in scripts, scripts
    assert ["FINISH"] in scripts, scripts
    assert lines(effects) == ["once"]
    assert stored(transport, env)["outcome"] == "succeeded"
    assert [e["id"] for e in events(transport)] == [env.id]
    assert rq_job(transport, env).get_status() == "finished"


def test_a_pipelined_claim_that_finds_the_lease_taken_waits_for_it(
    redis_server: RedisServer, transport: RQTransport, tmp_path: Path
) -> None:
    warm_up(redis_server.url, transport)
    effects = tmp_path / "effects.txt"
    env = envelope("tests.tasks.record", str(effects), "after")
    deliver(transport, env)
    transport.connection.set(keys.lease(env.key_id), "another run", px=700)
    started = time.monotonic()
    work(redis_server.url)
    assert time.monotonic() - started >= 0.6  # it waited for the other run's lease
    assert lines(effects) == ["after"]
    assert stored(transport, env)["outcome"] == "succeeded"


def test_a_job_rq_refuses_is_never_claimed(redis_server: RedisServer, transport: RQTransport) -> None:
    warm_up(redis_server.url, transport)  # the scripts are loaded: a claim would ride along
    env = envelope()
    deliver(transport, env)
    # A callback nobody allowed: hybridq's job class refuses the job before anything runs.
    transport.connection.hset(keys.rq_job(env.id), "failure_callback_name", "os.system")
    work(redis_server.url)
    conn = transport.connection
    assert rq_job(transport, env).get_status() == "failed"
    assert conn.get(keys.lease(env.key_id)) is None
    assert conn.hget(keys.rq_job(env.id), "hybridq_started") is None
    assert conn.get(keys.result(env.key_id)) is None


# -- RQ's side stays RQ's -----------------------------------------------------------------------


def test_rqs_job_hashes_and_registries_are_what_rqs_own_worker_writes(
    redis_server: RedisServer, transport: RQTransport
) -> None:
    conn = transport.connection
    seen: dict[str, Any] = {}
    for worker_class in (SimpleWorker, HybridqSimpleWorker):
        ok, bad = envelope(), envelope("tests.tasks.fail")
        deliver(transport, ok)
        deliver(transport, bad)
        work(redis_server.url, worker_class)
        queue = RQQueue("default", connection=conn, serializer=JSONSerializer)
        seen[worker_class.__module__] = (
            rq_job(transport, ok).get_status(),
            rq_job(transport, bad).get_status(),
            sorted(conn.hkeys(keys.rq_job(ok.id))),
            sorted(conn.hkeys(keys.rq_job(bad.id))),
            conn.hget(keys.rq_job(ok.id), "hybridq_started"),
            ok.id in queue.finished_job_registry.get_job_ids(),
            bad.id in queue.failed_job_registry.get_job_ids(),
            queue.started_job_registry.get_job_ids(),
            conn.llen(keys.rq_intermediate("default")),
            [e["outcome"] for e in events(transport)],
        )
        conn.delete(keys.events(OWNER))
    assert seen["hybridq.rqworker"] == seen["rq.worker.worker_classes"]
    assert seen["hybridq.rqworker"][:2] == ("finished", "failed")


def test_hybridqs_worker_keeps_its_job_class_when_rq_passes_its_own(redis_server: RedisServer) -> None:
    conn = redis.Redis.from_url(redis_server.url)
    try:
        # What `rq worker -w hybridq.rqworker.SimpleWorker` passes unless told --job-class.
        assert HybridqSimpleWorker(["default"], connection=conn, job_class="rq.job.Job").job_class is Job
        assert HybridqSimpleWorker(["default"], connection=conn).job_class is Job
    finally:
        conn.close()


def test_a_worker_heartbeat_is_one_round_trip_and_skipped_when_one_with_its_ttl_just_went(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq import rqworker

    conn = redis.Redis.from_url(redis_server.url, connection_class=RecordingConnection)
    worker = HybridqSimpleWorker(["default"], connection=conn)
    try:
        default_ttl = worker.worker_ttl + 60
        RecordingConnection.sends = []
        worker.heartbeat()
        worker.heartbeat()  # the same TTL, just now: the key's expiry would hardly move
        assert RecordingConnection.sends == [["HSET", "EXPIRE", "EXPIRE"]]
        worker.heartbeat(default_ttl + 500)  # another TTL: sent
        assert conn.ttl(worker.key) > default_ttl
        worker.heartbeat()  # back to the default: sent (it shortens the TTL, as RQ's does)
        assert default_ttl - 2 <= conn.ttl(worker.key) <= default_ttl
        with conn.pipeline() as pipe:  # queued in one of RQ's pipelines: counts as sent
            worker.heartbeat(pipeline=pipe)
            pipe.execute()
        RecordingConnection.sends = []
        worker.heartbeat()
        assert RecordingConnection.sends == []
        monkeypatch.setattr(rqworker, "HEARTBEAT_GAP_S", 0.0)  # ... until the gap has passed
        worker.heartbeat()
        assert RecordingConnection.sends == [["HSET", "EXPIRE", "EXPIRE"]]
    finally:
        worker.unsubscribe()
        conn.close()


def test_the_lease_renewer_wakes_only_when_a_renewal_is_due_before_it_looks_again(
    redis_server: RedisServer,
) -> None:
    from hybridq import worker

    conn = redis.Redis.from_url(redis_server.url)
    renewer = worker._LeaseRenewer()  # its own thread, idle: it looks again in 60 s
    try:
        conn.set("lease:long", "me", px=60_000)
        conn.set("lease:short", "me", px=300)
        long = renewer.add(conn, "lease:long", "me", 60.0)  # due in 20 s: the thread sleeps on
        short = renewer.add(conn, "lease:short", "me", 0.3)  # due in 0.1 s: the thread is woken
        time.sleep(0.9)  # three lease lengths
        assert conn.get("lease:short") == b"me"  # renewed in time, again and again
        renewer.remove(short)
        time.sleep(0.5)
        assert conn.get("lease:short") is None  # no longer renewed: it expired
        assert 55_000 < conn.pttl("lease:long") <= 60_000  # not due yet: left alone
        renewer.remove(long)
    finally:
        conn.close()


# RQ's methods hybridq.rqworker re-implements (their pipelines carry hybridq's scripts), as in
# the RQ release they were copied from. A new RQ that changes one fails here: compare the method
# with hybridq/rqworker.py, carry the change over, then record the new hash.
RQ_METHODS_COPIED = {
    "prepare_job_execution": "d08dd32962e3f82a",
    "handle_execution_ended": "23748b027980a6cd",
}


@pytest.mark.parametrize(("name", "expected"), sorted(RQ_METHODS_COPIED.items()))
def test_the_rq_methods_hybridq_re_implements_are_those_it_copied(name: str, expected: str) -> None:
    import hashlib
    import inspect

    from rq.worker.base import BaseWorker

    source = inspect.getsource(getattr(BaseWorker, name))
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == expected, (
        f"rq's BaseWorker.{name} changed since hybridq/rqworker.py copied it: review the copy"
    )
