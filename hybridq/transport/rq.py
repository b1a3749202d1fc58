"""The RQ transport: jobs become ordinary RQ jobs (JSON serializer) in RQ queues on Redis.

This is the only module through which the forwarder talks to RQ and Redis. What it pushes runs
under a plain ``rq worker --serializer rq.serializers.JSONSerializer QUEUE``.

Every RQ job runs :func:`hybridq.worker.execute` with the delivery as its one argument; the
worker side claims the idempotency key, calls the task and reports back (see
:mod:`hybridq.worker`). The RQ job keeps the envelope's id, so ``rq.job.Job.fetch(job.id)`` works.

A re-push must not queue a job twice: RQ's own ``enqueue`` pushes a reused job id onto the queue
again. Each job is therefore saved by a small Lua script that does nothing when the job hash
already exists, and a batch is sent as one pipeline of script calls, each for up to
``rq_push.PUSH_CHUNK`` jobs of one queue: the push, its script and its encoding are
:mod:`hybridq.transport.rq_push`.

The Lua scripts are in :mod:`hybridq.transport.rq_scripts`; the job hash's field encodings and the
decoding of replies and events in :mod:`hybridq.transport.rq_codec`; what it reads of Redis for
the forwarder's figures (memory, queue lengths, key use, published stats) in
:mod:`hybridq.transport.rq_readings`, which :class:`RQTransport` inherits.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from redis.exceptions import RedisError
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from hybridq.errors import UnencodableJobs
from hybridq.protocol import ENTRY_POINT, keys
from hybridq.transport import redisurl
from hybridq.transport.redisurl import transport_error

from . import rq_push
from .base import (
    Delivery,
    Event,
    Finished,
    Probe,
    PushResult,
    RefillResult,
    StateToken,
    Verdict,
)
from .rq_codec import (
    _decode_event,
    _describe,
    _meta,
    _refused,
    _text,
    _whole_seconds,
)
from .rq_push import _PUSH_IF_NEW
from .rq_readings import RQReadings
from .rq_scripts import _CANCEL, _EVICT, _FORGET, _PROBE, _REFILL, _SET_EPOCH, _STATE

__all__ = ["RQTransport"]

#: Socket timeout: a hung Redis (SIGSTOP, CLIENT PAUSE) surfaces as an error, not a stuck forwarder.
DEFAULT_SOCKET_TIMEOUT_S = 5.0


class RQTransport(RQReadings):
    """Pushes envelopes into RQ queues.

    Args:
        url: a Redis URL (``redis://host:port/db``, ``unix:///path?db=0``); the password, if any,
            belongs in the URL or ``REDISCLI_AUTH``-style configuration, never on a command line.
        connection: an existing client instead of ``url``.
        socket_timeout_s: how long one Redis call may hang before it counts as a failure.
    """

    counts_limited_pushes = True  # (rq_push._PUSH_IF_NEW: docs/forwarder.md, "Limits per key")

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
            connection = redisurl.client(
                url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
            )
        self.connection = connection
        self._script = connection.register_script(_PUSH_IF_NEW)
        self._probe = connection.register_script(_PROBE)
        self._refill = connection.register_script(_REFILL)
        self._state = connection.register_script(_STATE)
        self._cancel = connection.register_script(_CANCEL)
        self._forget = connection.register_script(_FORGET)
        self._set_epoch = connection.register_script(_SET_EPOCH)
        self._key_use: Any = None
        self._queues: dict[str, Queue] = {}

    def _queue(self, name: str) -> Queue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = Queue(name, connection=self.connection, serializer=JSONSerializer)
        return queue

    def to_rq_job(self, delivery: Delivery) -> Job:
        """The RQ job for a delivery: the envelope's id and options, hybridq's entry point."""
        env = delivery.envelope
        queue = self._queue(env.queue)
        job = queue.create_job(
            ENTRY_POINT,
            args=[delivery.to_json()],
            timeout=_whole_seconds(env.timeout_s),
            result_ttl=_whole_seconds(env.result_ttl_s),
            description=env.description or _describe(env.func, env.args, env.kwargs),
            job_id=env.id,
            meta=_meta(delivery),
        )
        # When the job was accepted, not when it reached Redis (it may have waited out an outage).
        job.created_at = datetime.fromtimestamp(env.created_at, tz=UTC)
        queue._prepare_for_queue(job)  # origin, enqueued_at, default timeout, status "queued"
        return job

    def job_hash(self, delivery: Delivery, enqueued_at: str) -> list[Any]:
        """The fields of the job hash :meth:`to_rq_job` would save, as :meth:`push` writes them (flattened).

        Less the fields that are the same for every queued job (``rq_scripts.QUEUED_FIELDS``).
        Raises as :func:`~hybridq.transport.rq_push.job_fields`.
        """
        return rq_push.job_hash(self._fields(delivery), delivery.envelope.queue, enqueued_at)

    def _fields(self, delivery: Delivery) -> tuple[str | bytes, ...]:
        timeout = self._queue(delivery.envelope.queue)._default_timeout
        return rq_push.job_fields(delivery, timeout, self.default_result_ttl_s)

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        """Queue every job not already known to Redis, as one pipeline (see :class:`Transport`)."""
        if not jobs:
            return PushResult(0, 0)
        fields: list[tuple[str | bytes, ...]] = []
        rejected: list[tuple[Delivery, str]] = []
        for delivery in jobs:
            try:
                fields.append(self._fields(delivery))
            except (ValueError, TypeError, OverflowError, OSError) as exc:
                rejected.append((delivery, repr(exc)))
        if rejected:
            # Before anything is sent: what Redis cannot hold is an invalid job, not an outage
            # (redis-py's DataError is a RedisError, and was retried forever).
            raise UnencodableJobs(rejected)
        calls = rq_push.chunks(jobs, fields, utcformat(datetime.now(UTC)))
        try:
            pipe = self.connection.pipeline(transaction=False)
            for _, (script_keys, args, _) in calls:
                self._script(keys=script_keys, args=args, client=pipe)
            results: list[Any] = pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc
        queued = frozenset(
            d.envelope.id
            for (part, _), r in zip(calls, results, strict=True)
            for d, flag in zip(part, bytes(r[2]), strict=True)
            if flag == ord("1")
        )
        sent = sum(size for _, (_, _, size) in calls)
        return PushResult(sum(int(r[0]) for r in results), sum(int(r[1]) for r in results), sent, queued)

    def refill(self, terminal: Sequence[Probe], live: Sequence[Delivery]) -> RefillResult:
        """Purge finished jobs' queued copies, bring live ones up (see :meth:`Transport.refill`)."""
        if not terminal and not live:
            return RefillResult(0, 0)
        enqueued_at = utcformat(datetime.now(UTC))
        try:
            pipe = self.connection.pipeline(transaction=False)
            for job in terminal:
                self._refill(
                    keys=[keys.rq_job(job.job_id), keys.rq_queue(job.queue), keys.rq_queues()],
                    args=[job.job_id, "1", 0],
                    client=pipe,
                )
            sent: list[str] = []
            for delivery in live:
                env = delivery.envelope
                try:
                    fields = self.job_hash(delivery, enqueued_at)
                except (ValueError, TypeError, OverflowError, OSError):
                    continue  # a job Redis cannot hold: the reconcile pass's push records it invalid
                sent.append(env.id)
                self._refill(
                    keys=[keys.rq_job(env.id), keys.rq_queue(env.queue), keys.rq_queues()],
                    args=[env.id, "0", env.requeue * 100000 + delivery.attempt, *fields],
                    client=pipe,
                )
            results: list[Any] = pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc
        anew = frozenset(job_id for job_id, r in zip(sent, results[len(terminal) :], strict=True) if r == 2)
        return RefillResult(sum(1 for r in results if r in (2, 3)), sum(1 for r in results if r == 1), anew)

    def evict(self, terminal: Sequence[Probe], live: Sequence[Delivery]) -> tuple[int, set[str]]:
        """Remove copies of jobs whose queue moved elsewhere (see :meth:`Transport.evict`)."""
        jobs = [(p.job_id, p.key_id, p.queue, -1) for p in terminal]
        for d in live:
            env = d.envelope
            jobs.append((env.id, env.key_id, env.queue, env.requeue * 100000 + d.attempt))
        if not jobs:
            return 0, set()
        script = self.connection.register_script(_EVICT)
        try:
            pipe = self.connection.pipeline(transaction=False)
            for job_id, key_id, queue, run in jobs:
                script(
                    keys=[keys.rq_job(job_id), keys.rq_queue(queue), keys.lease(key_id), keys.result(key_id)],
                    args=[job_id, run],
                    client=pipe,
                )
            results: list[Any] = pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc
        here = {job[0] for job, r in zip(jobs, results, strict=True) if r == 2 and job[3] >= 0}
        return sum(1 for r in results if r == 1), here

    blocking_events = True

    def wait_events(self, owner: str, after: str, timeout_s: float) -> bool:
        """Block (``XREAD BLOCK``) up to ``timeout_s`` for an event of ``owner`` newer than ``after``."""
        try:
            found = self.connection.xread(
                {keys.events(owner): after}, count=1, block=max(1, int(timeout_s * 1000))
            )
        except RedisError as exc:
            raise transport_error(exc) from exc
        return bool(found)

    def harvest(self, owner: str, limit: int) -> list[Event]:
        """The oldest ``limit`` events of ``owner``'s stream."""
        try:
            entries = self.connection.xrange(keys.events(owner), count=limit) or []
        except RedisError as exc:
            raise transport_error(exc) from exc
        return [
            Event(_text(event_id), _decode_event(fields), _refused(fields)) for event_id, fields in entries
        ]

    def ack(self, owner: str, event_ids: Sequence[str]) -> None:
        """Delete harvested events."""
        if not event_ids:
            return
        try:
            self.connection.xdel(keys.events(owner), *event_ids)
        except RedisError as exc:
            raise transport_error(exc) from exc

    def state_token(self, owner: str) -> StateToken:
        """``owner``'s epoch and the server's ``run_id`` (one round trip, see ``rq_scripts._STATE``)."""
        try:
            epoch, run_id = self._state(keys=[keys.epoch(owner)])
        except RedisError as exc:
            raise transport_error(exc) from exc
        return StateToken(None if epoch is None else _text(epoch), _text(run_id))

    def set_epoch(self, owner: str, epoch: str) -> None:
        """Store ``owner``'s epoch (no expiry)."""
        try:
            self._set_epoch(keys=[keys.epoch(owner), f"{keys.PREFIX}oomguard"], args=[epoch])
        except RedisError as exc:
            raise transport_error(exc) from exc

    def probe(self, jobs: Sequence[Probe], *, lease_s: float) -> list[Verdict]:
        """What Redis knows of each job (see :meth:`Transport.probe`), in one pipeline."""
        if not jobs:
            return []
        cutoff = utcformat(datetime.now(UTC) - timedelta(seconds=lease_s))
        try:
            pipe = self.connection.pipeline(transaction=False)
            for job in jobs:
                self._probe(
                    keys=[
                        keys.rq_job(job.job_id),
                        keys.result(job.key_id),
                        keys.lease(job.key_id),
                        keys.rq_queue(job.queue),
                        keys.rq_intermediate(job.queue),
                    ],
                    args=[job.job_id, cutoff],
                    client=pipe,
                )
            verdicts: list[Any] = pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc
        return [Verdict(_text(v)) for v in verdicts]  # the script returns only verdicts

    def cancel(self, jobs: Sequence[Probe], *, key_ttl_s: float) -> list[bool]:
        """Mark jobs cancelled in their hashes, off their queues (see :meth:`Transport.cancel`)."""
        if not jobs:
            return []
        ttl = max(1, int(key_ttl_s))
        try:
            pipe = self.connection.pipeline(transaction=False)
            for job in jobs:
                self._cancel(
                    keys=[
                        keys.rq_job(job.job_id),
                        keys.rq_queue(job.queue),
                        keys.lease(job.key_id),
                        keys.rq_registry("canceled", job.queue),
                        f"{keys.PREFIX}oomguard",
                        *([f"{keys.LIMIT_PREFIX}{job.limit_key}:queued"] if job.limit_key else []),
                    ],
                    args=[job.job_id, ttl],
                    client=pipe,
                )
            replies: list[Any] = pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc
        return [bool(int(r)) for r in replies]

    def drop_finished(self, jobs: Sequence[Finished], *, result_ttl_s: float) -> None:
        """Delete finished jobs' hashes and RQ results (see :meth:`Transport.drop_finished`), one pipeline."""
        if not jobs:
            return
        ttl_ms = max(1, int(result_ttl_s * 1000))
        try:
            pipe = self.connection.pipeline(transaction=False)
            for at in range(0, len(jobs), 200):  # a call per 200 jobs: Redis is not held long
                args: list[Any] = [keys.RQ_PREFIX, keys.result(""), ttl_ms]
                for job in jobs[at : at + 200]:
                    args += [job.job_id, job.queue, job.key_id, "1" if job.implicit_key else "0"]
                self._forget(args=args, client=pipe)
            pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc

    def ping(self) -> None:
        """Raise TransportError unless Redis answers PING."""
        try:
            self.connection.ping()
        except RedisError as exc:
            raise transport_error(exc) from exc

    def close(self) -> None:
        """Close the connection pool."""
        self.connection.close()
