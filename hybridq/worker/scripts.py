"""The worker's own Redis calls: the claim, outcome and renewal scripts, and the client they use.

Each script is atomic in Redis (all or nothing, like MULTI/EXEC) and sent by its SHA after its
first use (EVALSHA). Their replies are :class:`hybridq.protocol.ClaimStatus` and
:class:`hybridq.protocol.FinishReply`. Only this module sends them (:func:`claim`,
:func:`finish`, :func:`renew`); a pipelining worker (:mod:`hybridq.rqworker`) queues them by
:data:`CLAIM_SHA` and :data:`FINISH_SHA` in RQ's own pipelines. Which errors a call is sent again
after, and for how long: :mod:`hybridq.worker.retries` (re-exported here).
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import redis

from hybridq.protocol.outcome import DECODE_STORED_LUA
from hybridq.transport import redisurl
from hybridq.worker.limit_scripts import LIMIT_LUA
from hybridq.worker.retries import FINISH_PATIENCE_S, retrying, transient

__all__ = [
    "CALL_TIMEOUT_S",
    "CLAIM_LUA",
    "CLAIM_SHA",
    "FINISH_LUA",
    "FINISH_PATIENCE_S",
    "FINISH_SHA",
    "call",
    "claim",
    "client",
    "finish",
    "renew",
    "renew_many",
    "retrying",
    "sha",
    "transient",
]


#: Socket timeout of a worker's own Redis calls (claim, lease renewal, outcome), in seconds.
CALL_TIMEOUT_S = 5.0

# KEYS: result, lease, RQ's job hash, the owner's epoch key[, the owner's event stream]. ARGV:
# token, lease ms, job id, requeue, attempt, the delivery's epoch generation[, the started event
# (protocol.StartedEvent, signed by the worker; "" none) added to that stream by a new claim].
# Sent only when used: a quick task's claim adds no event. A claim its limit key refuses
# answers {4, "limited: ..."}, and the worker sends the refused event (hybridq.worker.refusal).
# Returns {0, ""} claimed; {1, stored} suppressed (return stored); {2, stored} stale (this
# attempt, or a later one, of this job already failed: report that); {3, holder} busy (another
# delivery runs it now); {4, why} fenced: Redis brought this delivery back from before the
# forwarder's current epoch (an older snapshot, a lagging replica promoted), or restarted and
# the forwarder has not yet noticed; the job may have finished already, so it must not run (the
# forwarder's refill pass delivers it again if its ledger says it has not finished), or {4,
# "unreadable"}: the key holds a value no script can read (not hybridq's), so it may have
# finished: nothing runs (fail closed) until the value expires with the key lifetime.
#
# The epoch key holds "generation:run_id:token" (Completions.check_epoch). A delivery older than
# the generation is stale. A run_id that is not the server's own means this server's state is
# not the one the forwarder last saw (restarted, or a replica promoted): every claim waits for
# the forwarder to look (within about a second), as its ledger alone knows what finished. INFO
# costs about 4 us per claim (redis 6.2); an ACL that denies it leaves the generation check.
# No epoch key (an older forwarder, or Redis lost it and nothing it held can be older), or no
# KEYS[4] (a caller of the older script's arguments), fences nothing.
# The claim, as a Lua function (K: the keys, A: the arguments below; ``server`` caches what INFO
# said and the epochs read, for a script that claims several deliveries; ``known``, optional:
# the caller read the job hash, which exists, and says whether it is marked cancelled
# (``known.cancel``); the claim then reads neither, and leaves the ``hybridq_started`` a new
# claim writes in ``known.started`` for the caller's own write of that hash:
# hybridq.worker.batch_scripts.START).
CLAIM_LUA = (
    DECODE_STORED_LUA
    + LIMIT_LUA
    + """
