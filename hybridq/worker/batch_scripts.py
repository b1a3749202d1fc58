"""The pool worker's batched Redis calls: take, start + claim, and record, each for many jobs at once.

A pool worker (:mod:`hybridq.worker.engine`) makes a few script calls per *batch* of jobs where
RQ's worker makes about a dozen round trips per job. Each does, per job, what RQ's own worker
writes (``rq info``, rq-dashboard and RQ's registries show the jobs as RQ would) and what
hybridq's single-job scripts do (:mod:`hybridq.worker.scripts`: the same Lua claim and outcome):

* :data:`TAKE`: move up to N job ids from the queues into RQ's intermediate lists (what RQ's
  ``LMOVE`` dequeue does, one id at a time) and return their hashes' fields. A worker killed
  after it leaves them there as RQ's would: RQ's maintenance and the forwarder's reconcile pass
  find them (``stranded``: no attempt used);
* :data:`START`: for each job, RQ's view of it (status ``started``, its worker) and hybridq's
  claim, in one atomic step per batch. Its reply lost, it is sent again with the same tokens:
  RQ's part is idempotent and a claim that did run finds the lease its own;
* :data:`RECORD`: RQ's execution records (hash, registries) of the jobs still running a while
  after their claim (:data:`hybridq.worker.starter.RECORD_AFTER_S`); most jobs end before, and
  never have them written;
* the end (outcome + RQ's ending) is :data:`hybridq.worker.batch_end.END`.

Every job's part is independent of the others'. The helpers below build the arguments, wait on
an idle queue (:func:`wait_one`) and extend running jobs' executions (:func:`keep_alive`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis
from rq.utils import now, utcformat

from hybridq.protocol import keys
from hybridq.worker import scripts
from hybridq.worker.runner import Taken
from hybridq.worker.scripts import CLAIM_LUA, OOM_GUARD_LUA

__all__ = [
    "GIVE_BACK",
    "ISOLATE_LUA",
    "LOCALS_LUA",
    "RECORD",
    "RECORD_ARITY",
    "START",
    "START_ARITY",
    "TAKE",
    "TAKE_FIELDS",
    "claim_part",
    "keep_alive",
    "record_args",
    "start_args",
    "take",
    "take_args",
    "taken",
    "wait_one",
]

# One job's part of a batch script runs under pcall: an error of its own (a key of the wrong
# type, a value Lua cannot read) is that job's reply, "error: ..." (its part may have run up
# to the error: Redis does not roll a script back), and never another job's; the same error
# would come back if the call were sent again. Redis's transient refusals (out of memory, a
# read-only replica, still loading...) fail the whole call instead, which is sent again.
ISOLATE_LUA = """
local TRANSIENT = {"OOM", "READONLY", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "NOREPLICAS",
    "CLUSTERDOWN"}
