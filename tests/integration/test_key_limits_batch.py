"""The per-key limits in the pool's batch scripts: several runs of one key in one script call.

A call reads Redis's clock once, and drops a key's lapsed slots (at its concurrency) and its
starts out of the period once (hybridq.worker.limit_scripts ``limit_trim``), not once per job
(docs/benchmarks.md): the counts each claim sees must be what a trim per claim would give. The
ended runs kept are not trimmed: they are in sets by time that expire (``limit_end``).
"""

from __future__ import annotations

import time
from typing import Any

import redis
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import Delivery, keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from hybridq.worker import batch_end, batch_scripts, scripts
from hybridq.worker.intake import Resolver, prepare
from hybridq.worker.run import conclude
from hybridq.worker.runner import Taken

QUEUE = "limited-batch"
OWNER = "limited-owner"


def take_limited(
    server: RedisServer, n: int, limit: str | list[str], leases: list[float] | None = None
) -> tuple[redis.Redis, list[Taken]]:
    """``n`` jobs of one limited key pushed and taken; the limits' epoch long begun (no quarantine).

    ``limit``: one policy for all, or each job's (a policy changed); ``leases``: each job's lease (s).
    """
    limits = limit if isinstance(limit, list) else [limit] * n
    lease_s = leases or [60.0] * n
    now = time.time()
    ids = [new_job_id(now) for _ in range(n)]
    envs = [
        Envelope(id=j, func="tests.tasks.add", args=(i, 1), queue=QUEUE, idempotency_key=j, created_at=now)
        for i, j in enumerate(ids)
    ]
    transport = RQTransport(server.url)
    try:
        transport.push(
            [
                Delivery(env, OWNER, ("w", 0, i), limit=limits[i], lease_s=lease_s[i])
                for i, env in enumerate(envs)
            ]
        )
    finally:
        transport.close()
    client = server.client()
    client.set(keys.LIMITS_EPOCH, f"1:{client.info('server')['run_id']}")
    taken = batch_scripts.take(client, [keys.rq_queue(QUEUE)], n)
    items = [prepare(job_id.decode(), QUEUE, fields, Resolver()) for job_id, _, fields in taken]
    return client, [item for item in items if item is not None]


def start(client: redis.Redis, items: list[Taken]) -> list[Any]:
    args: list[Any] = [keys.RQ_PREFIX, "w1", "2026-01-01T00:00:00.000000Z"]
    for i, item in enumerate(items):
        item.exec_id, item.started = f"e{i}", time.time()
        args += [item.job_id, QUEUE, item.exec_id, *batch_scripts.claim_part(item)]
    return [(int(r[0]), r[1]) for r in scripts.call(client, batch_scripts.START, [], args)]


def end(client: redis.Redis, items: list[Taken]) -> list[Any]:
    for item in items:
        conclude(item.run, 1, None)
    return list(scripts.call(client, batch_end.END, [], batch_end.end_args("w1", items)))


def token(item: Taken) -> bytes:
    return str(item.run.claim_args[0]).encode()


def test_one_start_call_frees_a_lapsed_slot_and_counts_its_own_claims(redis_server: RedisServer) -> None:
    client, items = take_limited(redis_server, 3, "2,0,0,tenant:b1")
    run_key = f"{keys.LIMIT_PREFIX}tenant:b1:run"
    now_ms = int(time.time() * 1000)
    client.zadd(run_key, {"dead-run#L2,0,0,tenant:b1": now_ms - 1000})  # a killed worker's, lapsed
    replies = start(client, items)
    assert [r[0] for r in replies] == [0, 0, 4], replies
    assert replies[2][1] == b"limited: concurrency", "the call's own two claims hold both slots"
    assert set(client.zrange(run_key, 0, -1)) == {token(items[0]), token(items[1])}, "the lapsed one dropped"


def test_a_live_slot_of_another_run_is_counted_in_one_start_call(redis_server: RedisServer) -> None:
    client, items = take_limited(redis_server, 3, "2,0,0,tenant:b2")
    run_key = f"{keys.LIMIT_PREFIX}tenant:b2:run"
    client.zadd(run_key, {"live-run#L2,0,0,tenant:b2": int(time.time() * 1000) + 60_000})
    assert [r[0] for r in start(client, items)] == [0, 4, 4]


