"""The pool worker's batch scripts against a real Redis: lost replies, NOSCRIPT, one job per part.

A reply lost after a script ran is answered by sending the same call again (the pool does, with
``scripts.retrying``): that must neither claim twice nor record RQ's ending twice.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
import select
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
import rq
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import ClaimStatus, Delivery, keys
from hybridq.protocol.enums import Overwrite
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from hybridq.worker import batch_end, batch_scripts, lease, perform, scripts
from hybridq.worker.intake import Resolver, prepare
from hybridq.worker.keeper import Channel
from hybridq.worker.perform import FRESH_S, Performer
from hybridq.worker.run import conclude, release
from hybridq.worker.run import perform as perform_run
from hybridq.worker.runner import Runner, Taken
from hybridq.worker.starter import RECORD_AFTER_S, Reservations, Starter
from rq.serializers import JSONSerializer

QUEUE = "batch"
OWNER = "batch-owner"


def push(url: str, n: int, key: str | None = None) -> list[str]:
    transport = RQTransport(url)
    try:
        now = time.time()
        ids = [new_job_id(now) for _ in range(n)]
        envs = [
            Envelope(
                id=j,
                func="tests.tasks.add",
                args=(i, 1),
                queue=QUEUE,
                idempotency_key=key or j,
                created_at=now,
            )
            for i, j in enumerate(ids)
        ]
        transport.push([Delivery(env, OWNER, ("w", 0, i)) for i, env in enumerate(envs)])
    finally:
        transport.close()
    return [env.id for env in envs]


def take(client: redis.Redis, n: int) -> list[Taken]:
    taken = batch_scripts.take(client, [keys.rq_queue(QUEUE)], n)
    items = [prepare(job_id.decode(), QUEUE, fields, Resolver()) for job_id, _, fields in taken]
    assert all(item is not None for item in items)
    return [item for item in items if item is not None]


def take_one(server: RedisServer, n: int = 1) -> tuple[redis.Redis, list[Taken]]:
    """A client of ``server``, and the one job (or ``n``) pushed there, taken."""
    push(server.url, n)
    client = server.client()
    return client, take(client, n)


def start_args(items: list[Taken]) -> list[Any]:
    args: list[Any] = [keys.RQ_PREFIX, "w1", "2026-01-01T00:00:00.000000Z"]
    for i, item in enumerate(items):
        item.exec_id = f"e{i}"
        item.started = time.time()
        args += [item.job_id, QUEUE, item.exec_id, *batch_scripts.claim_part(item)]
    return args


def end_args(items: list[Taken], ok: list[bool] | None = None, ttl: int = 500) -> list[Any]:
    at = time.time()  # then how long they all ran (RQ's total_working_time, added once)
    args: list[Any] = [
        keys.RQ_PREFIX,
        "w1",
        "2026-01-01T00:00:01.000000Z",
        at,
        sum(at - i.started for i in items),
    ]
    for n, item in enumerate(items):
        conclude(item.run, 1, None)
        keys_, call = item.run.finish
        good = ok is None or ok[n]
        args += [
            item.job_id,
            QUEUE,
            item.exec_id,
            item.started,
            "1" if good else "0",
            ttl if good else 500,
            "",
            "",
        ]
        args += [*keys_, *call, *[""] * (5 - len(call)), "1" if item.recorded else "0"]
    return args


def test_start_and_end_sent_twice_claim_once_and_record_once(redis_server: RedisServer) -> None:
    ids = push(redis_server.url, 3)
    client = redis_server.client()
    items = take(client, 10)
    assert [i.job_id for i in items] == ids
    assert client.llen(keys.rq_intermediate(QUEUE)) == 3, "taken: in RQ's intermediate list, as RQ's dequeue"
    args = start_args(items)
    first = scripts.call(client, batch_scripts.START, [], args)
    again = scripts.call(client, batch_scripts.START, [], args)  # the first reply was lost
    assert [r[0] for r in first] == [0, 0, 0]
    assert [r[0] for r in again] == [0, 0, 0], "a claim that ran finds the lease its own"
    assert client.llen(keys.rq_intermediate(QUEUE)) == 0
    started = rq.registry.StartedJobRegistry(QUEUE, connection=client)
    assert started.get_job_ids() == [], "RQ's execution records: at the next turn, if still running"
    record = batch_scripts.record_args("w1", items, 120)
    assert scripts.call(client, batch_scripts.RECORD, [], record) == 3
    assert scripts.call(client, batch_scripts.RECORD, [], record) == 3, "sent again: the same records"
    assert sorted(started.get_job_ids()) == sorted(ids)
    assert client.smembers("rq:worker:w1:executions") == {f"{i.job_id}:{i.exec_id}".encode() for i in items}
    client.script_flush()  # Redis restarted without losing data: NOSCRIPT is answered by loading it
    args = end_args(items)
    assert scripts.call(client, batch_end.END, [], args) == [0, 0, 0]
    assert scripts.call(client, batch_end.END, [], args) == [2, 2, 2], "already stored, mine"
    assert client.xlen(keys.events(OWNER)) == 3, "one completion event per job"
    for job_id in ids:
        assert client.xlen(f"rq:results:{job_id}") == 1, "RQ's result recorded once"
        job = rq.job.Job.fetch(job_id, connection=client, serializer=JSONSerializer)
        assert job.get_status() == "finished"
    assert started.get_job_ids() == []
    assert not client.keys("rq:execution*"), "every execution's records removed"
    assert not client.exists("rq:worker:w1:executions")
    assert int(client.hget("rq:worker:w1", "successful_job_count") or 0) == 3
    # RQ's finished registry and TTLs, as RQ writes them: whole seconds, result_ttl from now.
    finished = client.zrange(f"rq:finished:{QUEUE}", 0, -1, withscores=True)
    assert {member.decode() for member, _ in finished} == set(ids)
    assert all(score == int(score) and abs(score - (time.time() + 500)) < 5 for _, score in finished)
    assert all(0 < client.ttl(f"rq:job:{job_id}") <= 500 for job_id in ids)
    assert all(0 < client.ttl(f"rq:results:{job_id}") <= 500 for job_id in ids)


def test_end_with_result_ttl_0_sent_twice_deletes_the_finished_jobs_and_counts_them_once(
    redis_server: RedisServer,
) -> None:
    """RQ's result_ttl 0 (``--forget-finished``): a finished job's hash and results only deleted.

    No status written first (an HSET of a hash deleted in the same step is a command for
    nothing), and sent again after a lost reply it finds no execution to end: counted once. A
    failed job of the same batch keeps RQ's failed record.
    """
    client, items = take_one(redis_server, 3)
    ids = [item.job_id for item in items]
    scripts.call(client, batch_scripts.START, [], start_args(items))
    items[1].recorded = True  # its execution's records written (RECORD), removed by END
    assert (
        scripts.call(client, batch_scripts.RECORD, [], batch_scripts.record_args("w1", items[1:2], 120)) == 1
    )
    args = end_args(items, ok=[True, True, False], ttl=0)
    client.config_resetstat()
    assert scripts.call(client, batch_end.END, [], args) == [0, 0, 0]
    hset = client.info("commandstats")["cmdstat_hset"]["calls"]
    assert hset == 1, "the failed job's status; each finished job's hash only deleted"
    assert scripts.call(client, batch_end.END, [], args) == [2, 2, 2], "sent again: already stored, mine"
    for job_id in ids[:2]:
        assert not client.exists(f"rq:job:{job_id}", f"rq:results:{job_id}"), "gone at once"
    assert client.hget(f"rq:job:{ids[2]}", "status") == b"failed"
    assert client.xlen(f"rq:results:{ids[2]}") == 1
    assert client.zcard(f"rq:finished:{QUEUE}") == 0
    assert rq.registry.FailedJobRegistry(QUEUE, connection=client).get_job_ids() == [ids[2]]
    worker = client.hgetall("rq:worker:w1")
    assert int(worker[b"successful_job_count"]) == 2, "counted once"
    assert int(worker[b"failed_job_count"]) == 1
    assert not client.keys("rq:execution*"), "every execution's records removed"
    assert client.xlen(keys.events(OWNER)) == 3, "one completion event per job"


def test_a_job_that_ends_before_the_next_turn_has_no_execution_records_written(
    redis_server: RedisServer,
) -> None:
    """RQ's execution records are written only for a job still running a turn after its start.

    Most jobs end before their process's next turn: writing the execution hash, its set, the
    started registry's entry and the worker's set at the start, and deleting them at the end,
    was ten of about forty commands per job. RQ's view of the job itself is unchanged.
    """
    client, items = take_one(redis_server, 3)
    ids = [item.job_id for item in items]
    client.config_resetstat()
    scripts.call(client, batch_scripts.START, [], start_args(items))
    scripts.call(client, batch_end.END, [], end_args(items))
    stats = client.info("commandstats")
    counted = ("zadd", "sadd", "srem", "zrem", "exists", "hexists")
    calls = {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in counted}
    assert calls == {"zadd": 3, "sadd": 0, "srem": 0, "zrem": 0, "exists": 0, "hexists": 0}, (
        "one ZADD per job (its finished registry); the job hash read once at the start"
    )
    assert stats["cmdstat_hmget"]["calls"] == 3, "START's one read of each job hash"
    assert not client.keys("rq:execution*")
    for job_id in ids:
        job = rq.job.Job.fetch(job_id, connection=client, serializer=JSONSerializer)
        assert job.get_status() == "finished"
        assert job.worker_name == "w1"
        assert job.latest_result() is not None, "its result in RQ's results stream"
    assert sorted(rq.registry.FinishedJobRegistry(QUEUE, connection=client).get_job_ids()) == sorted(ids)
    assert int(client.hget("rq:worker:w1", "successful_job_count") or 0) == 3


def test_start_reads_the_cancel_mark_and_writes_the_run_started_in_rqs_hash(
    redis_server: RedisServer,
) -> None:
    """START's claim: a cancelled job runs nothing; a new claim's hybridq_started, a refused one's none."""
    client, items = take_one(redis_server, 3)
    ids = [item.job_id for item in items]
    client.hset(keys.rq_job(ids[1]), "hybridq_cancel", "1")
    client.set(items[2].run.claim_keys[1], "another-token")  # another delivery holds the key
    replies = scripts.call(client, batch_scripts.START, [], start_args(items))
    assert [int(r[0]) for r in replies] == [0, 5, 3]
    started = [client.hget(keys.rq_job(job_id), "hybridq_started") for job_id in ids]
    assert started == [b"1", None, None], "only a new claim counts as an attempt (requeue 0, attempt 1)"
    assert [client.hget(keys.rq_job(job_id), "status") for job_id in ids] == [b"started"] * 3
    assert client.llen(keys.rq_intermediate(QUEUE)) == 0