local function isolate(ok, result)
    if ok then return true, result end
    local message = type(result) == "table" and tostring(result.err) or tostring(result)
    for _, prefix in ipairs(TRANSIENT) do
        if string.sub(message, 1, #prefix) == prefix or string.find(message, ": " .. prefix, 1, true) then
            error(result)
        end
    end
    return false, "error: " .. message
end
"""

# First in each batch script: the globals its per-job parts use, as locals of the script (the
# functions defined after it see them as upvalues). A global is a table lookup at every use in
# Redis's Lua (about 65 instructions, some 75 per job in START); an upvalue is an index.
LOCALS_LUA = (
    "local redis, ARGV, string, tonumber, tostring, math, unpack, pcall, type, ipairs ="
    " redis, ARGV, string, tonumber, tostring, math, unpack, pcall, type, ipairs\n"
)

#: The job hash fields :data:`TAKE` returns for each job, in this order.
TAKE_FIELDS = (
    "data",
    "origin",
    "hybridq_run",
    "success_callback_name",
    "failure_callback_name",
    "stopped_callback_name",
    "timeout",
    "result_ttl",
    "failure_ttl",
)

# KEYS: the queues' lists, in the order they are served. ARGV: most jobs to take, RQ's key
# prefix, then TAKE_FIELDS. Returns, flat, per job taken: id, queue index, then its fields (one
# table for the whole reply: a table per job cost Redis about 2,000 instructions to reply;
# :func:`taken` regroups it). An id whose job hash is gone (or is not a hash) is dropped (as RQ's
# dequeue drops it).
TAKE = (
    LOCALS_LUA
    + """
local want = tonumber(ARGV[1])
local taken, fields = {}, #ARGV - 2
for q, queue in ipairs(KEYS) do
    if want <= 0 then break end
    local ids = redis.call("LPOP", queue, want)
    if ids then
        -- Into the intermediate list first, in parts (Lua's unpack has a limit): an error after
        -- this leaves them there, where the forwarder finds them stranded, never in no list.
        local intermediate = queue .. ":intermediate"
        for i = 1, #ids, 1000 do
            redis.call("RPUSH", intermediate, unpack(ids, i, math.min(i + 999, #ids)))
        end
        for _, id in ipairs(ids) do
            local ok, f = pcall(redis.call, "HMGET", ARGV[2] .. ":job:" .. id, unpack(ARGV, 3))
            if ok and f[1] then
                local n = #taken  -- (no nil in it: a missing field is false)
                taken[n + 1], taken[n + 2] = id, q
                for k = 1, fields do taken[n + 2 + k] = f[k] end
                want = want - 1
            else  -- gone, or a key of another type (not a job): dropped, as RQ's dequeue drops it
                redis.call("LREM", intermediate, -1, id)
            end
        end
    end
end
return taken
"""
)

# Gives reservations back: jobs TAKE moved into RQ's intermediate lists that this worker will not
# start (it stops, or they waited too long: hybridq.worker.starter). ARGV: RQ's key prefix, then
# per job its id and queue, in the order they were taken. Each goes back to the head of its
# queue, unless it left the intermediate list meanwhile (the forwarder delivered it again, and
# that put it back in the queue) or its hash is gone (a refill purged it). Returns how many went
# back.
GIVE_BACK = """
local back = 0
for i = #ARGV - 1, 2, -2 do
    local id, queue = ARGV[i], ARGV[1] .. ":queue:" .. ARGV[i + 1]
    if redis.call("LREM", queue .. ":intermediate", 1, id) == 1 and
            redis.call("EXISTS", ARGV[1] .. ":job:" .. id) == 1 then
        redis.call("LPUSH", queue, id)
        back = back + 1
    end
end
return back
"""

#: Arguments per job of :data:`START`: :func:`start_args` writes them, the script's loop steps by
#: it (made from this constant, never a copy of the number: a drift would hand each job its
#: neighbour's claim).
START_ARITY = 13

# ARGV: RQ's key prefix, the worker's name, now (RQ's text form), then per job (START_ARITY): job
# id, queue, execution id, then the claim's keys (result, lease, epoch) and arguments (token,
# lease ms, requeue, attempt, epoch generation), then the owner's event stream and the started
# event ("" "": none; a refused claim's event is the worker's to send after). The claim's job
# hash and job id are the job's own (the script makes the key): an argument costs Redis about
# 1,000 instructions to parse and hand to Lua (docs/benchmarks.md).
# Returns the claim's reply per job (hybridq.protocol.ClaimStatus). RQ's view of the job (status
# ``started``, its worker) is written here; its execution's records (the started registry) only
# by RECORD, for a job still running a while after its claim: most jobs end before, and
# writing them here meant writing and deleting four keys per job (docs/worker.md).
START = (
    LOCALS_LUA
    + f"local START_ARITY = {START_ARITY}\n"
    + CLAIM_LUA
    + ISOLATE_LUA
    + OOM_GUARD_LUA
    + """
local rq, name, stamp = ARGV[1], ARGV[2], ARGV[3]
local server = {}
local replies = {}
local lists = {}  -- queue -> its intermediate list's key, made once per call
local function start(i)
    local id, queue, exec = ARGV[i], ARGV[i + 1], ARGV[i + 2]
    local job = rq .. ":job:" .. id
    local intermediate = lists[queue]
    if not intermediate then
        intermediate = rq .. ":queue:" .. queue .. ":intermediate"
        lists[queue] = intermediate
    end
    local f = redis.call("HMGET", job, "status", "hybridq_cancel")
    if not f[1] then
        -- Gone since the take (a refill purged it): nothing to start, nothing to write back.
        redis.call("LREM", intermediate, 1, id)
        return {4, "gone"}
    end
    -- The claim reads no more of the job hash: its cancel mark is read here, and the
    -- hybridq_started of a new claim is written below, in the one HSET of RQ's fields.
    local known = {cancel = f[2] ~= false}
    local reply = claim({ARGV[i + 3], ARGV[i + 4], job, ARGV[i + 5], ARGV[i + 11]},
        {ARGV[i + 6], ARGV[i + 7], id, ARGV[i + 8], ARGV[i + 9], ARGV[i + 10], ARGV[i + 12]},
        server, known)
    -- RQ's prepare_job_execution; hybridq_exec names this execution (END and RECORD check it).
    -- A copy that found another delivery running the job (BUSY) names no execution: RQ's
    -- ending stays that run's to write, whether or not this copy ever ends.
    if reply[1] == 3 then
        redis.call("HSET", job, "status", "started")
    elseif known.started then
        redis.call("HSET", job, "last_heartbeat", stamp, "status", "started", "started_at", stamp,
            "worker_name", name, "hybridq_exec", exec, "hybridq_started", known.started)
    else
        redis.call("HSET", job, "last_heartbeat", stamp, "status", "started", "started_at", stamp,
            "worker_name", name, "hybridq_exec", exec)
    end
    redis.call("PERSIST", job)
    -- Last: a claim that failed with a script error (its reply -1) leaves the id in RQ's
    -- intermediate list, where the forwarder finds it stranded and delivers it again.
    redis.call("LREM", intermediate, 1, id)
    return reply
end
for i = 4, #ARGV, START_ARITY do
    local ok, reply = isolate(pcall(start, i))
    replies[#replies + 1] = ok and reply or {-1, reply}
end
redis.call("HSET", rq .. ":worker:" .. name, "state", "busy", "last_heartbeat", stamp)
return replies
"""
)

#: Arguments per job of :data:`RECORD` (its loop steps by it, as :data:`START`'s).
RECORD_ARITY = 4

# RQ's prepare_execution, for jobs still running a while after their start (START). ARGV: RQ's
# key prefix, the worker's name, the execution TTL (seconds), now (seconds), then per job
# (RECORD_ARITY): job id, queue, execution id, when it started (seconds). A job whose hash no
# longer names that execution (ended, or purged by a refill) gets none. Returns how many were
# written. Idempotent: sent again, it writes the same records.
RECORD = (
    OOM_GUARD_LUA
    + f"local RECORD_ARITY = {RECORD_ARITY}\n"
    + """
local rq, name, ttl, now = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local executions = rq .. ":worker:" .. name .. ":executions"
local written = 0
for i = 5, #ARGV, RECORD_ARITY do
    local id, queue, exec = ARGV[i], ARGV[i + 1], ARGV[i + 2]
    if redis.call("HGET", rq .. ":job:" .. id, "hybridq_exec") == exec then
        local member = id .. ":" .. exec
        local ek = rq .. ":execution:" .. member
        redis.call("HSET", ek, "id", exec, "job_id", id, "created_at", ARGV[i + 3], "last_heartbeat", now,
            "worker_name", name)
        redis.call("EXPIRE", ek, ttl)
        redis.call("ZADD", rq .. ":executions:" .. id, now + ttl + 60, exec)
        redis.call("EXPIRE", rq .. ":executions:" .. id, ttl + 60)
        redis.call("ZADD", rq .. ":wip:" .. queue, now + ttl, member)
        redis.call("SADD", executions, member)
        written = written + 1
    end
end
if written > 0 then redis.call("EXPIRE", executions, ttl + 60) end
return written
"""
)


def start_args(name: str, items: Sequence[Taken]) -> list[Any]:
    """The arguments of :data:`START` for ``items`` (their execution ids set), started now."""
    at = time.time()
    args: list[Any] = [keys.RQ_PREFIX, name, utcformat(now())]
    for item in items:
        item.started = at
        args += [item.job_id, item.queue, item.exec_id, *claim_part(item)]
    return args


def record_args(name: str, items: Sequence[Taken], exec_ttl_s: int) -> list[Any]:
    """The arguments of :data:`RECORD` for ``items`` (started in an earlier turn); marks them recorded.

    Marked before the reply: END removes records that may have been written (removing none is
    harmless), never leaves one behind.
    """
    args: list[Any] = [keys.RQ_PREFIX, name, exec_ttl_s, time.time()]
    for item in items:
        item.recorded = True
        args += [item.job_id, item.queue, item.exec_id, item.started]
    return args


def claim_part(item: Taken) -> list[Any]:
    """A job's claim keys and arguments in :data:`START`'s layout (the started event's or ``""``).

    Without the job hash's key and the job id: :data:`START` makes them of the job's own id
    (``rq:job:<id>`` and ``id``, as :func:`hybridq.worker.intake.prepare` builds every claim:
    it refuses an envelope whose id is not the job's; tests/unit/test_batch_layout.py checks
    it and the part's length, ``START_ARITY - 3``).
    """
    claim_keys, claim_args = item.run.claim_keys, item.run.claim_args
    extra = [claim_keys[4], claim_args[6]] if len(claim_keys) > 4 else ["", ""]
    result, lease, _job, epoch = claim_keys[:4]
    return [result, lease, epoch, claim_args[0], claim_args[1], *claim_args[3:6], *extra]


def take_args(queue_keys: list[str], n: int) -> tuple[list[str], list[Any]]:
    """The keys and arguments of :data:`TAKE`: up to ``n`` jobs from ``queue_keys``, in order."""
    return queue_keys, [n, keys.RQ_PREFIX, *TAKE_FIELDS]


def take(client: redis.Redis, queue_keys: list[str], n: int) -> list[tuple[Any, Any, list[Any]]]:
    """Up to ``n`` jobs taken from ``queue_keys`` by :data:`TAKE`, as :func:`taken` gives them."""
    return taken(scripts.call(client, TAKE, *take_args(queue_keys, n)))


def taken(reply: list[Any]) -> list[tuple[Any, Any, list[Any]]]:
    """:data:`TAKE`'s flat reply as (id, queue index, fields) per job.

    A reply of another length than whole jobs' is refused here, before any job of it is
    prepared: a short last job would fail later, its id already in RQ's intermediate list.
    """
    step = 2 + len(TAKE_FIELDS)
    if len(reply) % step:
        raise ValueError(f"TAKE replied {len(reply)} entries, not a multiple of {step} (id, queue, fields)")
    return [(reply[i], reply[i + 1], reply[i + 2 : i + step]) for i in range(0, len(reply), step)]


def wait_one(client: Any, queue_key: str, block_s: float) -> list[Any]:
    """Block up to ``block_s`` for a job on one queue; taken as :data:`TAKE` takes it (or ``[]``)."""
    intermediate = queue_key + ":intermediate"
    job_id = client.blmove(queue_key, intermediate, block_s, "LEFT", "RIGHT")
    if job_id is None:
        return []
    fields = client.hmget(keys.rq_job(job_id.decode()), list(TAKE_FIELDS))
    if fields[0] is None:
        client.lrem(intermediate, 1, job_id)  # its hash is gone: as RQ drops it
        return []
    return [[job_id, 1, fields]]


def keep_alive(client: redis.Redis, name: str, running: Sequence[Taken], ttl: int) -> None:
    """Extend RQ's records of the ``running`` jobs' executions by ``ttl`` (RQ's job heartbeat).

    Only those :data:`RECORD` wrote: a job that has none yet gets them at the next turn.
    """
    running = [item for item in running if item.recorded]
    if not running:
        return
    now = time.time()
    with client.pipeline(transaction=False) as pipe:
        for item in running:
            member = f"{item.job_id}:{item.exec_id}"
            pipe.expire(f"{keys.RQ_PREFIX}:execution:{member}", ttl)
            pipe.zadd(keys.rq_registry("wip", item.queue), {member: now + ttl}, xx=True)
            pipe.zadd(f"{keys.RQ_PREFIX}:executions:{item.job_id}", {item.exec_id: now + ttl + 60}, xx=True)
            pipe.expire(f"{keys.RQ_PREFIX}:executions:{item.job_id}", ttl + 60)
        pipe.expire(f"{keys.RQ_PREFIX}:worker:{name}:executions", ttl + 60)
        pipe.execute()
