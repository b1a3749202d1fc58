"""The RQ transport: jobs become ordinary RQ jobs (JSON serializer) in RQ queues on Redis.

This is the only module through which the forwarder talks to RQ and Redis. What it pushes runs
under a plain ``rq worker --serializer rq.serializers.JSONSerializer QUEUE``.

Every RQ job runs :func:`hybridq.worker.execute` with the delivery as its one argument; the
worker side claims the idempotency key, calls the task and reports back (see
:mod:`hybridq.worker`). The RQ job keeps the envelope's id, so ``rq.job.Job.fetch(job.id)`` works.

A re-push must not queue a job twice: RQ's own ``enqueue`` pushes a reused job id onto the queue
again. Each job is therefore saved by a small Lua script that does nothing when the job hash
already exists (the same idea as RQ 3's ``unique=True``, which cannot be pipelined), and a batch is
sent as one pipeline of script calls. A forced delivery (a redelivery after a lost worker, a
retry, a requeue) replaces the old hash and queue entry instead.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from redis.exceptions import RedisError
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from hybridq import keys
from hybridq.envelope import MAX_SECONDS
from hybridq.errors import UnencodableJobs
from hybridq.protocol import ENTRY_POINT
from hybridq.redisurl import transport_error

from .base import Delivery, Event, Probe, PushResult, RefillResult, StateToken, Transport, Verdict

__all__ = ["RQTransport"]

# KEYS: job hash, queue list, set of queues, RQ's failed and canceled registries of the queue.
# ARGV: job id, the delivery's overwrite (hybridq.protocol.Overwrite: "1" replace a known job that
# was delivered for an earlier run; "2" replace it whatever it holds), run number (requeue *
# 100000 + attempt), then field/value pairs of the hash. A forced push of a run already delivered
# does nothing, so a forwarder that restarts and pushes a due retry again does not disturb the
# retry already running.
#
# Unless RQ finished or failed that very run although no worker ever claimed it (its
# hybridq_started is older): then it can no longer run, and is queued again. That is what the
# worker of the previous run leaves when it records that run's failure in RQ (RQ saves the whole
# job hash, the previous run's arguments included) after the forwarder had already harvested
# the outcome and pushed the retry: the retry's queue entry then delivers the previous run's
# copy, which reports that run's failure again and runs nothing (tests/integration/
# test_network_faults.py). Without this, only the reconcile pass would queue it, leases later.
_PUSH_IF_NEW = """
if redis.call("EXISTS", KEYS[1]) == 1 then
    if ARGV[2] == "0" then
        return 0
    end
    local f = redis.call("HMGET", KEYS[1], "hybridq_run", "status", "hybridq_started")
    local run, mine = tonumber(f[1]) or 0, tonumber(ARGV[3])
    if ARGV[2] == "1" and run >= mine then
        local ended = f[2] == "finished" or f[2] == "failed"
        if run > mine or not ended or (tonumber(f[3]) or 0) >= run then
            return 0
        end
    end
    redis.call("DEL", KEYS[1])
    redis.call("LREM", KEYS[2], 0, ARGV[1])
end
-- Queued again: no longer one of RQ's failed or canceled jobs (rq info, rq requeue).
redis.call("ZREM", KEYS[4], ARGV[1])
redis.call("ZREM", KEYS[5], ARGV[1])
redis.call("HSET", KEYS[1], "hybridq_run", ARGV[3], unpack(ARGV, 4))
redis.call("RPUSH", KEYS[2], ARGV[1])
redis.call("SADD", KEYS[3], KEYS[2])
return 1
"""

# After the forwarder's epoch changed (Redis restarted, lost or rolled back its state), for one
# job. KEYS: job hash, queue list, set of queues. ARGV: job id, "1" if the ledger holds the job as
# finished else "0", run number, then field/value pairs of the hash (a live job only).
# A finished job's *queued* copy (Redis brought it back from an older state) is deleted, hash and
# queue entry; its other copies are history RQ's tools show. A live job is queued if Redis does
# not have it or a worker refused its copy as stale (hybridq_fenced: it left the queue then); a
# queued copy is rewritten in place under the new generation (it keeps its place in the queue);
# a copy a worker runs or ran is the reconcile pass's. Returns 1 purged, 2 queued, 3 rewritten,
# 0 nothing done.
_REFILL = """
local f = redis.call("HMGET", KEYS[1], "status", "hybridq_fenced")
local queued = f[1] == "queued" or f[1] == "deferred" or f[1] == "scheduled"
if ARGV[2] == "1" then
    if queued and not f[2] then
        redis.call("DEL", KEYS[1])
        redis.call("LREM", KEYS[2], 0, ARGV[1])
        return 1
    end
    return 0
end
if f[2] or redis.call("EXISTS", KEYS[1]) == 0 then
    redis.call("DEL", KEYS[1])
    redis.call("HSET", KEYS[1], "hybridq_run", ARGV[3], unpack(ARGV, 4))
    redis.call("RPUSH", KEYS[2], ARGV[1])
    redis.call("SADD", KEYS[3], KEYS[2])
    return 2
