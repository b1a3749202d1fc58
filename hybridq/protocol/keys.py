"""Every Redis key hybridq reads or writes, built in one place. Its own keys start ``hybridq:``.

RQ's keys (``rq:job:<id>``, ``rq:queue:<name>``, ``rq:queues``, its registries) are RQ's; they are
spelled here only so hybridq code never builds them ad hoc. Their ``rq`` is RQ's key prefix:
``RQ_KEY_PREFIX`` from the environment (RQ 3.0), read as RQ reads it, once, at import.

hybridq's own keys:

* ``hybridq:result:<key id>`` -- the stored outcome of an idempotency key (JSON, expires after the
  key lifetime); a delivery that finds a success here returns it without running the task.
* ``hybridq:lease:<key id>`` -- held (``SET NX PX``) while a worker runs the task for that key, and
  renewed by it; its expiry is how a killed worker is noticed.
* ``hybridq:events:<owner>`` -- a stream of completion events for the forwarder ``owner``, which
  harvests them into its durable ledger and then deletes them.
* ``hybridq:epoch:<owner>`` -- a token the forwarder ``owner`` wrote; gone or different means Redis
  lost state, so everything not durably terminal is forwarded again.
* ``hybridq:node:<name>``, ``hybridq:node:<name>:asks`` and ``hybridq:node:reply:<token>`` -- an
  ingest node (``hybridq forward --serve``) says it is alive, takes other nodes' lookups of its
  jobs, and answers each on a one-off reply key (``hybridq.http.peers``).
* ``hybridq:waiting`` and ``hybridq:waiting:info`` -- jobs a worker could not run (it cannot
  import the task, or is not configured to allow it) and left for another worker, with why
  (:mod:`hybridq.worker.waiting`); ``status`` and ``doctor`` show them.
* ``hybridq:stats:<owner>`` and ``hybridq:forwarders`` -- the stats snapshot each forwarder
  publishes (JSON, with a TTL) and the sorted set of forwarders by when each last did, for
  ``hybridq status --all``. Display only: anyone who can write to Redis can write them
  (docs/security.md), so nothing decides anything from them.
* ``hybridq:limit:holders`` and ``hybridq:limit:leases`` (every key's slots: holders per key,
  each holder's lease), ``hybridq:limit:<limit key>:starts``, ``:queued``,
  ``hybridq:limit:ended:*`` and ``hybridq:limits:epoch`` -- the per-key limits' state: the runs
  holding a slot, the starts of the last period, the jobs pushed and not yet claimed, the runs
  that ended (every key's), and since when this server holds that state
  (:mod:`hybridq.worker.limit_scripts` says what each holds).
"""

from __future__ import annotations

import os
import re

__all__ = [
    "LIMITS_ENDED",
    "LIMITS_EPOCH",
    "LIMITS_HOLDERS",
    "LIMITS_LEASES",
    "LIMIT_PREFIX",
    "LIMIT_SLOTS_LUA",
    "NODE_REPLY_PREFIX",
    "PREFIX",
    "RQ_PREFIX",
    "RUN_ID_LUA",
    "epoch",
    "events",
    "forwarders",
    "lease",
    "limits_ended",
    "node_asks",
    "node_reply",
    "node_seen",
    "result",
    "rq_intermediate",
    "rq_job",
    "rq_queue",
    "rq_queues",
    "rq_registry",
    "stats",
    "waiting",
    "waiting_info",
]