def test_a_turn_records_only_the_jobs_claimed_a_while_ago_and_not_recorded() -> None:
    """By age, not by turns: a loaded process's next turn may come before its threads start a job."""
    now = time.monotonic()
    reserved = Reservations(None, None)  # type: ignore[arg-type]  # (neither is used here)
    fresh = Taken("fresh", QUEUE, exec_id="e1", claimed_at=now)
    due = Taken("due", QUEUE, exec_id="e2", claimed_at=now - RECORD_AFTER_S - 0.01)
    recorded = Taken("recorded", QUEUE, exec_id="e3", claimed_at=now - 1.0, recorded=True)
    reserved_only = Taken("reserved", QUEUE)  # taken ahead, not claimed
    reserved.held.update({fresh, due, recorded, reserved_only})
    assert reserved.unrecorded() == [due]


def test_a_job_purged_before_its_record_gets_no_execution_records(redis_server: RedisServer) -> None:
    """RECORD writes nothing for a job whose hash no longer names that execution (ended, purged)."""
    client, items = take_one(redis_server)
    scripts.call(client, batch_scripts.START, [], start_args(items))
    client.delete(keys.rq_job(items[0].job_id))  # a refill purged it
    assert scripts.call(client, batch_scripts.RECORD, [], batch_scripts.record_args("w1", items, 120)) == 0
    assert not client.keys("rq:execution*")
    assert rq.registry.StartedJobRegistry(QUEUE, connection=client).get_job_ids() == []