end
if queued then
    redis.call("HSET", KEYS[1], "hybridq_run", ARGV[3], unpack(ARGV, 4))
    return 3
end
return 0
"""

# KEYS: the owner's epoch key. Returns {epoch or nil, run_id or ""}. The run_id is read inside a
# script, as the workers' claim script reads it (hybridq.worker.scripts): both see the server that
# runs the scripts, even behind a proxy that would answer a plain INFO from elsewhere. An ACL
# that denies INFO gives "" here and in the claim (then only the epoch key detects lost state).
_STATE = """
local info = redis.pcall("INFO", "server")
local run_id = type(info) == "string" and string.match(info, "run_id:(%x+)") or ""
return {redis.call("GET", KEYS[1]) or false, run_id}
"""

# KEYS: job hash, result, lease, queue list, RQ's intermediate list of that queue. ARGV: job id,
# the cutoff (RQ's timestamp format, lease_s ago). See Transport.probe for the verdicts. RQ's
# timestamps are fixed-width UTC text, so they compare as strings; RQ writes "" for "not yet".
_PROBE = """
if redis.call("EXISTS", KEYS[1]) == 0 then
    return "missing"
end
if redis.call("EXISTS", KEYS[3]) == 1 then
    return "running"
end
local f = redis.call(
    "HMGET", KEYS[1], "status", "ended_at", "started_at", "enqueued_at", "hybridq_run", "hybridq_started"
)
local stored = redis.call("GET", KEYS[2])
if stored then
    local ok, r = pcall(cjson.decode, stored)
    -- "done" only for the run Redis holds: the stored failure of attempt 1 says nothing about
    -- attempt 2 waiting in the queue.
    if ok and type(r) == "table" and r.job_id == ARGV[1] and
            (tonumber(r.requeue) or 0) * 100000 + (tonumber(r.attempt) or 0) >= (tonumber(f[5]) or 0) then
        return "done"
    end
end
local status = f[1]
if status == "queued" then
    -- No queue list at all (evicted), or taken into RQ's intermediate list by a worker that
    -- died before it started the job: no worker will take it (the caller waits a lease first).
    if redis.call("EXISTS", KEYS[4]) == 0 or redis.call("LPOS", KEYS[5], ARGV[1]) then
        return "stranded"
    end
    return "queued"
end
if status == "deferred" or status == "scheduled" then
    return "queued"
end
local changed = ""
for i = 2, 4 do
    if f[i] and f[i] > changed then
        changed = f[i]
    end
end
if changed > ARGV[2] then
    return "running"
end
-- Taken by a worker that is gone: "orphaned" if it had claimed this run (the task started: an
-- attempt), "stranded" if it died before (no attempt used).
if f[6] and f[6] == f[5] then
    return "orphaned"
