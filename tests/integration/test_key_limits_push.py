"""The push adds the limited copies it queues to their keys' queued counts (transport.rq_push).

In the same script call as the push (docs/forwarder.md, "Limits per key"): no claim comes
before its copy's add, and no crash falls between them. Exact per copy queued: a copy Redis
kept is not added again, a copy that replaces one still counted (no claim or cancel marked it
``hybridq_left``) takes its place, and a push cut short by an error adds the copies it queued.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.errors import TransportError
from hybridq.protocol import Delivery, Overwrite, keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport

LEASE_S = 2.0


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url, socket_timeout_s=2.0)
    try:
        yield transport
    finally:
        transport.close()


def job(
    key: str | None, limited: bool = True, overwrite: Overwrite = Overwrite.NEVER, env: Envelope | None = None
) -> Delivery:
    job_id = new_job_id()
    env = env or Envelope(
        id=job_id,
        idempotency_key=job_id,
        func="tests.tasks.add",
        queue="default",
        created_at=1_700_000_000.0,
        args=(1, 2),
        limit_key=key,
    )
    limit = f"5,0,0,{key}" if limited and key else None
    return Delivery(env, "owner1", ("w", 0, 64), overwrite=overwrite, lease_s=LEASE_S, limit=limit)


def count(conn: redis.Redis, key: str) -> int:
    return int(conn.get(f"{keys.LIMIT_PREFIX}{key}:queued") or 0)


def test_a_push_adds_the_copies_it_queued_to_their_keys_counts_in_the_same_call(
    transport: RQTransport,
) -> None:
    # Fails on main: the forwarder added them at its next step's read (KEY_USE), so a claim
    # made before it took the count below zero, and a crash in between left it low.
    conn = transport.connection
    result = transport.push([job("a"), job("a"), job("b"), job("a"), job(None), job("c", limited=False)])
    assert result.pushed == 6
    assert (count(conn, "a"), count(conn, "b"), count(conn, "c")) == (3, 1, 0), "only limited copies"
    assert 0 < conn.pttl(f"{keys.LIMIT_PREFIX}a:queued") <= 2 * LEASE_S * 1000, "the backstop: two leases"


def test_a_copy_redis_kept_is_not_added_again(transport: RQTransport) -> None:
    conn = transport.connection
    jobs = [job("k1"), job("k1")]
    transport.push(jobs)
    transport.push(jobs)  # a restarted forwarder pushes them again: Redis kept them
    assert count(conn, "k1") == 2


def test_a_copy_replacing_one_still_counted_takes_its_place_and_one_replacing_a_claimed_copy_adds_one(
    transport: RQTransport,
) -> None:
    conn = transport.connection
    first = job("k2")
    transport.push([first])
    stranded = job("k2", overwrite=Overwrite.ALWAYS, env=first.envelope)
    assert transport.push([stranded]).pushed == 1  # delivered again: the copy never claimed
    assert count(conn, "k2") == 1, "the replaced copy never left the count: its place is taken"
    conn.hset(keys.rq_job(first.envelope.id), "hybridq_left", "1")  # a claim (or refusal) took it off
    conn.decr(f"{keys.LIMIT_PREFIX}k2:queued")
    assert transport.push([stranded]).pushed == 1
    assert count(conn, "k2") == 1, "the new copy is counted"


def test_a_copy_an_older_forwarder_pushed_replaced_by_a_newer_ones_push_takes_its_place(
    transport: RQTransport,
) -> None:
    # Mixed versions: a forwarder from before 2026-12-07 pushed without adding, and its gate's
    # next read added the copy (KEY_USE). Unclaimed, that copy carries no ``hybridq_left`` mark,
    # so the newer forwarder delivering it again (stranded) adds nothing: still one.
    conn = transport.connection
    old = job("k6", limited=False)  # the older push: no add
    transport.push([old])
    conn.incrby(f"{keys.LIMIT_PREFIX}k6:queued", 1)  # the older gate's read added it
    again = job("k6", overwrite=Overwrite.ALWAYS, env=old.envelope)
    assert transport.push([again]).pushed == 1
    assert count(conn, "k6") == 1
    assert conn.lrange("rq:queue:default", 0, -1).count(old.envelope.id.encode()) == 1


def test_a_push_cut_short_adds_the_copies_it_queued(transport: RQTransport) -> None:
    conn = transport.connection
    kept = job("k3")
    transport.push([kept])
    conn.set("rq:queue:default:intermediate", "not a list")  # the replace below fails there
    fresh = job("k3")
    with pytest.raises(TransportError):
        transport.push([fresh, job("k3", overwrite=Overwrite.ALWAYS, env=kept.envelope)])
    queued = {raw.decode() for raw in conn.lrange("rq:queue:default", 0, -1)}
    assert fresh.envelope.id in queued
    # The replaced copy left its queue uncounted-off: one high (the safe direction), until
    # its backstop; never low.
    assert count(conn, "k3") == 2
    conn.delete("rq:queue:default:intermediate")
    deadline = time.monotonic() + 2 * LEASE_S + 5
    while conn.exists(f"{keys.LIMIT_PREFIX}k3:queued") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert count(conn, "k3") == 0, "the backstop: gone two leases after the last add"
    transport.push([job("k3")])
    assert count(conn, "k3") == 1, "counted from zero again"


def test_a_count_of_the_wrong_type_fails_its_own_key_only(transport: RQTransport) -> None:
    conn = transport.connection
    conn.hset(f"{keys.LIMIT_PREFIX}evil:queued", "x", 1)
    result = transport.push([job("evil"), job("good")])
    assert result.pushed == 2
    assert count(conn, "good") == 1
    assert conn.type(f"{keys.LIMIT_PREFIX}evil:queued") == b"hash"


def test_one_limited_job_twice_in_a_push_is_counted_once(transport: RQTransport) -> None:
    conn = transport.connection
    first = job("k4")
    again = job("k4", overwrite=Overwrite.ALWAYS, env=first.envelope)
    assert transport.push([first, again]).pushed == 2  # the second replaced the first
    assert count(conn, "k4") == 1


def test_jobs_of_different_leases_in_one_push_keep_their_count_the_longer_lease(
    transport: RQTransport,
) -> None:
    conn = transport.connection
    short = job("k5")
    long = Delivery(job("k5").envelope, "owner1", ("w", 0, 64), lease_s=30.0, limit="5,0,0,k5")
    transport.push([short, long])
    assert count(conn, "k5") == 2
    assert 2 * LEASE_S * 1000 < conn.pttl(f"{keys.LIMIT_PREFIX}k5:queued") <= 60_000
