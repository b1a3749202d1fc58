"""What the forwarders' gate reads of the per-key limits in Redis, in one script call per step.

The state itself is the workers' (their claim, renewal and outcome scripts keep it:
``hybridq.worker.limit_scripts``); a forwarder only adds the jobs it pushed to a key's
``queued`` count and reads, per key, what holds a slot now, what is queued, how many started in
the rate's period and how long the quarantine after a loss of Redis's state has left.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridq.protocol.keys import LIMIT_PREFIX, LIMITS_EPOCH

from .base import KeyUse

__all__ = ["KEY_USE", "key_use"]

# ARGV: the lease (ms), then per key: the key, its rate period (ms; 0: no rate; -1: only add, not
# read), the jobs pushed since the last call. The epoch is started here too when Redis lost it
# (as the claim would), so the quarantine begins at the forwarder's first look. Returns per key
# {running, queued, started in the period, quarantine left (ms)}, or 0 for a key only added to.
# The queued count expires two leases after the last push: jobs lost with Redis, or cancelled,
# stop counting. A part of a key of the wrong type (written by something else) fails only its
# own command (``pcall``): that key is held (never over its limit), the others go on.
KEY_USE = f"""
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local info = redis.pcall("INFO", "server")
local run_id = type(info) == "string" and string.match(info, "run_id:(%x+)") or ""
local since, was = string.match(redis.call("GET", "{LIMITS_EPOCH}") or "", "^(%d+):(%x*)$")
since = tonumber(since)
if not since or since > now or (run_id ~= "" and was ~= run_id) then
    since = now
    redis.call("SET", "{LIMITS_EPOCH}", now .. ":" .. run_id)
end
local quiet0 = math.max(0, since + lease - now)
local out = {{}}
for i = 2, #ARGV, 3 do
    local at = "{LIMIT_PREFIX}" .. ARGV[i] .. ":"
    local period, add = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local bad = false
    local queued = 0
    if add > 0 then
        queued = redis.pcall("INCRBY", at .. "queued", add)
        if type(queued) == "number" then
            redis.call("PEXPIRE", at .. "queued", 2 * lease)
        else
            bad = true
        end
    elseif period >= 0 then
        local raw = redis.pcall("GET", at .. "queued")
        queued = raw and tonumber(raw)
        if raw and not queued then bad = true end
    end
    if period < 0 then
        out[#out + 1] = 0
    else
        local running = redis.pcall("ZCOUNT", at .. "run", "(" .. now, "+inf")
        local started = 0
        if period > 0 then
            started = redis.pcall("ZCOUNT", at .. "starts", "(" .. (now - period), "+inf")
        end
        if bad or type(running) ~= "number" or type(started) ~= "number" then
            out[#out + 1] = {{0, 0, 0, 86400000}}
        else
            local quiet = quiet0
            if period > lease then quiet = math.max(0, since + period - now) end
            out[#out + 1] = {{running, math.max(0, queued or 0), started, quiet}}
        end
    end
end
return out
"""


def key_use(
    script: Any, lease_s: float, periods: Mapping[str, int], added: Mapping[str, int]
) -> dict[str, KeyUse]:
    """Each key of ``periods`` (key -> rate period ms)'s use, after adding ``added`` to their queued counts.

    A key of ``added`` not in ``periods`` is only added to (not read). ``script``:
    :data:`KEY_USE`, registered on the Redis client.
    """
    args: list[Any] = [max(1, int(lease_s * 1000))]
    names = list(periods)
    for key in names:
        args += [key, periods[key], added.get(key, 0)]
    for key, n in added.items():
        if key not in periods:
            args += [key, -1, n]
    rows = script(keys=[], args=args)
    return {
        key: KeyUse(int(r[0]), int(r[1]), int(r[2]), int(r[3]) / 1000)
        for key, r in zip(names, rows[: len(names)], strict=True)
    }
