"""The push's wire form (hybridq.transport.rq_push): one argument per job, a queue's keys once per call.

What Redis holds after a push is checked by the transport contract and
``test_job_hash_is_what_rq_writes``; these check what travels, and the batches it is split into.
"""

from __future__ import annotations

from typing import Any

import pytest
from hybridq.errors import HybridqError
from hybridq.protocol import Overwrite
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.transport.rq_push import PUSH_CHUNK

from tests.integration.test_transport_contract import delivery


def recording(transport: RQTransport) -> list[tuple[list[Any], list[Any]]]:
    """The keys and arguments of every push script call ``transport`` makes from now on."""
    calls: list[tuple[list[Any], list[Any]]] = []
    script = transport._script

    def call(*, keys: list[Any], args: list[Any], client: Any) -> Any:
        calls.append((keys, args))
        return script(keys=keys, args=args, client=client)

    transport._script = call  # type: ignore[method-assign]
    return calls


def test_a_push_sends_a_job_as_its_key_and_one_argument(redis_server: RedisServer) -> None:
    """Fails before: five keys and ~20 arguments per job (the fields' names and values apart)."""
    transport = RQTransport(redis_server.url)
    try:
        calls = recording(transport)
        jobs = [delivery("alpha") for _ in range(PUSH_CHUNK + 1)] + [delivery("beta") for _ in range(3)]
        jobs.insert(1, delivery("beta"))  # queues interleaved: each queue's own calls, in order
        result = transport.push(jobs)
        assert (result.pushed, result.already_present) == (len(jobs), 0)
        sent = sum(len(k) + len(a) for k, a in calls)
        assert len(calls) == 3  # alpha in two chunks, beta in one
        assert sent == 2 * len(jobs) + 6 * len(calls)  # per call: 4 keys, the push time, the queue
        for queue in ("alpha", "beta"):
            ids = [d.envelope.id for d in jobs if d.envelope.queue == queue]
            assert [i.decode() for i in transport.connection.lrange(f"rq:queue:{queue}", 0, -1)] == ids
            assert transport.connection.sismember("rq:queues", f"rq:queue:{queue}")
    finally:
        transport.close()


def test_one_job_twice_in_a_push_is_queued_once(redis_server: RedisServer) -> None:
    transport = RQTransport(redis_server.url)
    try:
        first = delivery()
        again = Delivery(first.envelope, "owner1", first.loc, attempt=2, force=True)
        assert again.overwrite is not Overwrite.NEVER
        result = transport.push([first, again])
        assert result.pushed == 2  # the second replaced the first
        assert transport.connection.lrange("rq:queue:default", 0, -1) == [first.envelope.id.encode()]
        assert transport.connection.hget(f"rq:job:{first.envelope.id}", "hybridq_run") == b"2"
    finally:
        transport.close()


def test_a_queued_job_leaves_rqs_failed_and_canceled_registries(redis_server: RedisServer) -> None:
    transport = RQTransport(redis_server.url)
    try:
        jobs = [delivery() for _ in range(3)]
        for name in ("failed", "canceled"):
            transport.connection.zadd(f"rq:{name}:default", {j.envelope.id: 1 for j in jobs[:2]})
        transport.push(jobs)
        for name in ("failed", "canceled"):
            assert transport.connection.zcard(f"rq:{name}:default") == 0
    finally:
        transport.close()


def test_a_chunk_queues_its_ids_with_one_rpush(redis_server: RedisServer) -> None:
    transport = RQTransport(redis_server.url)
    try:
        jobs = [delivery() for _ in range(5)]
        transport.connection.config_resetstat()
        assert transport.push(jobs).pushed == 5
        stats = transport.connection.info("commandstats")
        assert stats["cmdstat_rpush"]["calls"] == 1, "one RPUSH per script call, not one per job"
        ids = [j.envelope.id.encode() for j in jobs]
        assert transport.connection.lrange("rq:queue:default", 0, -1) == ids, "in their order"
    finally:
        transport.close()


def test_a_queue_key_of_another_type_fails_the_push_before_any_job_is_written(
    redis_server: RedisServer,
) -> None:
    """Its ids are pushed last: a hash written and never queued would make a re-push do nothing."""
    transport = RQTransport(redis_server.url)
    try:
        jobs = [delivery() for _ in range(3)]
        transport.connection.set("rq:queue:default", "not a list")
        with pytest.raises(HybridqError, match="WRONGTYPE"):
            transport.push(jobs)
        assert not any(transport.connection.exists(f"rq:job:{j.envelope.id}") for j in jobs)
        transport.connection.delete("rq:queue:default")
        assert transport.push(jobs).pushed == 3, "pushed again: queued"
        assert transport.connection.llen("rq:queue:default") == 3
    finally:
        transport.close()


@pytest.mark.parametrize("bad", ["job", "intermediate"])
def test_an_error_partway_through_a_chunk_still_queues_the_jobs_written_before_it(
    redis_server: RedisServer, bad: str
) -> None:
    """A forced job's key, or the intermediate list, of another type fails the call at that job:
    the new jobs before it were written, so they must be queued too (a re-push of a job whose
    hash exists does nothing: it would wait unqueued)."""
    transport = RQTransport(redis_server.url)
    conn = transport.connection
    try:
        old = delivery()
        transport.push([old])
        conn.lrem("rq:queue:default", 0, old.envelope.id)
        bad_key = f"rq:job:{old.envelope.id}" if bad == "job" else "rq:queue:default:intermediate"
        conn.delete(bad_key)
        conn.set(bad_key, "not hybridq's")
        new = delivery()
        forced = Delivery(old.envelope, "owner1", old.loc, attempt=2, force=True)
        with pytest.raises(HybridqError, match="WRONGTYPE"):
            transport.push([new, forced])
        assert conn.lrange("rq:queue:default", 0, -1) == [new.envelope.id.encode()]
        conn.delete(bad_key)
        assert transport.push([new, forced]).pushed == 1, "the forced one, once its key is readable"
        assert conn.lrange("rq:queue:default", 0, -1) == [new.envelope.id.encode(), old.envelope.id.encode()]
    finally:
        transport.close()
