"""Jobs a worker left for another one because it cannot run them here.

A rolling deploy (a task older workers do not have), a missing ``--allow``: such jobs are
recorded so that ``hybridq status``, ``hybridq doctor`` and the forwarder's metrics show them.

Such a job is not claimed, and hybridq does not fail it: the worker raises :class:`TaskUnavailable`, RQ marks
that delivery failed, and since the task never started (no attempt was used) the forwarder's
reconcile pass finds it *stranded* and delivers the same attempt again about two leases later,
for as long as no worker can run it (docs/worker.md, "Workers that cannot run a job").

Each record stays listed for three leases plus a minute after the last worker left the job:
a job listed here was refused that recently (and may have been run by another worker since).

Like :mod:`hybridq.worker`, this module must not import the journal.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import redis

from hybridq.errors import NotAllowed, TaskUnavailable
from hybridq.protocol import keys
from hybridq.security.allow import allowed

__all__ = ["TaskUnavailable", "Waiting", "current", "not_set_up_for", "record", "unimportable"]

# KEYS: waiting (zset), waiting info (hash). ARGV: job id, list-until time, info JSON, now.
_RECORD = """
redis.call("ZADD", KEYS[1], ARGV[2], ARGV[1])
redis.call("HSET", KEYS[2], ARGV[1], ARGV[3])
-- Records past their listing time go, up to 100 at a time (each record prunes).
local old = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", "(" .. ARGV[4], "LIMIT", 0, 100)
for _, id in ipairs(old) do
    redis.call("ZREM", KEYS[1], id)
    redis.call("HDEL", KEYS[2], id)
end
return #old
"""


@dataclass(frozen=True, slots=True)
class Waiting:
    """Jobs workers recently left for another worker."""

    #: How many are listed.
    count: int
    #: Up to ``limit`` of them (oldest listing first): job id, func, queue, reason, worker, at.
    examples: list[dict[str, Any]]


def record(conn: redis.Redis, job_id: str, info: dict[str, Any], *, lease_s: float) -> None:
    """List ``job_id`` as waiting for a worker that can run it (``info``: func, queue, reason)."""
    now = time.time()
    body = json.dumps({"id": job_id, "at": now, **info})
    conn.eval(_RECORD, 2, keys.waiting(), keys.waiting_info(), job_id, now + 3 * lease_s + 60, body, now)


def current(conn: redis.Redis, *, limit: int = 10) -> Waiting:
    """The jobs listed now (recently left by a worker that could not run them)."""
    now = time.time()
    count = int(conn.zcount(keys.waiting(), now, "+inf"))
    ids: list[Any] = (
        list(conn.zrangebyscore(keys.waiting(), now, "+inf", start=0, num=limit)) if count else []
    )
    examples: list[dict[str, Any]] = []
    for raw in conn.hmget(keys.waiting_info(), ids) if ids else []:
        try:
            body = json.loads(raw) if raw is not None else None
        except ValueError:
            body = None
        if isinstance(body, dict):
            examples.append(body)
    return Waiting(count, examples)


def not_set_up_for(path: str, error: Exception) -> bool:
    """Whether ``error`` refused ``path`` only because this worker was not told to allow it.

    Then another worker (configured for it, or of a newer deploy) may run it. Not so for a bad
    signature, a path refused although an allowed prefix covers it (a security refusal), or a
    function of the standard library (``os.system``): those fail for good.
    """
    if not isinstance(error, NotAllowed):
        return False
    if allowed(path):
        return False
    top = path.partition(".")[0]
    return top not in sys.stdlib_module_names and top not in sys.builtin_module_names


def unimportable(path: str) -> str:
    """Why this worker cannot import the (allowed) function at ``path``.

    Called once :func:`hybridq.security.allow.resolve` failed on it with an import error: the module that
    does not import (and its error), or the attribute it lacks.
    """
    parts = path.split(".")
    missing: str | None = None  # the longest dotted prefix that is no module
    for n in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:n])
        try:
            obj: Any = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
                missing = missing or module
                continue  # not a module: a shorter prefix may be one
            return f"cannot import {path}: importing {module} failed: {exc!r}"
        except Exception as exc:  # the module's own code raised
            return f"cannot import {path}: importing {module} failed: {exc!r}"
        for i, attr in enumerate(parts[n:], start=n):
            if not hasattr(obj, attr):
                if missing is not None and missing.startswith(".".join(parts[: i + 1])):
                    return f"cannot import {path}: no module named {missing!r}"
                return f"cannot import {path}: {'.'.join(parts[:i])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return f"cannot import {path}"
    return f"cannot import {path}: no module named {missing or path!r} on this worker's sys.path"
