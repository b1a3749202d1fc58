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
* ``hybridq:limit:<limit key>:run``, ``:starts``, ``:queued``, ``hybridq:limit:ended:*`` and
  ``hybridq:limits:epoch`` -- the per-key limits' state: the runs holding a slot, the starts of
  the last period, the jobs pushed and not yet claimed, the runs that ended whose stored
  outcome will not name them (every key's), and since when this server holds that state
  (:mod:`hybridq.worker.limit_scripts` says what each holds).
"""

from __future__ import annotations

import os
import re

__all__ = [
    "LIMITS_ENDED",
    "LIMITS_EPOCH",
    "LIMIT_PREFIX",
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
#: has these names, they all end in ``:run``, ``:starts`` or ``:queued``).
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