local function claim(K, A, server, known)
    -- A limited key's run (hybridq.worker.limit_scripts); a plain find first: the pattern match
    -- of every token cost about 4 % of a claim's Redis time, for the few runs that are limited.
    -- Its policy as locals (lim: the key's ``run`` set; nil: not limited).
    local lc, lr, lp, lim, queued, starts, lease
    local lat = string.find(A[1], "#L", 1, true)
    if lat then
        lc, lr, lp, lim, queued, starts = limit_of(A[1], lat, server)
        if lim then lease = server.nums[A[2]] or limit_num(A[2], server) end  -- (limit_of made server.nums)
    end
    local exists = known ~= nil  -- (the caller read the hash, which exists: no EXISTS)
    local cancelled = known and known.cancel
    if not known then cancelled = redis.call("HEXISTS", K[3], "hybridq_cancel") == 1 end
    if cancelled then
        if lim then limit_left(queued, K[3], lease, server, exists) end
        return {5, "cancelled"}  -- the forwarder marked the job cancelled (hybridq.forwarder.cancelling)
    end
    local epoch = false
    if K[4] then  -- read and parsed once per script call, however many claims it makes (it cannot change)
        server.epochs = server.epochs or {}
        epoch = server.epochs[K[4]]
        if epoch == nil then
            epoch = redis.call("GET", K[4])
            if epoch then epoch = {string.match(epoch, "^(%d+):(%x*):")} end
            server.epochs[K[4]] = epoch
        end
    end
    if epoch then
        local gen, run_id = epoch[1], epoch[2]
        local why = nil
        if gen and (tonumber(A[6]) or 0) < tonumber(gen) then
            why = "stale"
        elseif gen and run_id ~= "" then
            if server.run_id == nil then  -- INFO once per script call, however many claims it makes
                server.run_id = redis_run_id()  -- (hybridq.protocol.keys.RUN_ID_LUA, in LIMIT_LUA)
            end
            local current = server.run_id
            if current and current ~= run_id then
                why = "unchecked"
            end
        end
        if why then
            if lim then limit_left(queued, K[3], lease, server, exists) end  -- (the refill queues it again)
            if redis.call("EXISTS", K[3]) == 1 then
                redis.call("HSET", K[3], "hybridq_fenced", "1")  -- for the refill pass
            end
            return {4, why}
        end
    end
    if redis.call("GET", K[2]) == A[1] then
        -- This very claim already ran (its reply was lost), or it is made again before its task
        -- starts: the lease is ours, for a whole lease from now. After the fences: a Redis back
        -- from a snapshot holding it is not the server the claim was made on.
        redis.call("PEXPIRE", K[2], A[2])
        if lim then limit_hold(A[1], lr, lp, lim, starts, queued, lease, K[3], server, false, exists) end
        return {0, ""}
    end
    -- As text (a Lua number written by HSET goes through snprintf): requeue * 100000 + attempt.
    local my_run = A[4] == "0" and A[5] or tostring(tonumber(A[4]) * 100000 + tonumber(A[5]))
    local stored = redis.call("GET", K[1])
    if stored then
        -- Each runs nothing: the copy left its queue (off its limit key's queued count, once).
        local ok, r = decode_stored(stored)
        if not ok then
            if lim then limit_left(queued, K[3], lease, server, exists) end
            return {4, "unreadable"}  -- not "nothing stored": its key may have finished
        end
        local rq, at = tonumber(r.requeue) or 0, tonumber(r.attempt) or 0
        local my_rq, my_at = tonumber(A[4]), tonumber(A[5])
        if r.outcome == "succeeded" or (r.final and rq >= my_rq) then
            if lim then limit_left(queued, K[3], lease, server, exists) end
            return {1, stored}
        end
        if r.job_id == A[3] and (rq > my_rq or (rq == my_rq and at >= my_at)) then
            if lim then limit_left(queued, K[3], lease, server, exists) end
            return {2, stored}
        end
    end
    -- A limited key (hybridq.worker.limit_scripts): no slot, or no rate left, runs nothing and
    -- uses no attempt. On this reply the worker sends the run's refused started event (signed)
    -- to the owner's stream (hybridq.worker.refusal): the forwarder takes the job back into its
    -- run table at its next step, and the key gate pushes the same attempt again when the key
    -- has room (hybridq.forwarder.refusals).
    local slots = nil
    if lim then
        local why
        why, slots = limit_admit(A[1], lc, lr, lp, lim, starts, lease, server)
        if why then
            limit_left(queued, K[3], lease, server, exists)
            if redis.call("EXISTS", K[3]) == 1 then
                redis.call("HSET", K[3], "hybridq_fenced", "1")
            end
            return {4, why}
        end
    end
    if redis.call("SET", K[2], A[1], "NX", "PX", A[2]) then
        if lim then limit_hold(A[1], lr, lp, lim, starts, queued, lease, K[3], server, slots == 0, exists) end
        -- The task is about to start: from now on this run counts as an attempt (the forwarder
        -- tells "started, then lost" from "taken, never started" by this field).
        if known then
            known.started = my_run
        elseif redis.call("EXISTS", K[3]) == 1 then
            redis.call("HSET", K[3], "hybridq_started", my_run)
        end
        if K[5] and A[7] and A[7] ~= "" then
            redis.call("XADD", K[5], "*", "e", A[7])  -- the started event (lookup index only)
        end
        return {0, ""}
    end
    if lim then limit_left(queued, K[3], lease, server, exists) end  -- (runs nothing: the copy left)
    return {3, redis.call("GET", K[2]) or ""}
end
"""
)
# The OOM guard (docs/forwarder.md, "What Redis holds"): a worker script's first command is a DEL
# of a key that never exists (under the worker's own ACL pattern). Redis refuses a script's first
# write that may grow memory when it is over maxmemory, but not a DEL, and lets a script that
# has written run to its end: so claims, outcomes and starts go through over the limit, and a
# full Redis can always drain (the forwarder stops pushing at its high-water mark). What they
# write past the limit is bounded by the running jobs.
OOM_GUARD_LUA = 'redis.call("DEL", "hybridq:lease:oomguard")\n'
_CLAIM = CLAIM_LUA + OOM_GUARD_LUA + "return claim(KEYS, ARGV, {})\n"


# KEYS: result, lease, events. ARGV: token, outcome JSON, key lifetime s, event JSON[, the event
# to send instead when a success is kept (signed by the worker: Lua cannot sign)].
# A success already stored (by a delivery that ran while this one had lost its lease) is kept,
# and the event reports it: the key succeeded, whatever this run did. Returns 0 stored, 1 kept
# the earlier success, 2 this run's outcome was already stored (a retry after a lost reply),
# 3 kept the success of a later attempt of this job (this run's outcome was superseded).
# The outcome script, as a Lua function (K: the keys, A: the arguments below; an empty A[5] is none;
# ``server``, optional: what the script call has read, for a call that records several outcomes).
FINISH_LUA = (
    DECODE_STORED_LUA
    + LIMIT_LUA
    + """
local function finish(K, A, server)
    server = server or {}  -- one per call: one TIME and one set's expiry for both ends below
    local stored = redis.call("GET", K[1])
    local keep = 0
    local was = nil  -- the token of the stored outcome this one replaces
    if stored then
        local ok, r = decode_stored(stored)
        if ok then
            if r.token == A[1] then return 2 end
            was = r.token
            if r.outcome == "succeeded" then
                local _, mine = decode_stored(A[2])
                keep = 1
                if r.job_id == mine.job_id and (tonumber(r.attempt) or 0) > mine.attempt then keep = 3 end
            end
        end
    end
    local event = A[4]
    if keep == 0 then
        redis.call("SET", K[1], A[2], "EX", A[3])
    elseif A[5] and A[5] ~= "" then
        event = A[5]  -- the rewrite below, as the worker made and signed it (signing on)
    else
        local _, e = decode_stored(event)
        -- The result goes too: it is this run's, and cjson would not give it back intact.
        e.outcome, e.final, e.error, e.retry_delay, e.result = "succeeded", true, nil, nil, nil
        event = cjson.encode(e)
    end
    redis.call("XADD", K[3], "*", "e", event)
    if redis.call("GET", K[2]) == A[1] then
        redis.call("DEL", K[2])
    end
    -- Its slot of a limited key is free (a plain find first); the end of the run whose stored
    -- outcome this one replaced is kept (hybridq.worker.limit_scripts).
    local at = string.find(A[1], "#L", 1, true)
    if keep ~= 0 then was = nil end
    if at or was then
        limit_end(A[1], at, keep == 1 or keep == 3, server, A[3], was)
    end
    return keep
end
"""
)
_FINISH = FINISH_LUA + OOM_GUARD_LUA + "return finish(KEYS, ARGV)\n"


# KEYS: leases, then (optional) the RQ job hash of each. ARGV: for each lease its token and lease
# ms. For each, 1 if renewed, 0 if the lease is no longer ours, plus 2 if the job is marked
# cancelled (hybridq.forwarder.cancelling), plus 4 if the run holds a limited key's slot (held
# again even if the lease is gone: the task still runs; hybridq.worker.limit_scripts): every
# lease a process holds, renewed in one call.
_RENEW = (
    DECODE_STORED_LUA
    + LIMIT_LUA
    + """
local server = {}
local n = #ARGV / 2
local renewed = {}
for i = 1, n do
    local key, token, ms = KEYS[i], ARGV[2 * i - 1], ARGV[2 * i]
    local r = 0
    if redis.call("GET", key) == token then
        r = redis.call("PEXPIRE", key, ms)
    end
    local job = KEYS[n + i]
    if job and redis.call("HEXISTS", job, "hybridq_cancel") == 1 then
        r = r + 2
    end
    local at = string.find(token, "#L", 1, true)
    local run = at and limit_run_of(token, at)
    if run then
        -- Ended: the lease is not ours and the key's stored outcome is this run's.
        local ended = false
        if r % 2 == 0 then
            local stored = redis.call("GET", (string.gsub(key, "^hybridq:lease:", "hybridq:result:")))
            local ok, o = decode_stored(stored or "")  -- a lone surrogate decodes too
            ended = ok and o.token == token
        end
        if limit_renew(run, token, tonumber(ms), ended, server, r % 2 == 1) then
            r = r + 4
        end
    end
    renewed[i] = r
end
return renewed
"""
)


CLAIM_SHA = hashlib.sha1(_CLAIM.encode()).hexdigest()  # noqa: S324 - Redis names scripts so
FINISH_SHA = hashlib.sha1(_FINISH.encode()).hexdigest()  # noqa: S324


def claim(conn: redis.Redis, keys: list[str], args: list[str | int]) -> Any:
    """Send the claim script; its reply ``[ClaimStatus, stored or why]``."""
    return _script(conn, _CLAIM)(keys=keys, args=args)


def finish(conn: redis.Redis, keys: list[str], args: list[str | int]) -> Any:
    """Send the outcome script; its reply, a :class:`~hybridq.protocol.FinishReply`."""
    return _script(conn, _FINISH)(keys=keys, args=args)


def renew(conn: redis.Redis, key: str, token: str, lease_ms: int) -> Any:
    """Extend the lease ``key`` if ``token`` still holds it; 1 if renewed, 0 if not."""
    return renew_many(conn, [(key, token, lease_ms)])[0]


def renew_many(
    conn: redis.Redis, leases: list[tuple[str, str, int]], jobs: list[str] | None = None
) -> list[int]:
    """Extend each lease ``(key, token, lease ms)`` that its token still holds, in one call.

    Returns, for each, 1 if renewed and 0 if the lease is no longer ours; with ``jobs`` (the RQ
    job hash of each lease's job), plus 2 if that job is marked cancelled.
    """
    args: list[str | int] = [item for _, token, ms in leases for item in (token, ms)]
    keys = [key for key, _, _ in leases] + (list(jobs) if jobs is not None else [])
    return list(_script(conn, _RENEW)(keys=keys, args=args))


def call(conn: redis.Redis, source: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
    """Send the script ``source`` (by its SHA once Redis knows it); its reply.

    With ``client`` (a pipeline of ``conn``), it is queued there; the pipeline loads it if need be.
    """
    return _script(conn, source)(keys=keys, args=args, client=client)


def sha(conn: redis.Redis, source: str) -> str:
    """The SHA1 Redis names the script ``source`` by (EVALSHA), as :func:`call` sends it."""
    return str(_script(conn, source).sha)


def client(conn: redis.Redis) -> redis.Redis:
    """A client of ``conn``'s Redis whose calls time out after :data:`CALL_TIMEOUT_S`.

    RQ raises its connection's socket timeout above its blocking dequeue (415 s by default): on
    that connection, a hung or blackholed Redis would hold a claim or an outcome that long.
    """
    pool = conn.connection_pool
    made = _clients.get(pool)
    if made is None:
        # A sibling, not a copy of the pool's options: a Sentinel client's pool is its own kind.
        made = redisurl.sibling(conn, socket_timeout=CALL_TIMEOUT_S, socket_connect_timeout=CALL_TIMEOUT_S)
        _clients[pool] = made
    return made


_clients: weakref.WeakKeyDictionary[redis.ConnectionPool, redis.Redis] = weakref.WeakKeyDictionary()


def _script(conn: redis.Redis, source: str) -> Any:
    """``source`` as a script of ``conn``: sent once, then called by its SHA (EVALSHA)."""
    scripts = _scripts.get(conn)
    if scripts is None:
        scripts = _scripts[conn] = {}
    script = scripts.get(source)
    if script is None:
        script = scripts[source] = conn.register_script(source)
    return script


_scripts: weakref.WeakKeyDictionary[redis.Redis, dict[str, Any]] = weakref.WeakKeyDictionary()
