"""The per-key limits' part of the claim, renewal and outcome scripts (docs/forwarder.md, "Limits per key").

A limited delivery's token (the lease value, :class:`hybridq.worker.run.Run`) ends in ``#L`` and
the policy the forwarder put in the delivery (``concurrency,rate,period ms,key``; 0: no such
limit): every script that sees the token sees the policy, and nothing else carries it. Job ids
are ``[A-Za-z0-9_-]``, so ``#L`` cannot appear before it.

Per limit key Redis holds (all under ``hybridq:limit:<key>:``):

* ``run``: a sorted set of the runs that hold a slot (member: the token, score: when the slot
  lapses, ms, Redis's clock). The claim adds its run, each lease renewal moves the score a
  lease ahead (and adds it back after Redis lost it), the outcome removes it: a killed worker's
  slot frees when its lease would have lapsed;
* ``starts``: a sorted set of the starts of the last period (the rate's sliding log);
* ``queued``: how many copies of the key's jobs the forwarders pushed that are still in a queue
  (the forwarders' gate reads it, so it pushes no more than the room). Forwarders add what they
  pushed; a copy leaving its queue takes one off, once per copy (the ``hybridq_left`` field of
  its job hash records it): claimed, refused, fenced, or cancelled (by its claim, or by the
  forwarder's cancel taking it off its queue). Adds and takes come in either order, so it may
  be below zero for a moment. It expires two leases after its last change: a backstop for
  copies that leave Redis another way (evicted, purged by a refill after a restart). A claim
  that takes it to 0 leaves it with the expiry it had (0 reads as no key; one command fewer).

``hybridq:limit:ended:m<n>`` (and ``:h<n>``), sets shared by every key (not one per key: with
a key per tenant and a few jobs each, each job's outcome created one and its expiry dropped it),
hold the runs whose outcome was recorded, a minute (an hour for those whose outcome script kept
another run's success: their stored outcome is not theirs): one set per 10 s (10 minutes) of
Redis's clock, expiring a minute (an hour) after its span. A renewal sent before the outcome and
run after it must not take the slot back, also once a later run's outcome replaced this run's
(member: the token, which names the key). A renewal whose lease is still its own has not ended
(the outcome deletes it) and reads none of them. A renewal held up longer than that, or run
after a FLUSHALL emptied them, takes the slot back for one lease.

``hybridq:limits:epoch`` holds ``<ms>:<run_id>``: when the limits' state started on this
server. Gone, or another server's ``run_id`` (a FLUSHALL, a restart, a replica promoted): the
holders Redis had are lost, so for one lease (and one rate period) from then on no new run of a
limited key is admitted (**quarantine**): long enough for every running holder's renewal to add
it back. Only then do the counts mean what they say: no burst after a loss of state.
"""

from __future__ import annotations

from hybridq.protocol.keys import LIMIT_PREFIX as PREFIX
from hybridq.protocol.keys import LIMITS_ENDED as ENDED_KEY
from hybridq.protocol.keys import LIMITS_EPOCH as EPOCH_KEY
from hybridq.protocol.keys import RUN_ID_LUA

__all__ = ["LIMIT_LUA"]