def test_a_job_key_of_another_type_in_a_take_loses_no_other_job(redis_server: RedisServer) -> None:
    """A key at a job's place that is not a hash (anyone with Redis access can write one) is
    dropped from the take; the jobs popped with it are taken, and none leaves both lists."""
    push(redis_server.url, 3)
    client = redis_server.client()
    client.set(f"{keys.RQ_PREFIX}:job:bad", "x")
    client.lpush(keys.rq_queue(QUEUE), "bad")  # first: the script's error came before the others
    items = take(client, 10)
    assert len(items) == 3
    intermediate = {i.decode() for i in client.lrange(keys.rq_queue(QUEUE) + ":intermediate", 0, -1)}
    assert intermediate == {item.job_id for item in items}
    assert client.llen(keys.rq_queue(QUEUE)) == 0


def test_a_take_larger_than_luas_unpack_limit_keeps_every_job(redis_server: RedisServer) -> None:
    """Lua's unpack takes at most ~8,000 values: a take of more pushes them in parts."""
    client = redis_server.client()
    ids = [f"big{i}" for i in range(9000)]
    with client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hset(f"{keys.RQ_PREFIX}:job:{job_id}", mapping={"data": "x", "status": "queued"})
        pipe.rpush(keys.rq_queue(QUEUE), *ids)
        pipe.execute()
    taken = batch_scripts.take(client, [keys.rq_queue(QUEUE)], 9000)
    assert len(taken) == 9000
    assert client.llen(keys.rq_queue(QUEUE) + ":intermediate") == 9000