end
return "stranded"
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
        self._probe = connection.register_script(_PROBE)
        self._refill = connection.register_script(_REFILL)
        self._state = connection.register_script(_STATE)
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
        """The fields of the job hash :meth:`to_rq_job` would save, built directly (flattened).

        RQ's ``create_job`` + ``to_dict`` cost about 70 us per job, most of the forwarder's time
        per job; this writes the same fields (``test_job_hash_is_what_rq_writes`` holds it to
        RQ's own output) in a fraction of that.

        Raises ``ValueError``, ``TypeError`` or ``OverflowError`` for an envelope whose fields
        Redis cannot hold (one :meth:`Envelope.from_dict` would refuse): :meth:`push` reports
        those jobs as :class:`UnencodableJobs`.
        """
        env = delivery.envelope
        description = env.description or _describe(env.func, env.args, env.kwargs)
        data: list[Any] = [ENTRY_POINT, None, [delivery.to_json()], {}]
        timeout = _whole_seconds(env.timeout_s) or self._queue(env.queue)._default_timeout
        fields: list[Any] = [
            "created_at",
            utcformat(datetime.fromtimestamp(env.created_at, tz=UTC)),
            "data",
            zlib.compress(json.dumps(data).encode()),
            *_EMPTY_FIELDS,
            "origin",
            env.queue,
            "description",
            _redis_text(description),
            "enqueued_at",
            enqueued_at,
            "timeout",
            str(timeout),
        ]
        result_ttl = _whole_seconds(env.result_ttl_s)
        if result_ttl is not None:
            fields += ["result_ttl", str(result_ttl)]
        fields += ["status", "queued", "meta", json.dumps(_meta(delivery)).encode()]
        return fields

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        """Queue every job not already known to Redis, as one pipeline (see :class:`Transport`)."""
        if not jobs:
            return PushResult(0, 0)
        enqueued_at = utcformat(datetime.now(UTC))
        hashes: list[list[Any]] = []
        rejected: list[tuple[Delivery, str]] = []
        for delivery in jobs:
            try:
                hashes.append(self.job_hash(delivery, enqueued_at))
            except (ValueError, TypeError, OverflowError, OSError) as exc:
                rejected.append((delivery, repr(exc)))
        if rejected:
            # Before anything is sent: what Redis cannot hold is an invalid job, not an outage
            # (redis-py's DataError is a RedisError, and was retried forever).
            raise UnencodableJobs(rejected)
        try:
            pipe = self.connection.pipeline(transaction=False)
            for delivery, fields in zip(jobs, hashes, strict=True):
                env = delivery.envelope
                self._script(
                    keys=[
                        keys.rq_job(env.id),
                        keys.rq_queue(env.queue),
                        keys.rq_queues(),
                        keys.rq_registry("failed", env.queue),
                        keys.rq_registry("canceled", env.queue),
                    ],
                    args=[
                        env.id,
                        delivery.overwrite.value,
                        env.requeue * 100000 + delivery.attempt,
                        *fields,
                        "failure_ttl",
                        _failure_ttl(delivery.key_ttl_s),
                    ],
                    client=pipe,
                )
            results: list[Any] = pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc
        pushed = sum(1 for r in results if r == 1)
        return PushResult(pushed, len(results) - pushed)

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
            for delivery in live:
                env = delivery.envelope
                try:
                    fields = self.job_hash(delivery, enqueued_at)
                except (ValueError, TypeError, OverflowError, OSError):
                    continue  # a job Redis cannot hold: the reconcile pass's push records it invalid
                self._refill(
                    keys=[keys.rq_job(env.id), keys.rq_queue(env.queue), keys.rq_queues()],
                    args=[env.id, "0", env.requeue * 100000 + delivery.attempt, *fields],
                    client=pipe,
                )
            results: list[Any] = pipe.execute()
        except RedisError as exc:
            raise transport_error(exc) from exc
        return RefillResult(sum(1 for r in results if r in (2, 3)), sum(1 for r in results if r == 1))

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
        return [Event(_text(event_id), _decode_event(fields)) for event_id, fields in entries]

    def ack(self, owner: str, event_ids: Sequence[str]) -> None:
        """Delete harvested events."""
        if not event_ids:
            return
        try:
            self.connection.xdel(keys.events(owner), *event_ids)
        except RedisError as exc:
            raise transport_error(exc) from exc

    def state_token(self, owner: str) -> StateToken:
        """``owner``'s epoch and the server's ``run_id`` (one round trip, see ``_STATE``)."""
        try:
            epoch, run_id = self._state(keys=[keys.epoch(owner)])
        except RedisError as exc:
            raise transport_error(exc) from exc
        return StateToken(None if epoch is None else _text(epoch), _text(run_id))

    def set_epoch(self, owner: str, epoch: str) -> None:
        """Store ``owner``'s epoch (no expiry)."""
        try:
            self.connection.set(keys.epoch(owner), epoch)
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

    def ping(self) -> None:
        """Raise TransportError unless Redis answers PING."""
        try:
            self.connection.ping()
        except RedisError as exc:
            raise transport_error(exc) from exc

    def close(self) -> None:
        """Close the connection pool."""
        self.connection.close()


#: Fields RQ's ``Job.to_dict`` writes as empty strings for a job not yet run.
_EMPTY_FIELDS = tuple(
    item
    for name in (
        "success_callback_name",
        "failure_callback_name",
        "stopped_callback_name",
        "started_at",
        "ended_at",
        "last_heartbeat",
        "worker_name",
        "group_id",
    )
    for item in (name, "")
)


def _meta(delivery: Delivery) -> dict[str, Any]:
    """The RQ job's meta: the envelope's, plus what hybridq shows about the job."""
    env = delivery.envelope
    return {
        **env.meta,
        "hybridq": {
            "func": env.func,
            "key": env.idempotency_key,
            "created_at": env.created_at,
            "attempt": delivery.attempt,
        },
    }


def _failure_ttl(key_ttl_s: float) -> str:
    """How long RQ keeps a failed delivery: a little less than its key's outcome stays stored.

    RQ keeps a failed job's hash and failed-registry entry for this long (its default: a year).

    ``rq requeue`` and the dashboard's Requeue take jobs from the failed registry: every one
    they can find still has its outcome stored, so the claim reports that outcome instead of
    running the task again (docs/worker.md, "Using RQ's tools").
    """
    return str(max(1, int(key_ttl_s - min(60.0, key_ttl_s / 2))))


def _describe(func: str, args: Sequence[Any], kwargs: Any) -> str:
    """``func(args...)`` as RQ would describe the call, shortened."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in dict(kwargs).items()]
    text = f"{func}({', '.join(parts)})"
    return text if len(text) <= 200 else text[:197] + "..."


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decode_event(fields: Any) -> dict[str, Any] | None:
    raw = fields.get(b"e") if isinstance(fields, dict) else None
    try:
        body = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):  # "[[[[..." deep enough raises RecursionError
        return None
    return body if isinstance(body, dict) else None


def _whole_seconds(value: float | None) -> int | None:
    """Whole seconds for RQ, capped at ``MAX_SECONDS``: an older journal may hold more (RQ breaks)."""
    return None if value is None else min(MAX_SECONDS, max(1, round(value)))


def _redis_text(text: object) -> str:
    """``text`` as redis-py can encode it: a lone surrogate (valid in JSON) is escaped."""
    if not isinstance(text, str):
        raise TypeError(f"description must be a string, not {type(text).__name__}")
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text