#: Prefix of every key hybridq owns.
PREFIX = "hybridq:"
#: Prefix of a limit key's state (``hybridq:limit:<limit key>:<part>``).
LIMIT_PREFIX = PREFIX + "limit:"
#: When the limits' state began on this Redis (``<ms>:<run_id>``).
LIMITS_EPOCH = PREFIX + "limits:epoch"
#: Every limit key's slots, in two keys shared by all (not a sorted set per key: with a key per
#: tenant and a job or two each, each claim created one, set its expiry and each outcome dropped
#: it, docs/benchmarks.md): a hash of how many runs hold a slot per limit key, and a sorted set of
#: every holder's token (which names its key) scored by when its slot lapses (ms, Redis's clock).
LIMITS_HOLDERS = LIMIT_PREFIX + "holders"
LIMITS_LEASES = LIMIT_PREFIX + "leases"
#: Lua functions on them, for the workers' scripts (hybridq.worker.limit_scripts) and the
#: forwarders' read (hybridq.transport.rq_limits): ``limit_key_of(token)`` (the limit key a
#: limited run's token names, or nil), ``limit_count(key, by)`` (a key's holders moved by
#: ``by``; the field dropped at 0: the hash holds only keys with holders), ``limit_holders(key)``
#: and
#: ``limit_sweep(now)`` (the holders whose slot lapsed by ``now``, a killed worker's, dropped and
#: their keys' counts taken down: at most 1,000 a call, the earliest first; a key at its limit
#: or the next call sweeps on). Every change of the sorted set's members goes with its count's,
#: in one script: a key's count is the number of its tokens in the set. Written with another
#: type by something else, they fail no script (``pcall``): the claims then refuse every limited
#: run and the forwarders hold every limited key's jobs (``limit_holders`` answers nil), or the
#: slots go uncounted (docs/security.md).
LIMIT_SLOTS_LUA = f"""
local function limit_key_of(token)
    local at = string.find(token or "", "#L", 1, true)
    if not at then return nil end
    -- Anchored at the first ``#L``; the search only if that is not the policy.
    local key = string.match(token, "^#L%d+,%d+,%d+,(.+)$", at)
    return key or string.match(token, "#L%d+,%d+,%d+,(.+)$")
end
local function limit_count(key, by)
    local n = redis.pcall("HINCRBY", "{LIMIT_PREFIX}holders", key, by)
    if type(n) == "number" and n <= 0 then
        redis.call("HDEL", "{LIMIT_PREFIX}holders", key)
    end
end
-- A key's holders (0: none), or nil when the hash is not one.
local function limit_holders(key)
    local n = redis.pcall("HGET", "{LIMIT_PREFIX}holders", key)
    if n == false then return 0 end
    return type(n) == "string" and tonumber(n) or nil
end
local function limit_sweep(now)
    local gone = redis.pcall("ZRANGEBYSCORE", "{LIMIT_PREFIX}leases", "-inf", now, "LIMIT", 0, 1000)
    if type(gone) ~= "table" or gone.err then return 0 end
    for _, token in ipairs(gone) do
        redis.call("ZREM", "{LIMIT_PREFIX}leases", token)
        local key = limit_key_of(token)
        if key then limit_count(key, -1) end
    end
    return #gone
end
"""
#: Lua functions for the ``run_id`` the epoch keys hold (``epoch``, :data:`LIMITS_EPOCH`):
#: ``run_id_of(info text)`` and ``redis_run_id()``, the run_id of the server that runs the script
#: (its 40 hex digits, or false: INFO denied by an ACL, or no such field). Every script that
#: writes or compares one reads it with these (the forwarder's read and the claim's fence must
#: agree): a plain find of the field at a line's start, then a match anchored there (a pattern
#: searched from every position of INFO's text cost more than INFO itself, docs/benchmarks.md).
RUN_ID_LUA = r"""
local function run_id_of(info)
    local at = type(info) == "string" and string.find(info, "\nrun_id:", 1, true)
    return at and string.match(info, "^%x+", at + 8) or false
end
local function redis_run_id()
    return run_id_of(redis.pcall("INFO", "server"))
end
"""
#: The runs of every limit key whose outcome was recorded: the prefix of one set per 10 s
#: (``:m<n>``, kept a minute) or 10 minutes (``:h<n>``, kept an hour) of Redis's clock
#: (hybridq.worker.limit_scripts; not a set created and dropped per key; no limit key's part
#: has these names, they all end in ``:starts`` or ``:queued``).
LIMITS_ENDED = LIMIT_PREFIX + "ended"


