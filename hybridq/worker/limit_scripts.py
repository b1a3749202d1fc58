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
  (the forwarders' gate reads it, so it pushes no more than the room). The forwarders' push
  script adds the copies it queued, in its own call (``hybridq.transport.rq_push``; a refilled
  copy: the gate's next read); a copy leaving its queue takes one off, once per copy (the
  ``hybridq_left`` field of its job hash records it): claimed, refused, fenced, or cancelled (by
  its claim, or by the forwarder's cancel taking it off its queue). A refilled copy's take may
  come before its add, so it may be below zero for a moment. It expires two leases after the
  last add (or a take
  below zero): a backstop for copies that leave Redis another way (evicted, purged by a refill
  after a restart). A take that leaves it at 0 or above leaves it the expiry it had (0 reads as
  no key; the commands a refresh would cost fewer).

``hybridq:limit:ended:m<n>`` (and ``:h<n>``), sets shared by every key (not one per key: with
a key per tenant and a few jobs each, each job's outcome created one and its expiry dropped it),
hold the runs whose end a renewal cannot read from the stored outcome, a minute (an hour for
those whose outcome script kept another run's success: their stored outcome is not theirs): one
set per 10 s (10 minutes) of Redis's clock, expiring a minute (an hour) after its span. A
renewal sent before the outcome and run after it must not take the slot back. It finds its
run's end in the key's stored outcome (``hybridq:result:<key id>``, which names the run's
token) first, so a run's end goes in a set only when that outcome will not name it: its outcome
kept another run's success; its outcome is stored for less than :data:`END_STORED_S`; a later
run's outcome replaces it (the later outcome adds the replaced run's token then). A renewal
whose lease is still its own has not ended (the outcome deletes it) and reads none of them. A
renewal held up longer than a minute, or run after a FLUSHALL emptied them, or after its stored
outcome left Redis sooner (the harvest's shorter lifetime for an implicit key with
``--forget-finished``, an eviction), takes the slot back for one lease.

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

__all__ = ["END_STORED_S", "LIMIT_LUA"]

#: An outcome stored for less than this (s) keeps its run's end in the ended sets too: a renewal
#: run up to a minute after the outcome (to a minute and 10 s: the sets' spans) must find the end
#: in one or the other (docs/forwarder.md, "Limits per key").
END_STORED_S = 70

#: Lua functions (a limited run's policy as locals, never a table: see the next comment):
#: ``limit_of(token, at, server)`` (``at``: where the token's ``#L`` is, the caller's plain find)
#: gives ``c, r, p, run, queued, starts`` or nil; ``limit_run_of(token, at)`` the ``run`` key
#: alone; ``limit_num(text, server)``, a number given as text; ``limit_admit(token, c, r, p, run,
#: starts, lease ms, server)`` (the why of a refusal or nil, and the slots counted),
#: ``limit_hold(token, r, p, run, starts, queued, lease ms, job hash, server, fresh, exists)``,
#: ``limit_left(queued, job hash, lease ms, server, exists)`` (a copy left its queue without
#: running; ``exists``: the caller knows the job hash exists), ``limit_renew(run, token, lease ms,
#: ended, server, ours)`` and ``limit_end(token, at or nil, kept, server or nil, life, replaced
#: token or nil)``. ``server`` caches, per
#: script call, Redis's clock, its ``run_id``, the numbers read from text, the keys trimmed, the
#: expiries set, the lapse and lifetime texts: every call of one script call must pass it (an
#: expiry set without it is not remembered, and a later one it skips would leave that one).
#: With ``redis_run_id()`` (``hybridq.protocol.keys.RUN_ID_LUA``), which the claim uses too.
#:
#: Why this shape (callgrind, docs/benchmarks.md "Limits with 10,000 keys"): in Redis's Lua 5.1
#: a table made per run costs about 1.3k instructions (2.6k with six named fields), a
#: ``tonumber`` of text 1.4k (``strtod``, twice), a ``string.match`` with four captures 2.9k, a
#: plain ``string.find`` 0.8k, against about 0.1k for a local's or a table's read: the policy is
#: parsed once per claim into locals, its numbers read through a per-call table of the texts
#: already converted (a batch's runs share their lease's and policy's texts), and an outcome or
#: a renewal takes the ``run`` key alone.
LIMIT_LUA = (
    RUN_ID_LUA
    + f"""
-- A number given as text (a lease, a policy's figure), converted once per script call (its
-- runs share their lease's and policy's texts): ``server.nums`` maps the texts read.
local function limit_num(text, server)
    local nums = server.nums
    if not nums then
        nums = {{["0"] = 0}}
        server.nums = nums
    end
    local n = nums[text]
    if not n then
        n = tonumber(text)
        nums[text] = n
    end
    return n
end
-- The policy after the token's ``#L`` (at ``at``): ``c, r, p`` (numbers; 0: no such limit), the
-- key's ``run``, ``queued`` and (a rate's only) ``starts`` keys; nil if it is not a policy.
-- Anchored at the first ``#L`` (a search from each position of the token cost about 1 % of a
-- limited claim's and outcome's Redis instructions); the search only if that is not the policy.
local function limit_of(token, at, server)
    local c, r, p, key = string.match(token, "^#L(%d+),(%d+),(%d+),(.+)$", at)
    if not key then
        c, r, p, key = string.match(token, "#L(%d+),(%d+),(%d+),(.+)$")
        if not key then return nil end
    end
    local nums = server.nums
    local cn = nums and nums[c] or limit_num(c, server)
    local run, queued = "{PREFIX}" .. key .. ":run", "{PREFIX}" .. key .. ":queued"
    if r == "0" then return cn, 0, 0, run, queued, nil end
    -- (the starts' name only for a rate: a string made per claim)
    return cn, limit_num(r, server), limit_num(p, server), run, queued, "{PREFIX}" .. key .. ":starts"
end
-- The ``run`` key alone (an outcome, a renewal: one capture, no number, one key).
local function limit_run_of(token, at)
    local key = string.match(token, "^#L%d+,%d+,%d+,(.+)$", at)
    if not key then
        key = string.match(token, "#L%d+,%d+,%d+,(.+)$")
        if not key then return nil end
    end
    return "{PREFIX}" .. key .. ":run"
end
-- Redis's clock (ms), read once per script call (``server`` caches it).
local function limit_now(server)
    if not server.now then
        local t = redis.call("TIME")
        server.now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    return server.now
end
-- ``now + ms`` (and ``2 * ms + 1000``) as text, made once per script call and ``ms`` (again when
-- a run of another lease comes between): a Lua number passed to a command is printed each time
-- (``%.17g``, about 1k instructions), and a call's runs share the clock and nearly always the lease.
local function limit_until(server, ms)
    if server.until_for ~= ms then
        local now = server.now or limit_now(server)  -- (the call's clock, the same for every run it holds)
        server.until_for = ms
        server.lapse = string.format("%d", now + ms)
        server.life = string.format("%d", 2 * ms + 1000)
    end
    return server.lapse, server.life
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
-- Whether the run may start (nil) or why not; and the slots its key holds (nil: not counted, no
-- concurrency). 0 slots: the set does not exist, so the hold's ZADD makes it without an expiry.
local function limit_admit(token, c, r, p, run, starts, lease_ms, server)
    local now = server.now or limit_now(server)
    local since = server.limit_since or limit_epoch(now, server)
    local why, n = nil, nil
    local quiet = lease_ms
    if r > 0 and p > quiet then quiet = p end
    if now < since + quiet then
        why = "limited: quarantine after Redis lost state"
    elseif c > 0 then
        -- Lapsed slots (killed workers') are dropped only when they could refuse this run: a
        -- key with room needs no trim. What they leave is bounded by the concurrency (a trim
        -- comes at the limit) and read by nobody (the forwarders count scores still ahead).
        n = redis.call("ZCARD", run)
        if n >= c then n = n - limit_trim(run, now, server) end
        if n >= c then why = "limited: concurrency" end
    else
        limit_trim(run, now, server)  -- (no concurrency: no count to trim at; each call)
    end
    if not why and r > 0 then
        limit_trim(starts, now - p, server)
        if redis.call("ZCARD", starts) >= r then why = "limited: rate" end
    end
    -- This very run holds the slot already (a claim sent again): admitted. Asked only of a
    -- refusal. A slot of its own that lapsed (its holder cut off past the lease, the claim made
    -- again) is not held: left below the concurrency untrimmed, it must not waive the rate.
    if why then
        local held = redis.call("ZSCORE", run, token)
        if held and tonumber(held) > now then return nil, nil end
    end
    return why, n
end
-- A copy of a job of the key left its queue (claimed, refused, fenced, cancelled): one off
-- the count, once per copy (a claim sent again, or made again, finds the mark on its hash; a
-- copy pushed again is a new hash). The count may go below zero for a moment: the push adds
-- its copies in its own call, but a refilled copy's add comes at the forwarder's next step.
-- A key's lifetime made at least ``ms``, never shortened: the key holds other runs' slots (or
-- starts, or the queued count), and a run with a shorter lease (or period) must not make it
-- expire under a longer one's live slot (the limit would then admit more than it allows).
-- Once per key and lifetime per script call (``server`` remembers what it made; none: each
-- time): Redis expires no key while a script runs. ``floor`` (default ``ms``): a lifetime left
-- of at least that is kept as it is (no PEXPIRE).
local function limit_expire(key, ms, server, floor)
    floor = floor or ms
    if server then
        server.expiry = server.expiry or {{}}
        local made = server.expiry[key]
        if made and made >= floor then return end
    end
    local left = redis.call("PTTL", key)  -- -1: no expiry; -2: no key (nothing to expire)
    if left < floor then
        redis.call("PEXPIRE", key, ms)
        left = ms
    end
    if server then server.expiry[key] = left end
end
-- A key's ``run`` set outlives every live slot it holds (a slot lapses a lease after its hold or
-- renewal): made to live two leases and a second when less than a lease and a half and a second
-- is left, so the set still lives half a lease and a second past the slot just held or renewed.
-- Not pushed to two leases at every hold: with a few keys and many runs each, a PEXPIRE per
-- claim (docs/benchmarks.md, "Fewer commands per limited job").
local function limit_run_expire(run, lease_ms, server)
    limit_expire(run, 2 * lease_ms + 1000, server, lease_ms * 1.5 + 1000)
end
-- ``exists``: the caller knows the job hash exists (no EXISTS).
local function limit_left(queued, job, lease_ms, server, exists)
    if (exists or redis.call("EXISTS", job) == 1) and redis.call("HSETNX", job, "hybridq_left", "1") == 0 then
        return
    end
    -- Above 0 or at 0 nothing more: the key existed (a DECR of no key gives -1), so it expires
    -- already (every script that makes it sets its expiry in the same call: the forwarders' add,
    -- and this below zero), two leases after the forwarders' last add at most; a take does not
    -- push the backstop further (two commands fewer for a key with copies left). Reading 0 or no
    -- key is the same. Not a DEL at 0: one command fewer per job, and the forwarders' next add
    -- finds the key (docs/benchmarks.md). Below zero (the key made here, or a copy's add still
    -- to come): the expiry made at least two leases, as before.
    if redis.call("DECR", queued) < 0 then
        limit_expire(queued, 2 * lease_ms, server)
    end
end
-- ``fresh``: the admission counted no slot (the set did not exist): the ZADD makes it, with no
-- expiry to keep (no PTTL).
local function limit_hold(token, r, p, run, starts, queued, lease_ms, job, server, fresh, exists)
    local now = server.now or limit_now(server)
    -- A new start unless the run holds a live slot (a claim sent again). NX first: a new run
    -- (nearly every claim) costs one command; a lapsed slot of its own (the claim made again
    -- after its lease lapsed, not trimmed below the concurrency) is a start again, as a trim
    -- would have made it.
    local lapse, life = limit_until(server, lease_ms)
    local new = redis.call("ZADD", run, "NX", lapse, token) == 1
    if not new then
        new = tonumber(redis.call("ZSCORE", run, token)) <= now
        redis.call("ZADD", run, lapse, token)
    end
    if fresh then
        redis.call("PEXPIRE", run, life)
        server.expiry = server.expiry or {{}}
        server.expiry[run] = 2 * lease_ms + 1000
    else
        limit_run_expire(run, lease_ms, server)
    end
    if new then
        if r > 0 then
            redis.call("ZADD", starts, now, token)
            limit_expire(starts, p + 1000, server)
        end
        limit_left(queued, job, lease_ms, server, exists)
    end
end
-- The ends of runs kept (those a stored outcome will not name: ``limit_end``) are kept a minute
-- (an hour for the runs whose outcome script kept another run's success), in sets by when they
-- ended (or were replaced): one per 10 s of Redis's clock
-- (``hybridq:limit:ended:m<n>``; ``:h<n>``, one per 10 minutes), each expiring a minute (an
-- hour) after its span: an end is kept a minute to a minute and 10 s. Not one sorted set
-- trimmed at each outcome: an outcome adds a run (SADD) and the set's expiry, always the
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
local function limit_renew(run, token, lease_ms, ended, server, ours)
    if ended then return false end
    if not ours and limit_ended(token, server) then return false end
    local now = limit_now(server)
    limit_epoch(now, server)
    redis.call("ZADD", run, now + lease_ms, token)
    limit_run_expire(run, lease_ms, server)
    return true
end
-- A run's end is kept only where its stored outcome will not name it (docs/forwarder.md, "Limits
-- per key"): a renewal whose lease is gone finds the end in the stored outcome first (_RENEW in
-- hybridq.worker.scripts). So an end goes in a set only when ``kept`` (the run's outcome script
-- kept another run's success: an hour or two), when its stored outcome lives less than
-- ``END_STORED_S`` (``life``: the outcome's lifetime, s, as text; a minute or two), or when
-- a later run's outcome replaces it (``was``: the token of the stored outcome this run's
-- replaced, or nil; kept a minute or two from now, as the stored outcome no longer names it;
-- rare: a retry after a failure, a run again after a lost lease). ``at``: where the token's
-- ``#L`` is (the caller's plain find), or nil. ``server``: what the script call has read (the
-- clock), for a call that ends several runs.
local function limit_end_keep(token, kept, server, also)
    -- The set's name and expiry made once per call and kind (the same instant each time).
    local field = kept and "ended_h" or "ended_m"
    local key = server[field]
    local at_ms = nil
    if not key then
        key, at_ms = limit_ended_key(kept, server.now or limit_now(server))
        server[field] = key
    end
    -- Shared by every limit key: written by anything else (another type), it fails only itself
    -- (pcall), never the outcome; a renewal racing it may then hold the slot a lease.
    if also then
        redis.pcall("SADD", key, token, also)  -- a replaced run's end with this run's: one SADD
    else
        redis.pcall("SADD", key, token)
    end
    if at_ms then redis.pcall("PEXPIREAT", key, string.format("%d", at_ms)) end  -- once per set per call
end
local function limit_end(token, at, kept, server, life, was)
    server = server or {{}}
    if not (type(was) == "string" and string.find(was, "#L", 1, true)) then was = nil end
    local run = at and limit_run_of(token, at)
    local mine = false
    if run then
        redis.call("ZREM", run, token)
        -- (a lifetime of 3 digits or more is at least 100 s: no number made for it)
        mine = kept or (#life < 3 and limit_num(life, server) < {END_STORED_S})
    end
    if mine and not kept then
        limit_end_keep(token, false, server, was)
    else
        if mine then limit_end_keep(token, true, server) end
        if was then limit_end_keep(was, false, server) end
    end
end
"""
)
