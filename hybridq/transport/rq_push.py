"""The RQ transport's push: a batch of deliveries into RQ queues, a script call per queue's chunk.

What each job's hash holds is RQ's own ``Job.to_dict``, less the fields it writes as empty
strings for a job not yet run, which RQ reads as absent (``test_job_hash_is_what_rq_writes``);
how it travels is hybridq's. A call carries what every job of one queue shares once (the set of
queues, the queue's list, its failed and canceled registries, the push time, RQ's ``origin``)
and, per job, its hash's key and **one** argument: its own fields, each behind its length
(``struct``'s ``>I4c0``, which the script unpacks in one call). redis-py encodes and frames each
argument of a command apart: the 25 arguments a job took before (five keys, four numbers, its
fields' names and values) cost the forwarder more than building them (docs/benchmarks.md, "The
push path, this stop").

A re-push must not queue a job twice: the script does nothing when the job hash already exists
(the same idea as RQ 3's ``unique=True``, which cannot be pipelined); a forced delivery (a
redelivery after a lost worker, a retry, a requeue) replaces the old hash and queue entry.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from hybridq.protocol import ENTRY_POINT, keys

from .base import Delivery
from .rq_codec import _data, _describe, _failure_ttl, _meta_json, _redis_text, _whole_seconds
from .rq_scripts import QUEUED_FIELDS

__all__ = ["PUSH_CHUNK", "_PUSH_IF_NEW", "Chunk", "chunks", "job_fields", "job_hash", "utc_text"]

#: Jobs per push script call (of one queue; a batch is one pipeline of such calls): a call of 100
#: jobs keeps Redis busy well under a millisecond (other clients wait that long).
PUSH_CHUNK = 100

#: One job's own fields, in the order of its argument (``result_ttl`` empty: RQ's default).
_FIELDS = (
    "id",
    "overwrite",
    "run",
    "created_at",
    "data",
    "description",
    "timeout",
    "meta",
    "failure_ttl",
    "result_ttl",
)
_LENGTH = struct.Struct(">I")
#: Every length a field of a small job has (a plain ``data`` is at most DATA_PLAIN_BYTES), packed.
_LENGTHS_MADE = 2048
_LENGTHS = [_LENGTH.pack(n) for n in range(_LENGTHS_MADE)]
#: RQ's call (``data``): ``[func, instance, args, kwargs]``, the delivery its one argument.
_CALL_HEAD = b"[" + json.dumps(ENTRY_POINT).encode() + b", null, ["
#: What the script writes of QUEUED_FIELDS into a new job's hash: the status only. The fields
#: RQ's ``to_dict`` writes empty (callbacks, started_at, worker_name...) RQ's ``Job.restore``
#: reads as absent, and a new hash has none to clear (a replaced one is deleted first); each
#: cost Redis about 2,000 instructions per job (docs/benchmarks.md). The refill's rewrite of a
#: queued copy in place (``rq_scripts._REFILL``) still writes them all.
_NEW_JOB_LUA = "".join(f'"{name}", "{value}", ' for name, value in QUEUED_FIELDS if value != "")

# Pushes a chunk of one queue's jobs. KEYS: the set of queues, the queue's list, RQ's failed and
# canceled registries of the queue, then each job's hash. ARGV: the push time (enqueued_at),
# the queue's name (RQ's origin), then one argument per job: _FIELDS, each behind its length as
# a 4-byte big-endian number, and last its limit key ("" if the delivery carries no policy: not
# counted). "overwrite" is hybridq.protocol.Overwrite ("1" replace a known job
# that was delivered for an earlier run; "2" replace it whatever it holds), "run" the run number
# (requeue * 100000 + attempt); after the jobs, when one is limited, the queued counts' lifetime
# (ms: two leases), as the script adds their queued copies to them. The script adds
# _NEW_JOB_LUA. Returns {jobs queued, jobs left as they were, per job "1" queued or "0"}. A
# forced push of a run already delivered does nothing, so a forwarder that restarts and pushes
# a due retry again does not disturb the retry running.
#
# Unless RQ finished or failed that very run although no worker ever claimed it (its
# hybridq_started is older): then it can no longer run, and is queued again. That is what the
# worker of the previous run leaves when it records that run's failure in RQ (RQ saves the whole
# job hash, the previous run's arguments included) after the forwarder had already harvested
# the outcome and pushed the retry: the retry's queue entry then delivers the previous run's
# copy, which reports that run's failure again and runs nothing (tests/integration/
# test_network_faults.py). Without this, only the reconcile pass would queue it, leases later.
#
# A job replaced is also taken out of the queue's intermediate list (tests/integration/
# test_worker_protocol.py, a stranded job delivered again).
_PUSH_IF_NEW = f"""
local queue = KEYS[2]
-- The queue's ids go in with one RPUSH at the end: a queue key of another type must fail the
-- call here, before any job hash is written (a hash written and never queued would make a
-- re-push of its job do nothing).
local kind = redis.call("TYPE", queue).ok
if kind ~= "list" and kind ~= "none" then
    return redis.error_reply("WRONGTYPE the queue " .. queue .. " holds a " .. kind .. ", not a list")