def test_a_copy_that_finds_its_job_busy_leaves_rqs_view_to_the_run_holding_it(
    redis_server: RedisServer,
) -> None:
    """A job delivered again while it runs: the copy's START (BUSY) takes nothing of RQ's view,
    so the running delivery's END writes its ending even if the copy never ends (its process left
    while it waited)."""
    [job_id] = push(redis_server.url, 1)
    client = redis_server.client()
    first = take(client, 1)
    transport = RQTransport(redis_server.url)
    try:  # the same run pushed again (a reservation thought stranded)
        transport.push([Delivery(first[0].run.d.envelope, OWNER, ("w", 0, 0), overwrite=Overwrite.ALWAYS)])
    finally:
        transport.close()
    assert scripts.call(client, batch_scripts.START, [], start_args(first))[0][0] == ClaimStatus.CLAIMED
    second = take(client, 1)
    args = start_args(second)
    args[args.index(second[0].exec_id)] = "copy"
    second[0].exec_id = "copy"
    assert scripts.call(client, batch_scripts.START, [], args)[0][0] == ClaimStatus.BUSY
    scripts.call(client, batch_end.END, [], end_args(first))
    job = rq.job.Job.fetch(job_id, connection=client, serializer=JSONSerializer)
    assert job.get_status() == "finished"
    assert client.llen(keys.rq_queue(QUEUE) + ":intermediate") == 0


