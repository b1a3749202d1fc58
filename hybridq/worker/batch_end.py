"""The pool worker's batched end of jobs: hybridq's outcome and RQ's ending, for many jobs at once.

:data:`END` is the last of the batch scripts of :mod:`hybridq.worker.batch_scripts` (take, start,
record): for each job, hybridq's outcome script (outcome + completion event) and RQ's ending (job
``finished`` or ``failed``, its result in RQ's results stream, the finished or failed registry,
the execution's records removed if written). Sent again after a lost reply: hybridq's part
recognises its token, RQ's part runs only while the job hash names the execution it ends.

Every job's part is independent of the others' (``ISOLATE_LUA``): its script error is its own
reply. (Apart from :mod:`hybridq.worker.batch_scripts` only for that module's size.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rq.utils import now, utcformat

from hybridq.protocol import keys
from hybridq.worker.batch_scripts import ISOLATE_LUA, LOCALS_LUA
from hybridq.worker.runner import Taken
from hybridq.worker.scripts import FINISH_LUA, OOM_GUARD_LUA

__all__ = ["END", "END_ARITY", "end_args"]

#: Arguments per job of :data:`END`: :func:`end_args` writes them, the script's loop steps by it
#: (made from this constant, never a copy of the number).
END_ARITY = 17

# ARGV: RQ's key prefix, the worker's name, now (RQ's text form), now (seconds), how long the jobs
# ran (seconds, all together: RQ's total_working_time), then per job (END_ARITY): job id, queue,
# execution id, when it started (seconds), "1" finished or "0" failed (in RQ), the TTL of RQ's
# result (an integer: result_ttl if finished, failure_ttl if failed; -1 keeps it, 0 deletes a
# finished job), RQ's result fields (return_value or exc_string, base64 as RQ writes them; ""
# none), then hybridq's outcome script's keys (result, lease, events; "" if this job stores no
# outcome) and arguments (token, outcome, key lifetime, event, kept event), then "1" if RECORD
# was sent for its execution (its records go) else "0". Returns per job what the outcome script
# returned (hybridq.protocol.FinishReply), -1 if none. Numbers stay text, or whole: Lua formats
# a number with snprintf, and Redis parses a fraction slowly (docs/benchmarks.md).

END = (
    LOCALS_LUA
    + f"local END_ARITY = {END_ARITY}\n"
    + FINISH_LUA
    + ISOLATE_LUA
    + OOM_GUARD_LUA
    + """
local rq, name, stamp, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local worker = rq .. ":worker:" .. name
local replies = {}
local server = {}  -- the clock and the limit keys trimmed, once per call (hybridq.worker.limit_scripts)
local worked, succeeded, failed, expiry = tonumber(ARGV[5]), 0, 0, {}  -- counters, added once
local registries = {[true] = {}, [false] = {}}  -- finished or failed -> queue -> its registry's key
local function finish_one(i)
    local id, queue, exec, started = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
    local ok, ttl, field, value = ARGV[i + 4] == "1", ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]
    local reply = -1
    if ARGV[i + 8] ~= "" then
        reply = finish({ARGV[i + 8], ARGV[i + 9], ARGV[i + 10]},
            {ARGV[i + 11], ARGV[i + 12], ARGV[i + 13], ARGV[i + 14], ARGV[i + 15]}, server)
    end
    local job = rq .. ":job:" .. id
    if ARGV[i + 16] == "1" then  -- its execution's records (RECORD): gone, whatever the job hash says
        local member = id .. ":" .. exec
        redis.call("DEL", rq .. ":execution:" .. member)
        redis.call("ZREM", rq .. ":wip:" .. queue, member)
        redis.call("ZREM", rq .. ":executions:" .. id, exec)
        redis.call("SREM", worker .. ":executions", member)
    end
    if redis.call("HGET", job, "hybridq_exec") ~= exec then  -- RQ's part once, even if sent again
        worked = worked - math.max(0, now - tonumber(started))
    else
        local results = rq .. ":results:" .. id
        if ok then succeeded = succeeded + 1 else failed = failed + 1 end
        if ok and ttl == "0" then
            -- RQ's result_ttl 0 (finished jobs leave Redis: docs/forwarder.md): gone at once, with
            -- no status written first; sent again, it finds no hybridq_exec.
            redis.call("DEL", job, results)
        else
            redis.call("HSET", job, "status", ok and "finished" or "failed", "ended_at", stamp,
                "hybridq_exec", "")
            -- RQ's Result: its fields as arguments, no table (less for Lua to make and collect).
            local kind = ok and "1" or "2"
            if field ~= "" then
                redis.call("XADD", results, "MAXLEN", "~", "10", "*", "type", kind, "worker_name", name,
                    "execution_id", exec, "execution_started_at", started, "execution_ended_at", ARGV[4],
                    field, value)
            else
                redis.call("XADD", results, "MAXLEN", "~", "10", "*", "type", kind, "worker_name", name,
                    "execution_id", exec, "execution_started_at", started, "execution_ended_at", ARGV[4])
            end
            local registry = registries[ok][queue]
            if not registry then
                registry = rq .. (ok and ":finished:" or ":failed:") .. queue
                registries[ok][queue] = registry
            end
            if string.sub(ttl, 1, 1) == "-" then
                redis.call("PERSIST", job)
                redis.call("PERSIST", results)
                redis.call("ZADD", registry, "+inf", id)
            else
                redis.call("EXPIRE", job, ttl)
                redis.call("EXPIRE", results, ttl)
                expiry[ttl] = expiry[ttl] or tostring(math.floor(now) + tonumber(ttl))  -- as RQ's
                redis.call("ZADD", registry, expiry[ttl], id)
            end
        end
    end
    return reply
end
for i = 6, #ARGV, END_ARITY do
    local ok, reply = isolate(pcall(finish_one, i))
    if not ok then worked = worked - math.max(0, now - tonumber(ARGV[i + 3])) end  -- no RQ ending
    replies[#replies + 1] = reply
end
if succeeded + failed > 0 then
    redis.call("HINCRBYFLOAT", worker, "total_working_time", math.max(0, worked))
    if succeeded > 0 then redis.call("HINCRBY", worker, "successful_job_count", succeeded) end
    if failed > 0 then redis.call("HINCRBY", worker, "failed_job_count", failed) end
end
return replies
"""
)


def end_args(name: str, items: Sequence[Taken]) -> list[Any]:
    """The arguments of :data:`END` for ``items``: RQ's record of each, and its outcome script if any."""
    at = time.time()
    ran = sum(max(0.0, at - item.started) for item in items)
    args: list[Any] = [keys.RQ_PREFIX, name, utcformat(now()), at, ran]
    for item in items:
        ttl = int(item.result_ttl if item.ok else item.failure_ttl)
        args += [item.job_id, item.queue, item.exec_id, item.started, "1" if item.ok else "0"]
        args += [ttl, item.rq_field, item.rq_value]
        call = item.run.finish
        if call is None:
            args += [""] * 8
        else:
            keys_, call_args = call
            args += [*keys_, *call_args, *[""] * (5 - len(call_args))]
        args.append("1" if item.recorded else "0")
    return args
