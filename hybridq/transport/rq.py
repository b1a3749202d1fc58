"""The RQ transport: jobs become ordinary RQ jobs (JSON serializer) in RQ queues on Redis.

This is the only module through which the forwarder talks to RQ and Redis. What it pushes runs
under a plain ``rq worker --serializer rq.serializers.JSONSerializer QUEUE``.

A re-push must not queue a job twice: RQ's own ``enqueue`` pushes a reused job id onto the queue
again. Each job is therefore saved by a small Lua script that does nothing when the job hash
already exists (the same idea as RQ 3's ``unique=True``, which cannot be pipelined), and a batch is
sent as one pipeline of script calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import redis
from redis.exceptions import RedisError
from rq import Queue
from rq import Retry as RQRetry
from rq.job import Job
from rq.serializers import JSONSerializer

from hybridq import keys
from hybridq.envelope import Envelope
from hybridq.errors import TransportError

from .base import PushResult, Transport

__all__ = ["RQTransport"]

# KEYS: job hash, queue list, set of queues. ARGV: job id, then field/value pairs of the hash.
_PUSH_IF_NEW = """
if redis.call("EXISTS", KEYS[1]) == 1 then
    return 0
end
redis.call("HSET", KEYS[1], unpack(ARGV, 2))
redis.call("RPUSH", KEYS[2], ARGV[1])
redis.call("SADD", KEYS[3], KEYS[2])
return 1
"""

#: Socket timeout: a hung Redis (SIGSTOP, CLIENT PAUSE) surfaces as an error, not a stuck forwarder.
DEFAULT_SOCKET_TIMEOUT_S = 5.0


class RQTransport(Transport):
    """Pushes envelopes into RQ queues.

    Args:
        url: a Redis URL (``redis://host:port/db``, ``unix:///path?db=0``); the password, if any,
            belongs in the URL or ``REDISCLI_AUTH``-style configuration, never on a command line.
        connection: an existing client instead of ``url``.
        socket_timeout_s: how long one Redis call may hang before it counts as a failure.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        connection: redis.Redis | None = None,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    ) -> None:
        if connection is None:
            if url is None:
                raise ValueError("RQTransport needs a url or a connection")
            connection = redis.Redis.from_url(
                url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
            )
        self.connection = connection
        self._script = connection.register_script(_PUSH_IF_NEW)
        self._queues: dict[str, Queue] = {}

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = Queue(name, connection=self.connection, serializer=JSONSerializer)
        return queue

    def to_rq_job(self, env: Envelope) -> Job:
        """The RQ job for an envelope: same id, JSON-serialized call, the envelope's options."""
        queue = self._queue(env.queue)
        job = queue.create_job(
            env.func,
            args=list(env.args),
            kwargs=dict(env.kwargs),
            timeout=_whole_seconds(env.timeout_s),
            result_ttl=_whole_seconds(env.result_ttl_s),
            description=env.description,
            job_id=env.id,
            meta={**env.meta, "hybridq": {"key": env.idempotency_key, "created_at": env.created_at}},
            retry=_rq_retry(env),
        )
        # When the job was accepted, not when it reached Redis (it may have waited out an outage).
        job.created_at = datetime.fromtimestamp(env.created_at, tz=UTC)
        queue._prepare_for_queue(job)  # origin, enqueued_at, default timeout, status "queued"
        return job

    def push(self, jobs: Sequence[Envelope]) -> PushResult:
        """Queue every job not already known to Redis, as one pipeline (see :class:`Transport`)."""
        if not jobs:
            return PushResult(0, 0)
        try:
            pipe = self.connection.pipeline(transaction=False)
            for env in jobs:
                job = self.to_rq_job(env)
                self._script(
                    keys=[keys.rq_job(env.id), keys.rq_queue(env.queue), keys.rq_queues()],
                    args=[env.id, *_hash_fields(job)],
                    client=pipe,
                )
            results: list[Any] = pipe.execute()
        except RedisError as exc:
            raise TransportError(f"Redis: {exc}") from exc
        pushed = sum(1 for r in results if r == 1)
        return PushResult(pushed, len(results) - pushed)

    def ping(self) -> None:
        """Raise TransportError unless Redis answers PING."""
        try:
            self.connection.ping()
        except RedisError as exc:
            raise TransportError(f"Redis: {exc}") from exc

    def close(self) -> None:
        """Close the connection pool."""
        self.connection.close()


def _rq_retry(env: Envelope) -> RQRetry | None:
    """The envelope's retry policy as RQ's (interim: RQ keeps the attempt count in Redis).

    Delays are the policy's without jitter. RQ runs a retry with a delay only when a worker
    runs its scheduler (``rq worker --with-scheduler``); retries with no delay need nothing.
    """
    policy = env.retry
    if policy is None or policy.max_attempts <= 1:
        return None
    intervals = [
        round(min(policy.backoff_max_s, policy.backoff_s * 2**attempt))
        for attempt in range(policy.max_attempts - 1)
    ]
    return RQRetry(max=policy.max_attempts - 1, interval=intervals)


def _whole_seconds(value: float | None) -> int | None:
    return None if value is None else max(1, round(value))


def _hash_fields(job: Job) -> list[Any]:
    """The job hash as RQ itself saves it (``Job.to_dict``), flattened for HSET."""
    fields: list[Any] = []
    for name, value in job.to_dict().items():
        if value is not None:
            fields.append(name)
            fields.append(value if isinstance(value, bytes | str) else str(value))
    return fields