def test_the_workers_counters_add_up_every_job_of_a_batch_once(redis_server: RedisServer) -> None:
    """RQ's worker counters (rq info, rq-dashboard): one increment per job, sent twice or not."""
    push(redis_server.url, 4)
    client = redis_server.client()
    items = take(client, 4)
    scripts.call(client, batch_scripts.START, [], start_args(items))
    for item in items:
        item.started = time.time() - 2.0  # each ran for about 2 s
    args = end_args(items, ok=[True, False, True, True])
    scripts.call(client, batch_end.END, [], args)
    scripts.call(client, batch_end.END, [], args)  # the first reply was lost
    worker = client.hgetall("rq:worker:w1")
    assert int(worker[b"successful_job_count"]) == 3
    assert int(worker[b"failed_job_count"]) == 1
    assert 7.9 < float(worker[b"total_working_time"]) < 8.5


def test_a_stored_outcome_in_a_batch_suppresses_that_job_only(redis_server: RedisServer) -> None:
    push(redis_server.url, 3)
    client = redis_server.client()
    items = take(client, 3)
    done = items[1]
    client.set(done.run.claim_keys[0], '{"outcome": "succeeded", "result": 7, "job_id": "x", "attempt": 1}')
    replies = scripts.call(client, batch_scripts.START, [], start_args(items))
    assert [r[0] for r in replies] == [0, 1, 0]
    assert client.exists(items[0].run.claim_keys[1]) == 1, "the others hold their leases"
    assert client.exists(done.run.claim_keys[1]) == 0, "the suppressed one takes none"


def test_one_jobs_script_error_in_end_is_its_own_and_the_others_are_recorded(
    redis_server: RedisServer,
) -> None:
    """A job whose outcome cannot be written (its key holds a list) spoils no other's (issue 26, 7)."""
    ids = push(redis_server.url, 3)
    client = redis_server.client()
    items = take(client, 3)
    scripts.call(client, batch_scripts.START, [], start_args(items))
    broken = items[1]
    client.delete(broken.run.claim_keys[0])
    client.rpush(broken.run.claim_keys[0], "not an outcome")  # GET on it: WRONGTYPE
    replies = scripts.call(client, batch_end.END, [], end_args(items))
    assert [replies[0], replies[2]] == [0, 0], replies
    assert isinstance(replies[1], bytes), replies
    assert replies[1].startswith(b"error: "), replies
    assert b"WRONGTYPE" in replies[1]
    assert client.xlen(keys.events(OWNER)) == 2, "the two others' events"
    for n in (0, 2):
        assert client.exists(items[n].run.claim_keys[1]) == 0, "their leases freed"
        job = rq.job.Job.fetch(ids[n], connection=client, serializer=JSONSerializer)
        assert job.get_status() == "finished"


def test_one_jobs_script_error_in_start_is_its_own(redis_server: RedisServer) -> None:
    push(redis_server.url, 3)
    client = redis_server.client()
    items = take(client, 3)
    client.rpush(items[0].run.claim_keys[0], "not an outcome")  # its claim's GET: WRONGTYPE
    replies = scripts.call(client, batch_scripts.START, [], start_args(items))
    assert replies[0][0] == -1, replies
    assert b"WRONGTYPE" in replies[0][1], replies
    assert [r[0] for r in replies[1:]] == [0, 0], "the others claimed"


def test_a_script_error_is_not_sent_again_but_a_transient_refusal_is() -> None:
    calls: list[int] = []

    def wrong_type() -> None:
        calls.append(1)
        raise redis.exceptions.ResponseError(
            "Error running script (call to f_1): @user_script:9: WRONGTYPE Operation against a key"
        )

    started = time.monotonic()
    with pytest.raises(redis.exceptions.ResponseError):
        scripts.retrying(wrong_type)
    assert calls == [1], "a deterministic error: raised at once"
    assert time.monotonic() - started < 1.0
    out_of_memory = redis.exceptions.ResponseError(
        "Error running script (call to f_1): @user_script:3: OOM command not allowed when used memory"
    )
    assert scripts.transient(out_of_memory)
    assert scripts.transient(redis.exceptions.OutOfMemoryError("command not allowed"))
    assert scripts.transient(redis.exceptions.ConnectionError("gone"))
    assert not scripts.transient(redis.exceptions.ResponseError("WRONGTYPE Operation against a key"))