end
local fields_of = function(s)
    return struct.unpack("{">" + "I4c0" * (len(_FIELDS) + 1)}", s)
end
if not struct then
    -- A server without Lua's struct library (fakeredis): the same format, a field at a time.
    fields_of = function(s)
        local out, p = {{}}, 1
        for i = 1, {len(_FIELDS) + 1} do
            local a, b, c, d = string.byte(s, p, p + 3)
            local n = ((a * 256 + b) * 256 + c) * 256 + d
            out[i] = string.sub(s, p + 4, p + 3 + n)
            p = p + 4 + n
        end
        return unpack(out)
    end
end
local queued, queued_at, dropped = {{}}, {{}}, false  -- the ids to RPUSH, in order
local still = false  -- the job being pushed replaces a copy still on its limit key's count
local function push(key, id, overwrite, run, fields)
    if redis.call("EXISTS", key) == 1 then
        if overwrite == "0" then
            return 0
        end
        local f = redis.call("HMGET", key, "hybridq_run", "status", "hybridq_started", "hybridq_left")
        local known, mine = tonumber(f[1]) or 0, tonumber(run)
        if overwrite == "1" and known >= mine then
            local ended = f[2] == "finished" or f[2] == "failed"
            if known > mine or not ended or (tonumber(f[3]) or 0) >= known then
                return 0
            end
        end
        -- The copy replaced never left its queue's count (no claim or cancel marked it): the
        -- new copy takes its place there, and is not added again (below).
        if not f[4] then still = true end
        redis.call("DEL", key)
        redis.call("LREM", queue, 0, id)
        if queued_at[id] then  -- queued by this very call: its later copy replaces it
            queued[queued_at[id]] = false
            dropped = true
        end
        -- Out of RQ's intermediate list too (keys.rq_intermediate): a worker that took the job
        -- and vanished left it there, where the probe would find it "stranded" again and again.
        redis.call("LREM", queue .. ":intermediate", 0, id)
    end
    -- A new job's first write grows memory (HSET): over maxmemory, Redis refuses the whole
    -- script there, before it wrote anything, and the forwarder pauses (docs/forwarder.md).
    -- A write that cannot grow memory first (the ZREMs) would let the script run past the limit.
    redis.call("HSET", key, "hybridq_run", run, {_NEW_JOB_LUA}"origin", ARGV[2], "enqueued_at", ARGV[1],
        unpack(fields))
    queued[#queued + 1] = id
    queued_at[id] = #queued
    return 1
end
local ids, each = {{}}, {{}}
local adds, order = {{}}, {{}}  -- per limit key, its copies queued by this call (keys in order)
-- Under pcall: an error partway (a replaced job's key or the intermediate list of another type)
-- still queues the jobs written before it, below, and then fails the call with that error, as
-- a job at a time did. A job written and never queued would stay so: a re-push of it does
-- nothing. Redis's transient refusals (out of memory, read-only) come at the call's first write,
-- before any job is written.
local ok, err = pcall(function()
    for i = 5, #KEYS do
        local id, overwrite, run, created, data, description, timeout, meta, failure_ttl, result_ttl,
            limit_key = fields_of(ARGV[i - 2])
        local fields = {{"created_at", created, "data", data, "description", description, "timeout",
            timeout, "meta", meta, "failure_ttl", failure_ttl}}
        if result_ttl ~= "" then
            fields[#fields + 1] = "result_ttl"
            fields[#fields + 1] = result_ttl
        end
        still = false
        each[#each + 1] = push(KEYS[i], id, overwrite, run, fields)
        if each[#each] == 1 then
            ids[#ids + 1] = id
            if limit_key ~= "" and not still then  -- (a copy still counted replaced: its place)
                local n = adds[limit_key]
                if not n then order[#order + 1] = limit_key end
                adds[limit_key] = (n or 0) + 1
            end
        end
    end
end)
if dropped then
    local kept = {{}}
    for _, id in ipairs(queued) do
        if id then kept[#kept + 1] = id end
    end
    queued = kept
end
for i = 1, #queued, 1000 do  -- in parts: Lua's unpack has a limit
    redis.call("RPUSH", queue, unpack(queued, i, math.min(i + 999, #queued)))
end
if #ids > 0 then
    redis.call("SADD", KEYS[1], queue)
    -- Queued again: no longer one of RQ's failed or canceled jobs (rq info, rq requeue).
    redis.call("ZREM", KEYS[3], unpack(ids))
    redis.call("ZREM", KEYS[4], unpack(ids))
end
-- The copies queued of limited jobs, on their keys' queued counts in the same call (a claim
-- never comes before its add, and no crash falls between the push and the add): per key one
-- INCRBY and one PEXPIRE, to ARGV[#KEYS - 1] (two leases; docs/forwarder.md, "Limits per
-- key"). A count of the wrong type (another writer's) fails its own key only (pcall): the
-- forwarders' read holds that key.
for _, key in ipairs(order) do
    local count = "{keys.LIMIT_PREFIX}" .. key .. ":queued"
    if type(redis.pcall("INCRBY", count, adds[key])) == "number" then
        redis.call("PEXPIRE", count, ARGV[#KEYS - 1])
    end
end
if not ok then
    -- As Redis gave it (WRONGTYPE, OOM...): error() of the text pcall hands back on Redis 7
    -- would make it "ERR user_script:...".
    return redis.error_reply(type(err) == "table" and err.err or tostring(err))
end
return {{#ids, #each - #ids, table.concat(each)}}
"""


def job_fields(
    delivery: Delivery, default_timeout: int, default_result_ttl_s: float | None
) -> tuple[str | bytes, ...]:
    """One job's own fields (:data:`_FIELDS`), built directly, not through RQ's ``Job``.

    RQ's ``create_job`` + ``to_dict`` cost about 70 us per job; these are the same fields
    (``test_job_hash_is_what_rq_writes``) in a fraction of that.

    Raises ``ValueError``, ``TypeError`` or ``OverflowError`` for an envelope whose fields
    Redis cannot hold (one :meth:`Envelope.from_dict` would refuse): the push reports those
    jobs as :class:`~hybridq.errors.UnencodableJobs`.
    """
    env = delivery.envelope
    description = env.description or _describe(env.func, env.args, env.kwargs)
    result_ttl = _whole_seconds(env.result_ttl_s)
    if result_ttl is None and default_result_ttl_s is not None:
        result_ttl = round(default_result_ttl_s)  # 0: the worker deletes it at the end
    return (
        env.id,
        delivery.overwrite._value_,  # (``.value`` is a property: about 1,500 instructions a read)
        str(env.requeue * 100000 + delivery.attempt),
        utc_text(env.created_at),
        _data(_CALL_HEAD + delivery.encoded() + b"], {}]"),
        _redis_text(description),
        str(_whole_seconds(env.timeout_s) or default_timeout),
        _meta_json(delivery),
        _failure_ttl(delivery.key_ttl_s),
        "" if result_ttl is None else str(result_ttl),
    )


def utc_text(ts: float) -> str:
    """``utcformat(datetime.fromtimestamp(ts, UTC))``, RQ's text of a time: its second's text, kept.

    The microseconds are rounded as ``datetime.fromtimestamp`` rounds them (half to even, a
    carry into the next second); the second's text is ``isoformat``'s (``strftime`` does not pad
    four-digit years), made once per second and kept (:data:`_SECONDS_KEPT`): the jobs of a
    backlog were mostly accepted a few thousand to a second. ``fromtimestamp`` and ``isoformat``
    per job cost about 20,000 instructions, this about 7,000 (docs/benchmarks.md, "The
    forwarder's JSON per job"); the text is the same for every time an envelope may carry (1970
    to 9999; ``tests/unit/test_job_data.py``).
    """
    frac, whole = math.modf(ts)
    micros = round(frac * 1e6)
    second = int(whole)
    if micros >= 1_000_000:
        micros -= 1_000_000
        second += 1
    elif micros < 0:
        micros += 1_000_000
        second -= 1
    text = _SECOND_TEXT.get(second)
    if text is None:
        if len(_SECOND_TEXT) >= _SECONDS_KEPT:
            _SECOND_TEXT.clear()
        text = _SECOND_TEXT[second] = datetime.fromtimestamp(second, tz=UTC).isoformat()[:-6]
    return f"{text}.{micros:06d}Z"


#: The text of each second :func:`utc_text` met (bounded: emptied when full).
_SECOND_TEXT: dict[int, str] = {}
_SECONDS_KEPT = 4096


def job_hash(fields: Sequence[str | bytes], queue: str, enqueued_at: str) -> list[Any]:
    """The job hash the script writes from ``fields`` (flattened, without QUEUED_FIELDS)."""
    named = dict(zip(_FIELDS, fields, strict=True))
    flat: list[Any] = ["origin", queue, "enqueued_at", enqueued_at]
    for name in ("created_at", "data", "description", "timeout", "meta", "failure_ttl", "result_ttl"):
        if named[name] != "":
            flat += [name, named[name]]
    return flat


def _argument(fields: Sequence[str | bytes], limit_key: bytes) -> bytes:
    """A job's one argument: each field, its limit key last, behind its length (UnicodeEncodeError).

    A length under :data:`_LENGTHS_MADE` is taken from a table (a ``pack`` call per field cost
    about 600 instructions, a fifth of the argument's: docs/benchmarks.md, "The forwarder's
    JSON per job").
    """
    parts: list[bytes] = []
    add = parts.append
    for value in fields:
        raw = value.encode() if isinstance(value, str) else value
        n = len(raw)
        add(_LENGTHS[n] if n < _LENGTHS_MADE else _LENGTH.pack(n))
        add(raw)
    n = len(limit_key)
    add(_LENGTHS[n] if n < _LENGTHS_MADE else _LENGTH.pack(n))
    add(limit_key)
    return b"".join(parts)


#: One script call: its keys and arguments, and how many bytes of jobs' fields it carries.
Chunk = tuple[list[str], list[Any], int]


def chunks(
    jobs: Sequence[Delivery], fields: Sequence[Sequence[str | bytes]], enqueued_at: str
) -> list[tuple[list[Delivery], Chunk]]:
    """The script calls of a batch: its jobs by queue (in their order), ``PUSH_CHUNK`` per call."""
    by_queue: dict[str, list[tuple[Delivery, Sequence[str | bytes]]]] = {}
    for delivery, own in zip(jobs, fields, strict=True):
        by_queue.setdefault(delivery.envelope.queue, []).append((delivery, own))
    calls: list[tuple[list[Delivery], Chunk]] = []
    for queue, items in by_queue.items():
        shared = [keys.rq_queues(), keys.rq_queue(queue), keys.rq_registry("failed", queue)]
        shared.append(keys.rq_registry("canceled", queue))
        for start in range(0, len(items), PUSH_CHUNK):
            part = items[start : start + PUSH_CHUNK]
            args: list[Any] = [enqueued_at, queue]
            life = None  # the longest lease of the part's limited deliveries (one walk of the part)
            for d, own in part:
                if d.limit is not None:
                    key = d.envelope.limit_key
                    args.append(_argument(own, key.encode() if key else b""))
                    if life is None or d.lease_s > life:
                        life = d.lease_s
                else:
                    args.append(_argument(own, b""))
            if life is not None:  # the queued counts' lifetime: two leases
                args.append(str(2 * max(1, int(life * 1000))))
            call_keys = shared + [keys.rq_job(d.envelope.id) for d, _ in part]
            calls.append(([d for d, _ in part], (call_keys, args, sum(len(a) for a in args[2:]))))
    return calls
