"""The Lua scripts the RQ transport sends (each one round trip, all or nothing).

Their replies are read in :mod:`hybridq.transport.rq`; the worker's own scripts (claim, outcome,
lease) are in :mod:`hybridq.worker.scripts`.
"""

from __future__ import annotations

from hybridq.protocol.keys import RUN_ID_LUA
from hybridq.protocol.outcome import DECODE_STORED_LUA

__all__ = ["QUEUED_FIELDS", "_EVICT", "_FORGET", "_PROBE", "_REFILL", "_SET_EPOCH", "_STATE"]

#: The fields of a queued job's hash that are the same for every job: RQ's status, and those RQ's
#: ``Job.to_dict`` writes as empty strings for a job not yet run. Written in Lua, so the client
#: does not pack them into every call: all of them by the refill's rewrite of a queued copy in
#: place (``_REFILL``, below: it must clear the copy's old values), the status only by the
#: push (``rq_push._NEW_JOB_LUA``: RQ's ``Job.restore`` reads an absent field as an empty one).
QUEUED_FIELDS = (
    ("status", "queued"),
    *(
        (name, "")
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
    ),
)
#: ``QUEUED_FIELDS`` as Lua arguments of an ``HSET`` (each ``"name", "value", ``), for ``_REFILL``.
_QUEUED_LUA = "".join(f'"{name}", "{value}", ' for name, value in QUEUED_FIELDS)

# After the forwarder's epoch changed (Redis restarted, lost or rolled back its state), for one
# job. KEYS: job hash, queue list, set of queues. ARGV: job id, "1" if the ledger holds the job as
# finished else "0", run number, then field/value pairs of the hash (a live job only; the script
# adds QUEUED_FIELDS). A finished job's *queued* copy (Redis brought it back from an older state)
# is deleted, hash and queue entry; its other copies are history RQ's tools show. A live job is
# queued if Redis does not have it or a worker refused its copy as stale (hybridq_fenced: it left
# the queue then); a queued copy is rewritten in place under the new generation (it keeps its
# place in the queue); a copy a worker runs or ran is the reconcile pass's. Returns 1 purged,
# 2 queued, 3 rewritten, 0 nothing done.
_REFILL = f"""
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
    redis.call("HSET", KEYS[1], "hybridq_run", ARGV[3], {_QUEUED_LUA}unpack(ARGV, 4))
    redis.call("RPUSH", KEYS[2], ARGV[1])
    redis.call("SADD", KEYS[3], KEYS[2])
    return 2
end
if queued then
    redis.call("HSET", KEYS[1], "hybridq_run", ARGV[3], {_QUEUED_LUA}unpack(ARGV, 4))
    return 3
end
return 0
"""

# A job whose queue now lives on another Redis (the queue -> Redis map changed): its copy here is
# removed, hash and queue entry, unless it runs or ran here. KEYS: job hash, queue list, lease,
# result. ARGV: job id, the run the forwarder would deliver elsewhere (requeue * 100000 + attempt;
# -1: the job finished). Returns 2: a worker holds the lease here (and the job's hash is here),
# or stored this very run's outcome here (its completion event is harvested from here: the run
# is not delivered elsewhere); 1: a copy removed; 0: none here. A copy queued under an older
# generation is fenced by any worker's claim meanwhile (hybridq.worker.scripts), so only a claim
# made before the epoch changed can run here, and it holds the lease.
_EVICT = (
    DECODE_STORED_LUA
    + """
if redis.call("EXISTS", KEYS[3]) == 1 and redis.call("EXISTS", KEYS[1]) == 1 then
    return 2  -- (the hash too: another job may share the idempotency key, and run elsewhere)
end
local stored = tonumber(ARGV[2]) >= 0 and redis.call("GET", KEYS[4])
if stored then
    local ok, r = decode_stored(stored)
    if not ok or r.job_id == ARGV[1]
        and (tonumber(r.requeue) or 0) * 100000 + (tonumber(r.attempt) or 0) >= tonumber(ARGV[2]) then
        return 2
    end
end
local n = redis.call("LREM", KEYS[2], 0, ARGV[1]) + redis.call("DEL", KEYS[1])
return n > 0 and 1 or 0
"""
)

# KEYS: the owner's epoch key. Returns {epoch or nil, run_id or ""}. The run_id is read inside a
# script, as the workers' claim script reads it (hybridq.worker.scripts): both see the server that
# runs the scripts, even behind a proxy that would answer a plain INFO from elsewhere. An ACL
# that denies INFO gives "" here and in the claim (then only the epoch key detects lost state).
# Both read it with the same Lua (hybridq.protocol.keys.RUN_ID_LUA).
_STATE = (
    RUN_ID_LUA
    + """
return {redis.call("GET", KEYS[1]) or false, redis_run_id() or ""}
"""
)