def test_a_claim_sent_again_after_redis_restarted_is_fenced_even_if_its_lease_came_back(
    redis_server: RedisServer,
) -> None:
    """A lost START reply, then Redis back from a snapshot holding the lease: not claimed unchecked."""
    client, items = take_one(redis_server)
    run_id = client.info("server")["run_id"]
    client.set(keys.epoch(OWNER), f"0:{run_id}:token")
    args = start_args(items)
    assert scripts.call(client, batch_scripts.START, [], args)[0][0] == 0
    client.set(keys.epoch(OWNER), "0:" + "0" * 40 + ":token")  # as after a restart: another run_id
    again = scripts.call(client, batch_scripts.START, [], args)  # the first reply was lost
    assert again[0][0] == 4, f"the lease is there, but this server is not the one checked: {again}"


def test_a_claim_that_waited_is_made_again_before_its_task_starts(redis_server: RedisServer) -> None:
    """S22: claimed for a free thread, then held up (a task holding the GIL): asked again first."""
    push(redis_server.url, 2)
    client = redis_server.client()
    items = take(client, 2)
    starter = Starter(scripts.client(client), "w1", 120)
    starter.exchange([], items, None)
    assert [i.run.claim_reply[0] for i in items] == [0, 0]
    ran: list[int] = []
    performer = Performer(scripts.client(client), starter=starter)
    for item in items:
        item.run.func = lambda a, b: ran.append(a) or a + b
        item.claimed_at -= FRESH_S * 10  # the thread started it that much later
    # The first one's claim is gone meanwhile (its lease lost, another run finished the job).
    gone = items[0]
    client.delete(gone.run.claim_keys[1])
    client.set(gone.run.claim_keys[0], json.dumps({"outcome": "succeeded", "result": 7, "job_id": "x"}))
    assert performer.work(gone)
    assert performer.work(items[1])
    assert ran == [1], "only the job whose claim was still its own ran"
    for item in items:
        release(item.run)


def runs(client: redis.Redis, starter: Starter, item: Taken) -> bool:
    """Whether a thread given ``item`` (claimed) calls its task."""
    ran: list[int] = []
    item.run.func = lambda a, b: ran.append(a) or a + b
    Performer(scripts.client(client), starter=starter).work(item)
    release(item.run)
    return bool(ran)


def _lose_claim(client: redis.Redis, item: Taken) -> None:
    """What a lapsed lease lets happen meanwhile: the lease gone, another run's success stored."""
    client.delete(item.run.claim_keys[1])
    client.set(item.run.claim_keys[0], json.dumps({"outcome": "succeeded", "result": 7, "job_id": "x"}))


