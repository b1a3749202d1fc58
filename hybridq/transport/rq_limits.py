"""What the forwarders' gate reads of the per-key limits in Redis, in one script call per step.

The state itself is the workers' (their claim, renewal and outcome scripts keep it:
``hybridq.worker.limit_scripts``); a forwarder's push adds the copies it queued to their
keys' ``queued`` counts (``rq_push``); this read adds those the refill queued, and reads, per
key, what holds a slot now, what is queued, how many started in the rate's period and how long
the quarantine after a loss of Redis's state has left.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridq.protocol.keys import LIMIT_PREFIX, LIMITS_EPOCH, RUN_ID_LUA

from .base import KeyUse

__all__ = ["KEY_USE", "key_use"]

# ARGV: the lease (ms), then the keys as one string (a limit key has no whitespace): per key
# "key period added ", its rate period (ms as plain integer text, compared as text: 0: no rate;
# -1: only add, not read; never "00" or "-0") and the jobs queued since the last call that the
# push did not count (the refill's) (one argument: redis-py packs each argument in Python, a
# third of the call's cost with 3 per key). The epoch is started here too when Redis lost it (as the
# claim would), so the quarantine begins at the forwarder's first look. Returns, flat, per key
# read: running, queued, started in the period, quarantine left (ms). The queued count expires
# two leases after the last add, here or by a push (or a take that left it below zero; a take at 0
# or above leaves its expiry): a backstop for copies that left Redis without a claim or a
# cancel taking them off (hybridq.worker.limit_scripts). A part of
# a key of the wrong type (written by something else) fails only its own command (``pcall``):
# that key is held (never over its limit), the others go on.
KEY_USE = (
    RUN_ID_LUA
    + f"""
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local run_id = redis_run_id() or ""  -- (hybridq.protocol.keys.RUN_ID_LUA, as the claim reads it)
local since, was = string.match(redis.call("GET", "{LIMITS_EPOCH}") or "", "^(%d+):(%x*)$")
since = tonumber(since)
if not since or since > now or (run_id ~= "" and was ~= run_id) then
    since = now
    redis.call("SET", "{LIMITS_EPOCH}", now .. ":" .. run_id)
end
local after = "(" .. now
local life = string.format("%d", 2 * lease)  -- (as text once: a number is printed per command)
local quiet0 = since + lease - now
if quiet0 < 0 then quiet0 = 0 end
-- Per key the least Lua (each step reads every key it pushed to; docs/benchmarks.md, "Limits
-- with 10,000 keys"): the period and the add compared as text (a tonumber is ``strtod``, twice:
-- only a rate's period), redis.call and type as locals, the reply's length counted.
local call, pcall_, type_, huge = redis.call, redis.pcall, type, math.huge
local out, n = {{}}, 0
for key, period, added in string.gmatch(ARGV[2], "(%S+) (%-?%d+) (%d+)") do
    local count = "{LIMIT_PREFIX}" .. key .. ":queued"
    local bad = false
    local queued = 0
    if added ~= "0" then
        queued = pcall_("INCRBY", count, added)
        if type_(queued) == "number" then
            call("PEXPIRE", count, life)
        else
            bad = true
        end
    elseif period ~= "-1" then
        local raw = pcall_("GET", count)
        queued = raw and tonumber(raw)
        -- Not a count: no number, NaN (not equal to itself) or an infinity ("nan", "inf" that
        -- another writer left): the key is held, as a wrong type.
        if raw and (not queued or queued ~= queued or queued == huge or queued == -huge) then bad = true end
    end
    if period ~= "-1" then
        local running = pcall_("ZCOUNT", "{LIMIT_PREFIX}" .. key .. ":run", after, "+inf")
        local started, quiet = 0, quiet0
        if period ~= "0" then
            local ms = tonumber(period)
            started = pcall_("ZCOUNT", "{LIMIT_PREFIX}" .. key .. ":starts", "(" .. (now - ms), "+inf")
            if type_(started) ~= "number" then bad = true end
            if ms > lease then
                quiet = since + ms - now
                if quiet < 0 then quiet = 0 end
            end
        end
        if bad or type_(running) ~= "number" then
            out[n + 1], out[n + 2], out[n + 3], out[n + 4] = 0, 0, 0, 86400000
        else
            if not queued or queued < 0 then queued = 0 end
            out[n + 1], out[n + 2], out[n + 3], out[n + 4] = running, queued, started, quiet
        end
        n = n + 4
    end
end
return out
"""
)


def key_use(
    script: Any, lease_s: float, periods: Mapping[str, int], added: Mapping[str, int]
) -> dict[str, KeyUse]:
    """Each key of ``periods`` (key -> rate period ms)'s use, after adding ``added`` to their queued counts.

    A key of ``added`` not in ``periods`` is only added to (not read). ``script``:
    :data:`KEY_USE`, registered on the Redis client.
    """
    if added:
        parts = [f"{key} {period} {added.get(key, 0)} " for key, period in periods.items()]
        parts += [f"{key} -1 {n} " for key, n in added.items() if key not in periods]
    else:  # the push counts its copies: nothing to add, most reads
        parts = [f"{key} {period} 0 " for key, period in periods.items()]
    r = script(keys=[], args=[max(1, int(lease_s * 1000)), "".join(parts)])
    # The script's integers come back as Python ints: no int() of each; four at a time.
    if len(r) != 4 * len(periods):
        raise ValueError(f"the limits' read answered {len(r)} figures for {len(periods)} keys")
    it, new = iter(r), tuple.__new__  # (the named tuple's own __new__ is a Python frame per key)
    return {
        key: new(KeyUse, (running, queued, started, quiet / 1000))
        for key, running, queued, started, quiet in zip(periods, it, it, it, it, strict=True)
    }