# KEYS: job hash, result, lease, queue list, RQ's intermediate list of that queue. ARGV: job id,
# the cutoff (RQ's timestamp format, lease_s ago). See Transport.probe for the verdicts. RQ's
# timestamps are fixed-width UTC text, so they compare as strings; RQ writes "" for "not yet".
_PROBE = (
    DECODE_STORED_LUA
    + """
if redis.call("EXISTS", KEYS[1]) == 0 then
    -- A finished job's hash goes at its end when finished jobs leave Redis (result_ttl 0): its
    -- stored outcome, until the harvest, tells it from a job Redis lost (after the done grace, a
    -- copy delivered again reports that outcome instead of running).
    local stored = redis.call("GET", KEYS[2])
    if stored then
        local ok, r = decode_stored(stored)
        if not ok or r.job_id == ARGV[1] then
            return "done"
        end
    end
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
    local ok, r = decode_stored(stored)
    if not ok then
        return "done"  -- unreadable is not "nothing stored": after the done grace, delivered again
    end
    -- "done" only for the run Redis holds: the stored failure of attempt 1 says nothing about
    -- attempt 2 waiting in the queue.
    if r.job_id == ARGV[1] and
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
)

# KEYS: RQ's job hash, its queue list, the key's lease, RQ's canceled registry of the queue, a
# key that never exists. ARGV: job id, mark lifetime (s). Marks the job cancelled (a claim that
# finds the mark runs nothing), takes it off its queue (RQ shows it canceled), and says whether
# a worker holds the lease (1: the job may be running; 0: no worker runs it, and none will).
# The DEL first lets the mark through when Redis is over maxmemory (see _SET_EPOCH): a cancel
# must reach a copy a push cut short by an OOM reply left there. KEYS[6] (optional): the queued
# count of the job's limit key: a copy taken off its queue comes off it, once per copy (the
# hybridq_left mark, as a claim's: hybridq.worker.limit_scripts), unless the count expired (at 0,
# it goes to -1: a refilled copy's add still to come, at the forwarder's next step).
_CANCEL = """
redis.call("DEL", KEYS[5])
if redis.call("EXISTS", KEYS[1]) == 1 then
    redis.call("HSET", KEYS[1], "hybridq_cancel", "1")
    if redis.call("LREM", KEYS[2], 0, ARGV[1]) > 0 then
        if KEYS[6] and redis.call("HSETNX", KEYS[1], "hybridq_left", "1") == 1
                and redis.call("EXISTS", KEYS[6]) == 1 then
            redis.call("DECR", KEYS[6])
        end
        local now = tonumber(redis.call("TIME")[1])
        redis.call("HSET", KEYS[1], "status", "canceled")
        redis.call("ZADD", KEYS[4], now + tonumber(ARGV[2]), ARGV[1])
        redis.call("EXPIRE", KEYS[1], ARGV[2])
    end
end
if redis.call("EXISTS", KEYS[3]) == 1 then
    return 1
end
return 0
"""


# ARGV: RQ's key prefix, the stored outcomes' key prefix, how long (ms) an implicit key's stored
# outcome stays, then per job its id, queue, key id (Envelope.key_id) and 1 if the key is the
# job's own id. After the harvest put the jobs in the ledger (fsync'd): what Redis keeps of them
# (RQ's hash, results stream, finished and failed registry entries) is a cache nobody reads
# (fetch_job and `failed list` read the ledger), so it goes now instead of after RQ's result_ttl
# (docs/forwarder.md, "What Redis holds"). The first command is a DEL, which Redis allows over
# maxmemory: the rest of the script then runs too (it only frees). A batch of jobs per call (a
# call per job cost Redis more than the rest of the harvest: docs/benchmarks.md); each job's
# part its own (pcall).
_FORGET = """
local rq, keep = ARGV[1], tonumber(ARGV[3])
local function forget(id, queue, key, implicit)
    redis.call("DEL", rq .. ":job:" .. id, rq .. ":results:" .. id)
    redis.call("ZREM", rq .. ":finished:" .. queue, id)
    redis.call("ZREM", rq .. ":failed:" .. queue, id)
    if implicit == "1" then
        local result = ARGV[2] .. key
        local ttl = redis.call("PTTL", result)
        if ttl == -1 or ttl > keep then
            redis.call("PEXPIRE", result, ARGV[3])
        end
    end
end
for i = 4, #ARGV, 4 do
    pcall(forget, ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
end
return 1
"""


# KEYS: the owner's epoch key, a key that never exists. ARGV: the epoch. The forwarder's epoch is
# what fences stale deliveries: it must be writable when Redis is over maxmemory too. Redis
# refuses a script's first write that may grow memory (SET) over the limit, but not a DEL, and
# once a script has written it runs to its end: the DEL first lets the SET through
# (docs/forwarder.md, "What Redis holds").
_SET_EPOCH = """
redis.call("DEL", KEYS[2])
redis.call("SET", KEYS[1], ARGV[1])
return 1
"""