def limits_ended(at_ms: int, *, kept: bool = False) -> str:
    """The set of ended runs an outcome at ``at_ms`` (Redis's clock) adds its run to."""
    return f"{LIMITS_ENDED}:h{at_ms // 600_000}" if kept else f"{LIMITS_ENDED}:m{at_ms // 10_000}"


#: RQ's key prefix, as ``rq.defaults`` reads it (this module must not import rq: producers use
#: it): a worker and a forwarder started with the same ``RQ_KEY_PREFIX`` meet in the same keys.
RQ_PREFIX = os.environ.get("RQ_KEY_PREFIX", "rq")
if not re.fullmatch(r"[A-Za-z0-9_.:{}-]+", RQ_PREFIX):  # RQ refuses the same (at its import)
    raise ValueError(
        f"Invalid RQ_KEY_PREFIX {RQ_PREFIX!r}: only letters, digits, and _ . : - {{ }} are allowed"
    )


def rq_job(job_id: str) -> str:
    """RQ's hash for one job."""
    return f"{RQ_PREFIX}:job:{job_id}"


def rq_queue(queue: str) -> str:
    """RQ's list of job ids waiting in ``queue``."""
    return f"{RQ_PREFIX}:queue:{queue}"


def rq_queues() -> str:
    """RQ's set of queue keys (what ``rq info`` lists)."""
    return f"{RQ_PREFIX}:queues"


def rq_registry(kind: str, queue: str) -> str:
    """One of RQ's job registries of ``queue`` (``failed``, ``canceled``, ``finished``...)."""
    return f"{RQ_PREFIX}:{kind}:{queue}"


def rq_intermediate(queue: str) -> str:
    """RQ's list of job ids a worker took from ``queue`` and has not started yet."""
    return f"{rq_queue(queue)}:intermediate"


def result(key_id: str) -> str:
    """The stored outcome of an idempotency key (``key_id`` is :attr:`Envelope.key_id`)."""
    return f"{PREFIX}result:{key_id}"


def lease(key_id: str) -> str:
    """The lease a worker holds while it runs the task of an idempotency key."""
    return f"{PREFIX}lease:{key_id}"


def events(owner: str) -> str:
    """The completion-event stream of one forwarder."""
    return f"{PREFIX}events:{owner}"


def waiting() -> str:
    """Jobs a worker could not run and left for another one: job id -> until when to list it."""
    return f"{PREFIX}waiting"


def waiting_info() -> str:
    """What a worker said about each job in :func:`waiting` (JSON per job id)."""
    return f"{PREFIX}waiting:info"


def epoch(owner: str) -> str:
    """The epoch token of one forwarder (its absence means Redis lost state)."""
    return f"{PREFIX}epoch:{owner}"


#: The prefix of the one-off keys an ingest node answers another's lookup on.
NODE_REPLY_PREFIX = f"{PREFIX}node:reply:"


def node_seen(node: str) -> str:
    """Set (with a short expiry) while the ingest node ``node`` runs: gone means it is down."""
    return f"{PREFIX}node:{node}"


def node_asks(node: str) -> str:
    """The list of lookups other ingest nodes ask ``node`` (JSON: the job id, the reply key)."""
    return f"{PREFIX}node:{node}:asks"


def node_reply(token: str) -> str:
    """The one-off key a lookup's answer is pushed to (``token``: 32 random hex digits)."""
    return f"{NODE_REPLY_PREFIX}{token}"


def stats(owner: str) -> str:
    """The stats snapshot the forwarder ``owner`` published (JSON; expires unless published again)."""
    return f"{PREFIX}stats:{owner}"


def forwarders() -> str:
    """Every forwarder that published its stats: owner id -> when it last did (unix seconds)."""
    return f"{PREFIX}forwarders"