def test_one_end_call_frees_every_slot_and_keeps_no_end_its_stored_outcome_names(
    redis_server: RedisServer,
) -> None:
    # Each outcome is stored for a day (the delivery's key TTL): a late renewal reads the run's
    # end there, so no end goes in the ended sets (one SADD per limited job fewer).
    client, items = take_limited(redis_server, 3, "5,0,0,tenant:b3")
    assert [r[0] for r in start(client, items)] == [0, 0, 0]
    assert end(client, items) == [0, 0, 0]
    assert client.zcard(f"{keys.LIMIT_PREFIX}tenant:b3:run") == 0, "every slot freed"
    assert not client.keys(f"{keys.LIMITS_ENDED}:*"), "no end kept: the stored outcomes name them"
    for item in items:
        tok = token(item).decode()
        assert int(scripts.renew(client, str(item.run.claim_keys[1]), tok, 60_000)) & 4 == 0, (
            "no slot taken back"
        )
    assert client.zcard(f"{keys.LIMIT_PREFIX}tenant:b3:run") == 0
    assert int(client.get(f"{keys.LIMIT_PREFIX}tenant:b3:queued") or 0) == -3, "each copy left once"
    assert client.pttl(f"{keys.LIMIT_PREFIX}tenant:b3:queued") > 0


def test_a_later_run_with_a_shorter_rate_period_trims_the_starts_again(redis_server: RedisServer) -> None:
    """Two policies of one key in one call (a policy changed): each run's count is its own period's."""
    client, items = take_limited(redis_server, 2, ["0,2,3600000,tenant:b5", "0,2,1000,tenant:b5"])
    now_ms = int(time.time() * 1000)
    starts = f"{keys.LIMIT_PREFIX}tenant:b5:starts"
    client.zadd(starts, {"s1": now_ms - 5000, "s2": now_ms - 4000})  # in the hour, not in the second
    replies = start(client, items)
    assert replies == [(4, b"limited: rate"), (0, b"")], replies


def test_a_copy_that_leaves_without_running_keeps_the_queued_counts_expiry(redis_server: RedisServer) -> None:
    """A cancelled copy's (short) lease between two holds: the count expires two of the holds' leases on."""
    client, items = take_limited(redis_server, 3, "5,0,0,tenant:b6", leases=[60.0, 5.0, 60.0])
    client.hset(keys.rq_job(items[1].job_id), "hybridq_cancel", "1")
    replies = start(client, items)
    assert [r[0] for r in replies] == [0, 5, 0], replies
    assert client.pttl(f"{keys.LIMIT_PREFIX}tenant:b6:queued") > 60_000


def test_a_shorter_lease_never_shortens_the_life_of_a_longer_runs_slot(redis_server: RedisServer) -> None:
    """Concurrency 2: runs of 30 s and 1 s leases start in one call, the short one ends. The key's
    set of slots lived 2 short leases (3 s), then vanished with the long run's live slot, and two
    more runs were admitted: 3 running under a limit of 2 (review; the test fails before)."""
    client, items = take_limited(redis_server, 2, "2,0,0,tenant:b7", leases=[30.0, 1.0])
    assert [r[0] for r in start(client, items)] == [0, 0]
    end(client, items[1:])
    run_key = f"{keys.LIMIT_PREFIX}tenant:b7:run"
    assert client.pttl(run_key) > 60_000, "the set lives two of the long run's leases"
    client2, more = take_limited(redis_server, 2, "2,0,0,tenant:b7", leases=[1.0, 1.0])
    assert [r[0] for r in start(client2, more)] == [0, 4], "one slot left: the long run still holds one"
    assert client.pttl(run_key) > 60_000


def test_a_queued_count_taken_through_zero_in_one_start_call_still_expires(redis_server: RedisServer) -> None:
    """From 2, three claims in one call: 1 (its expiry set), 0 (the key dropped), -1: a new key,
    whose expiry the call must set again, not skip as already made (else -1 stays for good)."""
    client, items = take_limited(redis_server, 3, "5,0,0,tenant:b8")
    queued = f"{keys.LIMIT_PREFIX}tenant:b8:queued"
    client.set(queued, 2)
    assert [r[0] for r in start(client, items)] == [0, 0, 0]
    assert int(client.get(queued) or 0) == -1
    assert client.pttl(queued) > 0, "below zero: it expires"


