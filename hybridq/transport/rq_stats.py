"""The stats snapshots in Redis (``hybridq status --all``): publish one, read them all, forget one.

What it reads anyone who can write to Redis can have written (docs/security.md), so a read is
bounded whatever is there: only entries seen up to now by Redis's own clock (one seen "in the
future" would push the real forwarders out of the newest ``limit``), no value downloaded beyond
:data:`MAX_BODY` (its length is asked first), no owner name longer than :data:`MAX_OWNER`, and a
key of another type is that entry's error, never the whole view's. Every score is Redis's
``TIME``, so the forwarders' clocks never matter.
"""

from __future__ import annotations

from typing import Any

import redis

from hybridq.protocol import keys

from .base import MAX_STATS_BODY, Published

__all__ = ["FORGET_FORWARDERS_S", "MAX_BODY", "MAX_OWNER", "forget", "publish", "read"]

#: A forwarder not seen for this long leaves the set ``hybridq status --all`` lists (a day).
FORGET_FORWARDERS_S = 86400.0
MAX_BODY = MAX_STATS_BODY
#: An owner name longer than this is listed as invalid, its snapshot not read.
MAX_OWNER = 256


def _redis_now(conn: redis.Redis) -> float:
    seconds, micros = conn.time()
    return float(seconds) + micros / 1e6


def publish(conn: redis.Redis, owner: str, body: bytes, ttl_s: float) -> None:
    """Set ``owner``'s snapshot with its TTL and note it, at Redis's time, in the set of forwarders.

    Entries not seen for :data:`FORGET_FORWARDERS_S`, and entries "seen" in the future (forged:
    every score is Redis's time), leave the set.
    """
    now = _redis_now(conn)
    pipe = conn.pipeline(transaction=False)
    pipe.set(keys.stats(owner), body, px=max(1, int(ttl_s * 1000)))
    pipe.zadd(keys.forwarders(), {owner: now})
    pipe.zremrangebyscore(keys.forwarders(), "-inf", now - FORGET_FORWARDERS_S)
    pipe.zremrangebyscore(keys.forwarders(), f"({now + 1}", "+inf")
    pipe.execute()


def read(conn: redis.Redis, limit: int) -> tuple[float, list[Published]]:
    """Redis's time and the newest ``limit`` snapshots seen by then, the most recent first."""
    now = _redis_now(conn)
    seen: list[tuple[Any, float]] = list(
        conn.zrevrangebyscore(keys.forwarders(), now + 1, "-inf", start=0, num=limit, withscores=True)  # type: ignore[arg-type]
    )
    names = [o.decode(errors="replace") if isinstance(o, bytes) else str(o) for o, _ in seen]
    pipe = conn.pipeline(transaction=False)
    for name in names:
        if len(name) <= MAX_OWNER:
            pipe.strlen(keys.stats(name))
            pipe.getrange(keys.stats(name), 0, MAX_BODY - 1)
            pipe.pttl(keys.stats(name))
    replies: list[Any] = pipe.execute(raise_on_error=False)
    out = []
    for name, (_, score) in zip(names, seen, strict=True):
        if len(name) > MAX_OWNER:
            out.append(Published(name, float(score), None, None, f"owner name of {len(name)} characters"))
            continue
        size, body, pttl = replies[:3]
        del replies[:3]
        out.append(_published(name, float(score), size, body, pttl))
    return now, out


def _published(name: str, score: float, size: Any, body: Any, pttl: Any) -> Published:
    error = next((r for r in (size, body, pttl) if isinstance(r, Exception)), None)
    if error is not None:  # WRONGTYPE: a key someone else wrote
        return Published(name, score, None, None, f"unreadable ({str(error)[:80]})")
    if int(size) > MAX_BODY:
        return Published(name, score, None, None, f"snapshot of {int(size)} bytes (at most {MAX_BODY})")
    alive = int(size) > 0 and int(pttl) >= 0
    return Published(name, score, bytes(body) if alive else None, int(pttl) / 1000 if alive else None)


def forget(conn: redis.Redis, owner: str) -> bool:
    """Remove ``owner`` from the view (its snapshot and its entry); False if it was not there."""
    pipe = conn.pipeline(transaction=False)
    pipe.delete(keys.stats(owner))
    pipe.zrem(keys.forwarders(), owner)
    deleted, removed = pipe.execute()
    return bool(deleted or removed)
