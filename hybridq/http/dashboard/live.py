"""What only Redis knows of a job right now: its RQ job, a claim in flight, the epoch.

Shown beside the durable trace, labelled as Redis's, and only when Redis answers: none of it
survives a ``FLUSHALL``, and the trace never depends on it.
"""

from __future__ import annotations

from redis.exceptions import RedisError

from hybridq.errors import TransportError
from hybridq.protocol import keys
from hybridq.transport.rq import RQTransport

__all__ = ["queue_lengths", "redis_view"]

_RQ_FIELDS = ("status", "enqueued_at", "started_at", "ended_at", "worker_name", "origin")


def redis_view(url: str, job_id: str, key_id: str | None, owner: str | None) -> dict[str, str] | None:
    """Redis's facts of ``job_id`` (label -> value); ``None`` if Redis does not answer.

    Args:
        url: the Redis URL.
        job_id: the job.
        key_id: the job's idempotency key id (its lease: a claim in flight).
        owner: the forwarder's name (its epoch key).
    """
    transport = RQTransport(url, socket_timeout_s=1.0)
    try:
        conn = transport.connection
        out: dict[str, str] = {}
        raw = conn.hmget(keys.rq_job(job_id), list(_RQ_FIELDS))
        for name, value in zip(_RQ_FIELDS, raw, strict=True):
            if value is not None:
                out[f"rq {name}"] = _text(value)
        if not out:
            out["rq job"] = "none in Redis (never pushed, expired, or Redis lost it)"
        if key_id is not None:
            lease = conn.get(keys.lease(key_id))
            if lease is not None:
                # The lease token is "<job id>/<attempt>/<host>/<pid>/<random>" (worker.run).
                parts = _text(lease).split("/")
                out["claim in flight"] = (
                    f"run {parts[1]} by {parts[2]}/{parts[3]}" if len(parts) >= 4 else "held"
                )
        if owner is not None:
            epoch = conn.get(keys.epoch(owner))
            out["epoch key"] = _text(epoch) if epoch is not None else "missing"
    except (RedisError, TransportError, OSError):
        return None
    else:
        return out
    finally:
        transport.close()


def queue_lengths(url: str) -> dict[str, int] | None:
    """The length of every RQ queue this Redis knows (jobs pushed, no worker took them yet).

    ``None`` if Redis does not answer: the page shows ``-``, never a stale number.
    """
    transport = RQTransport(url, socket_timeout_s=1.0)
    try:
        conn = transport.connection
        prefix = keys.rq_queue("")
        names = sorted(_text(raw).removeprefix(prefix) for raw in conn.smembers(keys.rq_queues()))
        pipe = conn.pipeline(transaction=False)
        for name in names:
            pipe.llen(keys.rq_queue(name))
        return {name: int(n) for name, n in zip(names, pipe.execute(), strict=True) if name}
    except (RedisError, TransportError, OSError):
        return None
    finally:
        transport.close()


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
