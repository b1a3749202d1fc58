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

# ARGV: the lease (ms), then per key: the key, its rate period (ms; 0: no rate), the jobs pushed
# since the last call. The epoch is started here too when Redis lost it (as the claim would),
# so the quarantine begins at the forwarder's first look. Returns per key {running, queued,
# started in the period, quarantine left (ms)}. The queued count expires two leases after its
# last change (a backstop for copies that left Redis without a claim or a cancel taking them off:
# hybridq.worker.limit_scripts).
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
local out = {{}}
for i = 2, #ARGV, 3 do
    local at = "{LIMIT_PREFIX}" .. ARGV[i] .. ":"
    local period, add = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local kinds = {{run = "zset", starts = "zset", queued = "string"}}
    local bad = false
    for part, kind in pairs(kinds) do
        local ty = redis.call("TYPE", at .. part)["ok"]
        if ty ~= "none" and ty ~= kind then bad = true end
    end
    local raw = redis.call("GET", bad and "{LIMITS_EPOCH}" or at .. "queued")
    if not bad and raw and not tonumber(raw) then bad = true end
    if bad then
        -- Written by something else: this key is held (never over its limit), the others go on.
        out[#out + 1] = {{0, 0, 0, 86400000}}
    else
    if add > 0 then
        redis.call("INCRBY", at .. "queued", add)
        redis.call("PEXPIRE", at .. "queued", 2 * lease)
    end
    local running = redis.call("ZCOUNT", at .. "run", "(" .. now, "+inf")
    local started = 0
    if period > 0 then
        started = redis.call("ZCOUNT", at .. "starts", "(" .. (now - period), "+inf")
    end
    local quiet = lease
    if period > quiet then quiet = period end
    local queued = math.max(0, tonumber(redis.call("GET", at .. "queued") or "0"))
    out[#out + 1] = {{running, queued, started,
        math.max(0, since + quiet - now)}}
    end
end
return out
"""


def key_use(
    script: Any, lease_s: float, periods: Mapping[str, int], added: Mapping[str, int]
) -> dict[str, KeyUse]:
    """Each key of ``periods`` (key -> rate period ms)'s use, after adding ``added`` to their queued counts.

    ``script``: :data:`KEY_USE`, registered on the Redis client.
    """
    args: list[Any] = [max(1, int(lease_s * 1000))]
    names = list(periods)
    for key in names:
        args += [key, periods[key], added.get(key, 0)]
    rows = script(keys=[], args=args)
    return {
        key: KeyUse(int(r[0]), int(r[1]), int(r[2]), int(r[3]) / 1000)
        for key, r in zip(names, rows, strict=True)
    }