#: Lua functions: ``limit_of(token[, slot_only])``, ``limit_admit(lim, token, lease ms, server)`` (the why
#: of a refusal, or nil), ``limit_hold(lim, token, lease ms, job hash, server)``,
#: ``limit_left(lim, job hash, lease ms[, server])`` (a copy left its queue without running),
#: ``limit_renew(lim, token, lease ms, ended, server, ours)`` and ``limit_end(token, kept[, server])``.
#: ``server`` caches, per script call, Redis's clock, its ``run_id``, the keys trimmed, the
#: expiries set, the lapse and lifetime texts: every call of one script call must pass it (an
#: expiry set without it is not remembered, and a later one it skips would leave that one).
#: With ``redis_run_id()`` (``hybridq.protocol.keys.RUN_ID_LUA``), which the claim uses too.
LIMIT_LUA = (
    RUN_ID_LUA
    + f"""
-- ``slot_only``: only the ``run`` key (the outcome and the renewal need no policy or other key:
-- three string-to-number conversions and two keys fewer per outcome).
local function limit_of(token, slot_only)
    token = token or ""
    -- Anchored at the first ``#L`` (a search from each position of the token cost about 1 % of a
    -- limited claim's and outcome's Redis instructions); the search only if that is not the policy.
    local at = string.find(token, "#L", 1, true)
    if not at then return nil end
    local c, r, p, key = string.match(token, "^#L(%d+),(%d+),(%d+),(.+)$", at)
    if not key then c, r, p, key = string.match(token, "#L(%d+),(%d+),(%d+),(.+)$") end
    if not key then return nil end
    local at = "{PREFIX}" .. key .. ":"
    if slot_only then return {{run = at .. "run"}} end
    -- (the starts' name only for a rate: a string made per claim)
    return {{c = tonumber(c), r = tonumber(r), p = tonumber(p), run = at .. "run",
        starts = r ~= "0" and at .. "starts" or nil, queued = at .. "queued"}}
end
-- Redis's clock (ms), read once per script call (``server`` caches it).
local function limit_now(server)
    if not server.now then
        local t = redis.call("TIME")
        server.now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    return server.now
end
-- ``now + ms`` (and ``2 * ms + 1000``) as text, made once per script call and ``ms``: a Lua number
-- passed to a command is printed each time (``%.17g``, about 1k instructions), and a call's runs
-- share the clock and nearly always the lease.
local function limit_until(server, ms)
    local now = limit_now(server)  -- (the call's clock, the same for every run it holds)
    server.until_ms = server.until_ms or {{}}
    local t = server.until_ms[ms]
    if not t then
        t = {{string.format("%d", now + ms), string.format("%d", 2 * ms + 1000)}}
        server.until_ms[ms] = t
    end
    return t[1], t[2]
end
-- When the limits' state began on this server (ms); a new epoch starts now if Redis lost it.
local function limit_epoch(now, server)
    if server.limit_since == nil then
        if server.run_id == nil then
            server.run_id = redis_run_id()  -- (as the claim)
        end
        local run_id = server.run_id or ""
        local since, was = string.match(redis.call("GET", "{EPOCH_KEY}") or "", "^(%d+):(%x*)$")
        since = tonumber(since)
        -- (a time ahead of the server's clock is not believed: it would hold the keys forever)
        if not since or since > now or (run_id ~= "" and was ~= run_id) then
            since = now
            redis.call("SET", "{EPOCH_KEY}", now .. ":" .. run_id)
        end
        server.limit_since = since
    end
    return server.limit_since
end
-- Drops a sorted set's members due by ``upto`` (lapsed slots, starts out of the period, ends no
-- longer kept): once per key per script call and cut-off, as ``server`` remembers (the highest
-- cut-off trimmed; a later run of the key whose token carries a shorter rate period, after a
-- policy change, trims again). The counts are those a trim per job would give: the clock is read
-- once per call, nothing a call adds is due by then, and a lower cut-off finds nothing left.
local function limit_trim(key, upto, server)
    server.trimmed = server.trimmed or {{}}
    local done = server.trimmed[key]
    if done and done >= upto then return 0 end
    server.trimmed[key] = upto
    return redis.call("ZREMRANGEBYSCORE", key, "-inf", upto)
end
local function limit_admit(lim, token, lease_ms, server)
    local now = limit_now(server)
    local since = limit_epoch(now, server)
    local why = nil
    local quiet = tonumber(lease_ms)
    if lim.r > 0 and lim.p > quiet then quiet = lim.p end
    server.fresh = server.fresh or {{}}
    server.fresh[lim.run] = nil
    if now < since + quiet then
        why = "limited: quarantine after Redis lost state"
    elseif lim.c > 0 then
        -- Lapsed slots (killed workers') are dropped only when they could refuse this run: a
        -- key with room needs no trim. What they leave is bounded by the concurrency (a trim
        -- comes at the limit) and read by nobody (the forwarders count scores still ahead).
        local n = redis.call("ZCARD", lim.run)
        if n >= lim.c then n = n - limit_trim(lim.run, now, server) end
        -- None: the set does not exist, so the hold's ZADD makes it without an expiry.
        server.fresh[lim.run] = n == 0
        if n >= lim.c then why = "limited: concurrency" end
    else
        limit_trim(lim.run, now, server)  -- (no concurrency: no count to trim at; each call)
    end
    if not why and lim.r > 0 then
        limit_trim(lim.starts, now - lim.p, server)
        if redis.call("ZCARD", lim.starts) >= lim.r then why = "limited: rate" end
    end
    -- This very run holds the slot already (a claim sent again): admitted. Asked only of a
    -- refusal. A slot of its own that lapsed (its holder cut off past the lease, the claim made
    -- again) is not held: left below the concurrency untrimmed, it must not waive the rate.
    if why then
        local held = redis.call("ZSCORE", lim.run, token)
        if held and tonumber(held) > now then return nil end
    end
    return why
end
-- A copy of a job of the key left its queue (claimed, refused, fenced, cancelled): one off
-- the count, once per copy (a claim sent again, or made again, finds the mark on its hash; a
-- copy pushed again is a new hash). The count may go below zero for a moment: a forwarder
-- adds what it pushed at its next step, often after the claims.
-- A key's lifetime made at least ``ms``, never shortened: the key holds other runs' slots (or
-- starts, or the queued count), and a run with a shorter lease (or period) must not make it
-- expire under a longer one's live slot (the limit would then admit more than it allows).
-- Once per key and lifetime per script call (``server`` remembers what it made; none: each
-- time): Redis expires no key while a script runs.
local function limit_expire(key, ms, server)
    if server then
        server.expiry = server.expiry or {{}}
        local made = server.expiry[key]
        if made and made >= ms then return end
    end
    local left = redis.call("PTTL", key)  -- -1: no expiry; -2: no key (nothing to expire)
    if left < ms then
        redis.call("PEXPIRE", key, ms)
        left = ms
    end
    if server then server.expiry[key] = left end
end
-- ``lim.exists``: the caller knows the job hash exists (no EXISTS).
local function limit_left(lim, job, lease_ms, server)
    local exists = lim.exists or redis.call("EXISTS", job) == 1
    if exists and redis.call("HSETNX", job, "hybridq_left", "1") == 0 then
        return
    end
    -- At 0 nothing more: a count of 0 needs no backstop, and the key already expires (a count
    -- of 1 had its expiry: the forwarders' INCRBY sets one, as this does below), two leases on
    -- at most; reading 0 or no key is the same. Not a DEL: one command fewer per job, and the
    -- forwarders' next add finds the key (docs/benchmarks.md).
    if redis.call("DECR", lim.queued) ~= 0 then
        limit_expire(lim.queued, 2 * lease_ms, server)
    end
end
local function limit_hold(lim, token, lease_ms, job, server)
    local now = limit_now(server)
    -- A new start unless the run holds a live slot (a claim sent again). NX first: a new run
    -- (nearly every claim) costs one command; a lapsed slot of its own (the claim made again
    -- after its lease lapsed, not trimmed below the concurrency) is a start again, as a trim
    -- would have made it.
    local lapse, life = limit_until(server, lease_ms)
    local new = redis.call("ZADD", lim.run, "NX", lapse, token) == 1
    if not new then
        new = tonumber(redis.call("ZSCORE", lim.run, token)) <= now
        redis.call("ZADD", lim.run, lapse, token)
    end
    if server.fresh and server.fresh[lim.run] then
        -- The admission found no set: this ZADD made it, with no expiry to keep (no PTTL).
        server.fresh[lim.run] = nil
        redis.call("PEXPIRE", lim.run, life)
        server.expiry = server.expiry or {{}}
        server.expiry[lim.run] = 2 * lease_ms + 1000
    else
        limit_expire(lim.run, 2 * lease_ms + 1000, server)
    end
    if new then
        if lim.r > 0 then
            redis.call("ZADD", lim.starts, now, token)
            limit_expire(lim.starts, lim.p + 1000, server)
        end
        limit_left(lim, job, lease_ms, server)
    end
end
-- The ends of runs are kept a minute (an hour for the runs whose outcome script kept another
-- run's success), in sets by when they ended: one per 10 s of Redis's clock
-- (``hybridq:limit:ended:m<n>``; ``:h<n>``, one per 10 minutes), each expiring a minute (an
-- hour) after its span: an end is kept a minute to a minute and 10 s. Not one sorted set
-- trimmed at each outcome: an outcome adds its run (SADD) and the set's expiry, always the
-- same instant (no PTTL, no trim).
local function limit_ended_key(kept, now)
    local keep = kept and 3600000 or 60000
    local span = keep / 6
    local n = math.floor(now / span)
    return "{ENDED_KEY}" .. (kept and ":h" or ":m") .. n, (n + 1) * span + keep
end
-- Whether ``token``'s end is kept: the sets of the last minute (and hour), 7 each, and the next
-- span's (an end written when Redis's clock read later: stepped back since, or a replica behind
-- took over). Read only by a renewal whose lease is no longer its own. A set of another type
-- (written by something else) says nothing (pcall).
local function limit_ended(token, server)
    local now = limit_now(server)
    for _, kept in ipairs({{false, true}}) do
        local span = kept and 600000 or 10000
        for back = -1, 6 do
            local key = limit_ended_key(kept, now - back * span)
            if redis.pcall("SISMEMBER", key, token) == 1 then return true end
        end
    end
    return false
end
-- ``ended``: the run's outcome is stored (a renewal sent before it must not take the slot back).
-- ``ours``: the run still holds its lease, which its outcome deletes: it has not ended.
local function limit_renew(lim, token, lease_ms, ended, server, ours)
    if ended then return false end
    if not ours and limit_ended(token, server) then return false end
    local now = limit_now(server)
    limit_epoch(now, server)
    redis.call("ZADD", lim.run, now + lease_ms, token)
    limit_expire(lim.run, 2 * lease_ms + 1000, server)
    return true
end
-- Every run's end is kept (a renewal may not tell it from the stored outcome: a later run's
-- outcome may replace it): a minute or two, or an hour or two when ``kept`` (the run's outcome
-- script kept another run's success, so the stored outcome was never this run's).
-- ``server`` (optional): what the script call has read (the clock), for a call that ends several runs.
local function limit_end(token, kept, server)
    local lim = limit_of(token, true)
    if not lim then return end
    server = server or {{}}
    redis.call("ZREM", lim.run, token)
    -- The set's name and expiry made once per call and kind (the same instant each time).
    kept = kept and true or false
    server.ended = server.ended or {{}}
    local key = server.ended[kept]
    local at = nil
    if not key then
        key, at = limit_ended_key(kept, limit_now(server))
        server.ended[kept] = key
    end
    -- Shared by every limit key: written by anything else (another type), it fails only itself
    -- (pcall), never the outcome; a renewal racing it may then hold the slot a lease.
    redis.pcall("SADD", key, token)
    if at then redis.pcall("PEXPIREAT", key, string.format("%d", at)) end  -- once per set per call
end
"""
)
