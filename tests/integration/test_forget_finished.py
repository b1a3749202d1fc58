"""What the harvest deletes from Redis where finished jobs leave it (docs/forwarder.md, "What Redis holds")."""

from __future__ import annotations

from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Finished
from hybridq.transport.rq import RQTransport


def test_a_harvested_batch_leaves_redis_in_one_call_and_each_jobs_part_is_its_own(
    redis_server: RedisServer,
) -> None:
    """RQ's copies go, an implicit key's outcome is kept a while, an explicit key's is untouched.

    One script call for the batch (a call per job cost Redis more than the rest of the harvest),
    and a job whose cleanup fails (a registry of another type) spoils no other's.
    """
    client = redis_server.client()
    for job_id, queue in (("a", "q"), ("b", "bad"), ("c", "q")):
        client.hset(keys.rq_job(job_id), "status", "finished")
        client.xadd(f"{keys.RQ_PREFIX}:results:{job_id}", {"type": "1"})
        client.zadd(keys.rq_registry("finished", queue), {job_id: 1})
    client.rpush(keys.rq_registry("failed", "bad"), "not a registry")
    client.set(keys.result("ka"), "{}")  # implicit key, no TTL
    client.set(keys.result("kb"), "{}", ex=3600)  # implicit key, its part fails before its TTL
    client.set(keys.result("kc"), "{}", ex=3600)  # explicit key: the cross-journal contract
    transport = RQTransport(redis_server.url)
    client.config_resetstat()
    transport.drop_finished(
        [
            Finished("a", "ka", "q", implicit_key=True),
            Finished("b", "kb", "bad", implicit_key=True),
            Finished("c", "kc", "q", implicit_key=False),
        ],
        result_ttl_s=15,
    )
    assert int(client.info("commandstats")["cmdstat_evalsha"]["calls"]) == 1
    assert not client.exists(keys.rq_job("a"), keys.rq_job("b"), keys.rq_job("c"))
    assert not client.exists(*(f"{keys.RQ_PREFIX}:results:{j}" for j in "abc"))
    assert client.zrange(keys.rq_registry("finished", "q"), 0, -1) == []
    assert 0 < client.pttl(keys.result("ka")) <= 15_000
    assert client.ttl(keys.result("kb")) > 3000, "its part stopped at the bad registry"
    assert client.ttl(keys.result("kc")) > 3000
    transport.close()