def test_a_start_sent_again_takes_each_copy_off_the_queued_count_once(redis_server: RedisServer) -> None:
    """A refused copy and an admitted one, the call sent again (its reply lost): each counted once."""
    client, items = take_limited(redis_server, 2, "1,0,0,tenant:b9")
    queued = f"{keys.LIMIT_PREFIX}tenant:b9:queued"
    client.set(queued, 2, px=60_000)
    assert [r[0] for r in start(client, items)] == [0, 4]
    assert [r[0] for r in start(client, items)] == [0, 4]
    assert int(client.get(queued) or 0) == 0
    assert all(client.hget(keys.rq_job(i.job_id), "hybridq_left") == b"1" for i in items)


def test_runs_of_different_leases_in_one_start_call_each_lapse_at_their_own_lease(
    redis_server: RedisServer,
) -> None:
    # From the review of the per-call texts (limit_until): one made by the clock alone, not by
    # the lease too, gave a 60 s run a 5 s slot (a second run of the key let in). Fails then.
    client, items = take_limited(redis_server, 2, "10,0,0,tenant:lz", leases=[5.0, 60.0])
    assert [r[0] for r in start(client, items)] == [0, 0]
    run = f"{keys.LIMIT_PREFIX}tenant:lz:run"
    scores = {i.run.claim_args[1]: client.zscore(run, token(i)) for i in items}
    short, long_ = (scores[k] for k in sorted(scores))
    assert short is not None
    assert long_ is not None
    assert long_ - short == 55_000, scores  # the same clock: each its own lease ahead


def test_a_kept_end_and_a_plain_end_in_one_end_call_go_to_their_own_sets(redis_server: RedisServer) -> None:
    # From the same review: the ended set's name made once per call, by kind (the minute's and
    # the hour's): one name for both put a kept end in the minute's set (a late renewal then
    # took its slot back after a minute). Fails then.
    client, items = take_limited(redis_server, 2, "10,0,0,tenant:ek")
    assert [r[0] for r in start(client, items)] == [0, 0]
    a = items[0]
    later = f"{a.job_id}/2/host-2/bbbb#L10,0,0,tenant:ek"
    stored = f'{{"outcome":"succeeded","job_id":"{a.job_id}","attempt":2,"requeue":0,"token":"{later}"}}'
    client.set(str(a.run.claim_keys[0]), stored)  # a later attempt's success: a's outcome keeps it
    # b's outcome replaces an earlier limited run's failure: that run's end goes in the minute's set.
    b = items[1]
    earlier = f"{b.job_id}/0/host-0/cccc#L10,0,0,tenant:ek"
    failed = f'{{"outcome":"failed","job_id":"{b.job_id}","attempt":0,"requeue":0,"token":"{earlier}"}}'
    client.set(str(b.run.claim_keys[0]), failed)
    end(client, items)
    sets = {k.decode(): client.smembers(k) for k in client.keys(f"{keys.LIMITS_ENDED}:*")}
    hour = set().union(*[v for k, v in sets.items() if ":h" in k])
    minute = set().union(*[v for k, v in sets.items() if ":m" in k])
    assert token(a) in hour, sets
    assert token(a) not in minute, sets
    assert earlier.encode() in minute, sets
    assert earlier.encode() not in hour, sets
    assert token(b) not in minute | hour, "b's stored outcome names it"
    assert all(client.pttl(k) > 0 for k in sets), "each set expires"


def test_runs_of_leases_a_b_a_in_one_start_call_each_lapse_at_their_own_lease(
    redis_server: RedisServer,
) -> None:
    # The per-call cache of a lease's text (limit_scripts) keeps the last lease only: A, B, A
    # must each still get their own (review of i30lua, LOW-3).
    client, items = take_limited(redis_server, 3, "10,0,0,tenant:aba", leases=[5.0, 60.0, 5.0])
    assert [r[0] for r in start(client, items)] == [0, 0, 0]
    run = f"{keys.LIMIT_PREFIX}tenant:aba:run"
    scores = [client.zscore(run, token(i)) for i in items]
    assert None not in scores
    first, second, third = (int(s or 0) for s in scores)
    assert abs((second - first) - 55_000) < 50, scores
    assert abs(third - first) < 50, scores


def test_two_policies_for_one_key_in_one_start_call_each_decides_its_own_claim(
    redis_server: RedisServer,
) -> None:
    # A policy changed while copies of the old one wait: each claim enforces its delivery's.
    limits = ["3,0,0,tenant:pp", "1,0,0,tenant:pp", "3,0,0,tenant:pp"]
    client, items = take_limited(redis_server, 3, limits)
    replies = start(client, items)
    assert [r[0] for r in replies] == [0, 4, 0], replies
    assert replies[1][1] == b"limited: concurrency"
