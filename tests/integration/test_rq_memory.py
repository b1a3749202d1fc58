"""The RQ transport's reads for the window and the memory gate, against a private redis-server.

``memory()`` reads ``INFO memory`` without redis-py's parser of ``INFO`` and ``queue_lengths``
sends one ``LLEN`` for one queue, a pipeline for several (docs/forwarder.md, "The window"):
each is checked here against what redis-py's public calls read from the same server.
"""

from __future__ import annotations

from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport


def test_memory_is_what_redis_py_reads_from_info_memory(redis_server: RedisServer) -> None:
    c = redis_server.client()
    transport = RQTransport(redis_server.url)
    try:
        for maxmemory, policy in ((0, "noeviction"), (64 << 20, "allkeys-lru")):
            c.config_set("maxmemory", maxmemory)
            c.config_set("maxmemory-policy", policy)
            got = transport.memory()
            info = c.info("memory")
            assert got is not None
            assert (got.maxmemory, got.policy) == (info["maxmemory"], info["maxmemory_policy"])
            assert (got.maxmemory, got.policy) == (maxmemory, policy)
            assert abs(got.used - info["used_memory"]) < 1 << 20  # two reads: the same within drift
    finally:
        c.config_set("maxmemory", 0)
        c.config_set("maxmemory-policy", "noeviction")
        transport.close()
        c.close()


def test_queue_lengths_of_one_queue_and_of_several(redis_server: RedisServer) -> None:
    c = redis_server.client()
    transport = RQTransport(redis_server.url)
    try:
        c.rpush(keys.rq_queue("a"), *range(3))
        c.rpush(keys.rq_queue("b"), *range(5))
        assert transport.queue_lengths([]) == {}
        assert transport.queue_lengths(["a"]) == {"a": 3}
        assert transport.queue_lengths(["missing"]) == {"missing": 0}
        assert transport.queue_lengths(["a", "b", "missing"]) == {"a": 3, "b": 5, "missing": 0}
    finally:
        transport.close()
        c.close()