def test_a_claims_age_counts_from_when_it_was_sent_not_from_its_reply(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """START ran in Redis, then its reply waited past the lease (a task holding the GIL): asked again.

    The engine thread waits in the pipeline's read while Redis already ran the claim; the lease
    lapses and another run finishes the job before the reply is read. A claim stamped when the
    reply was read looks fresh, and the task would run a second time.
    """
    client, items = take_one(redis_server)
    starter = Starter(scripts.client(client), "w1", 120)
    client.script_load(batch_scripts.START)  # known: the first call is not sent again (NOSCRIPT)
    real = Starter._pipeline

    def late(self: Starter, parts: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        replies = real(self, parts)
        _lose_claim(client, items[0])
        time.sleep(0.2)
        return replies

    monkeypatch.setattr(Starter, "_pipeline", late)
    starter.exchange([], items, None)
    assert items[0].run.claim_reply[0] == 0, "claimed, as Redis ran it"
    assert not runs(client, starter, items[0]), "started on a claim older than its lease"


def test_a_claim_whose_lease_renewal_failed_is_made_again_before_its_task_starts(
    redis_server: RedisServer,
) -> None:
    """A fresh claim whose renewer already found the lease gone: not trusted for its age."""
    client, items = take_one(redis_server)
    starter = Starter(scripts.client(client), "w1", 120)
    starter.exchange([], items, None)
    _lose_claim(client, items[0])
    items[0].run.renewal.lost = True
    assert not runs(client, starter, items[0]), "started on a lease its renewal found lost"


def test_a_claim_made_by_a_busy_poll_counts_its_age_from_when_it_was_sent(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for the claim a thread's poll makes (its key was busy): not its reply's time."""
    client, items = take_one(redis_server)
    client.set(items[0].run.claim_keys[1], "another run", px=300)  # busy until it lapses
    starter = Starter(scripts.client(client), "w1", 120)
    starter.exchange([], items, None)
    assert items[0].run.claim_reply[0] == 3, "busy"
    real = perform.claim

    def late(conn: redis.Redis, run: Any, *poll: Any) -> Any:
        answer = real(conn, run, *poll)  # polled until the other lease lapsed: claimed
        monkeypatch.setattr(perform, "claim", real)
        _lose_claim(client, items[0])
        time.sleep(0.2)
        return answer

    monkeypatch.setattr(perform, "claim", late)
    assert not runs(client, starter, items[0]), "started on a claim older than its lease"


@contextlib.contextmanager
def supervisor() -> Iterator[Callable[[], str]]:
    """This process's leases told to a pipe, as to the pool's supervisor; what it said since last asked."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    lease.supervise(Channel(write_fd))

    def told() -> str:
        return os.read(read_fd, 65536).decode() if select.select([read_fd], [], [], 0)[0] else ""

    try:
        yield told
    finally:
        lease.supervise(None)
        os.close(read_fd)
        os.close(write_fd)


def test_the_supervisor_hears_at_once_of_the_leases_a_turns_outcomes_freed(redis_server: RedisServer) -> None:
    """A freed lease is let go of in the turn that freed it, not once 256 pile up (review, item 2).

    Redis back from a snapshot (or a lagging replica promoted) can bring back a lease an outcome
    deleted, under the same token: a supervisor still holding the token renews it for good, the
    job looks running, and a later delivery of its key waits for it forever.
    """
    client, items = take_one(redis_server)
    starter = Starter(scripts.client(client), "w1", 120)
    with supervisor() as told:
        starter.exchange([], items, None)
        assert items[0].run.token in told(), "held"
        conclude(items[0].run, 1, None)
        starter.exchange(items, [], None)  # a turn that ends jobs and starts none
        said = told()
    assert said, "the supervisor was not told: it renews a lease the outcome deleted"
    assert json.loads(said) == {"r": [items[0].run.token]}, f"told: {said!r}"


def test_async_deliveries_of_one_key_do_not_take_every_executor_thread_polling(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of i26-pool, item 3: the key's holder must claim again and finds no thread for it.

    Three ``async def`` deliveries of one key on a loop whose default executor has two threads;
    the holder's claim is read 0.1 s late (so it is made again before its call). Before the fix
    the two others polled the busy key on both executor threads for good, and nothing ran.
    """
    push(redis_server.url, 3, key="K")
    client = redis_server.client()
    items = take(client, 3)
    conn = scripts.client(client)
    starter = Starter(conn, "w1", 120)
    performer = Performer(conn, starter=starter)
    runner = Runner(2, 10, performer.work, performer.work_async, performer.stuck)
    performer.runner = runner
    ran: list[str] = []

    async def task(a: int, _b: int) -> int:
        ran.append(str(a))
        return a

    real, late = perform.claim, []

    def claim_read_late(conn_: redis.Redis, run: Any, poll: Any = None) -> Any:
        answer = real(conn_, run, *([poll] if poll is not None else []))
        if answer is perform.CLAIMED and not late:
            late.append(run)
            time.sleep(0.1)  # the reply read late: the claim is made again before the call
        return answer

    monkeypatch.setattr(perform, "claim", claim_read_late)
    loop, executor = runner._event_loop(), ThreadPoolExecutor(2)
    loop.call_soon_threadsafe(loop.set_default_executor, executor)
    try:
        for item in items:
            item.run.func = task
            item.run.deferred_end = True
            runner.start_async(item)
        done: list[Taken] = []
        deadline = time.monotonic() + 2 * items[0].run.d.lease_s
        while len(done) < 3 and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                ended = runner.done.get(timeout=0.1)
                done.append(ended)
                starter.exchange([ended] if not ended.dropped else [], [], None)  # the engine's END
    finally:
        runner.close()
        executor.shutdown(wait=False, cancel_futures=True)  # before the fix: its threads poll for good
        while loop.is_running():
            time.sleep(0.01)
        loop.close()
    assert len(done) == 3, f"{len(done)} of 3 done; ran: {ran}"
    assert len(ran) == 1, f"the key ran once: {ran}"


def test_a_claim_made_again_that_finds_its_own_lease_extends_it(redis_server: RedisServer) -> None:
    """Review of i26-pool, item 5b: made again (held up, or its reply lost), it counts from now."""
    client, items = take_one(redis_server)
    args = start_args(items)
    assert scripts.call(client, batch_scripts.START, [], args)[0][0] == 0
    lease_key = items[0].run.claim_keys[1]
    client.pexpire(lease_key, 100)  # most of the lease gone by the time it is made again
    assert scripts.call(client, batch_scripts.START, [], args)[0][0] == 0, "its own lease"
    assert client.pttl(lease_key) > 1000, "the claim made again counts from now"


def test_a_claim_made_again_is_held_by_the_supervisor_again(redis_server: RedisServer) -> None:
    """Review of i26-pool, item 5c: the supervisor forgets a lease the first time it finds it gone.

    A claim made again (its thread held up; the lease may have lapsed and been taken again)
    is a lease the supervisor must renew again: the task that now starts may hold the GIL.
    """
    client, items = take_one(redis_server)
    starter = Starter(scripts.client(client), "w1", 120)
    with supervisor() as told:
        starter.exchange([], items, None)
        told()  # held (test_the_supervisor_hears_...)
        items[0].claimed_at -= FRESH_S * 10  # its thread held up: made again before the call
        Performer(scripts.client(client), starter=starter).work(items[0])
        said = told()
        release(items[0].run)
    assert items[0].run.token in said, f"the supervisor was not told again: {said!r}"


def test_a_failed_tasks_data_goes_with_its_error_not_at_the_next_collection(
    redis_server: RedisServer,
) -> None:
    """``perform`` kept the error in a local of the frame its traceback holds: a reference cycle,
    so a failed task's frames and data waited for the cyclic collector, which a pool process
    runs far less often (review of ``worker/gcpace.py``: 1,500 failing 1 MB tasks held 330 MB)."""
    client, [item] = take_one(redis_server)
    assert scripts.call(client, batch_scripts.START, [], start_args([item]))[0][0] == 0
    seen: list[weakref.ref[object]] = []

    class Data:
        pass

    def failing(*_args: object, **_kwargs: object) -> None:
        data = Data()  # a local of the task's frame, which the traceback holds
        seen.append(weakref.ref(data))
        raise ValueError("boom")

    item.run.func = failing
    was = gc.isenabled()
    gc.disable()
    try:
        ran = perform_run(client, item.run)
        assert isinstance(ran[1], ValueError)
        del ran
        assert seen[0]() is None, "freed by reference counts, as the error went"
    finally:
        if was:
            gc.enable()
        release(item.run)
