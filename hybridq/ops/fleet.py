"""One view of many journals: the stats every forwarder sharing a Redis published there.

Each forwarder publishes its figures (:mod:`hybridq.forwarder.publish`) under
``hybridq:stats:<owner>`` with a TTL, and notes when in the set ``hybridq:forwarders``. This
module reads them for ``hybridq status --all``, ``hybridq.stats(all=True)``, the dashboard's
overview and ``/metrics`` (:class:`hybridq.http.metrics.FleetCollector`): per forwarder its
counts, backlog, oldest waiting job and when it was last seen, flagged ``stale`` once its
snapshot expired (it has not published for three intervals: it died, hangs, or cannot reach
Redis), and the totals of the fresh ones.

What it reads is display only: anyone who can write to Redis can write it (docs/security.md).
Each snapshot is checked before it is shown (a size bound, numbers that are numbers, strings cut
short); one that fails is listed as ``invalid`` with why, and counted in no total. Callers escape
the strings for their output (a terminal, HTML).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from hybridq.errors import TransportError
from hybridq.transport.base import MAX_STATS_BODY, Published
from hybridq.transport.redisurl import redact_url

__all__ = ["COUNTS", "MAX_BODY", "MAX_FORWARDERS", "fleet", "fleet_or_error", "forget", "read_fleet"]

#: The counts of one forwarder (and of the total), in the order ``status --all`` prints them.
COUNTS = (
    "accepted",
    "forwarded",
    "succeeded",
    "failed",
    "pending",
    "not_yet_forwarded",
    "delayed_held",
    "retrying",
    "cancelled",
    "duplicates_suppressed",
)
#: The most forwarders listed (the most recently seen first).
MAX_FORWARDERS = 1000
#: A snapshot larger than this is not read (a forwarder's is well under 4 KiB plus its queues).
MAX_BODY = MAX_STATS_BODY
#: The largest number of seconds believed (317 years; a timestamp too): sums of ages stay finite
#: (JSON has no ``Infinity``).
_MAX_SECONDS = 1e10
_MAX_TEXT = 256
_MAX_QUEUES = 200
_AGES = ("oldest_pending_age_s", "forwarding_lag_s")
_TEXTS = ("host", "journal")


def fleet(redis_url: str, *, limit: int = MAX_FORWARDERS) -> dict[str, Any]:
    """What ``hybridq status --all --json`` prints: every forwarder seen on this Redis, and totals.

    Raises:
        TransportError: Redis does not answer (or refuses this URL).
    """
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415 - redis-py only when asked

    transport = RQTransport(redis_url, socket_timeout_s=2.0)
    try:
        published = transport.read_stats(limit)
    finally:
        transport.close()
    return read_fleet(published, redis_url=redact_url(redis_url))


def read_fleet(published: list[Published], *, redis_url: str, now: float | None = None) -> dict[str, Any]:
    """The view of what :meth:`Transport.read_stats` returned (``now``: the reader's clock)."""
    now = time.time() if now is None else now
    forwarders = [_entry(p, now) for p in published]
    fresh = [f for f in forwarders if not f["stale"] and "invalid" not in f]
    total: dict[str, Any] = {name: sum(f[name] for f in fresh) for name in COUNTS}
    queues: dict[str, int] = {}
    for f in fresh:
        for queue, n in f["queues"].items():
            queues[queue] = queues.get(queue, 0) + n
    total["queues"] = dict(sorted(queues.items()))
    for age in _AGES:
        total[age] = max((f[age] for f in fresh), default=0.0)
    return {
        "redis": {"url": redis_url},
        "forwarders": forwarders,
        "fresh": len(fresh),
        "stale": sum(1 for f in forwarders if f["stale"]),
        "invalid": sum(1 for f in forwarders if "invalid" in f),
        "total": total,
    }


def _entry(p: Published, now: float) -> dict[str, Any]:
    """One forwarder's line: its checked snapshot, or ``stale`` (expired), or ``invalid`` (why)."""
    out: dict[str, Any] = {
        "owner": _text(p.owner),
        "stale": p.body is None,
        "last_seen": round(p.last_seen, 3),
        "last_seen_age_s": round(max(0.0, now - p.last_seen), 3),
    }
    if p.error is not None:
        out["invalid"] = _text(p.error)
        return out
    if p.body is None:
        return out
    try:
        body = _checked(p.body)
    except ValueError as exc:
        out["invalid"] = str(exc)
        return out
    # The age by Redis's clock (its TTL counts down there): no skew between hosts.
    since = max(0.0, body["ttl_s"] - (p.ttl_left_s or 0.0))
    out["last_seen_age_s"] = round(since, 3)
    out.update({k: v for k, v in body.items() if k not in _AGES})
    for age in _AGES:
        out[age] = round(body[age] + since, 3) if body[age] > 0 else 0.0
    return out


def _checked(raw: bytes) -> dict[str, Any]:
    """The snapshot's fields, each of its type and bounded; ``ValueError`` says what is wrong."""
    if len(raw) > MAX_BODY:
        raise ValueError(f"snapshot of {len(raw)} bytes (at most {MAX_BODY})")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError("snapshot is not JSON") from exc
    if not isinstance(body, dict) or body.get("v") != 1:
        raise ValueError("not a version 1 snapshot")
    out: dict[str, Any] = {name: _count(body, name) for name in COUNTS}
    for name in (*_AGES, "every_s", "ttl_s", "published_at"):
        out[name] = _number(body, name)
    out["pid"] = _count(body, "pid")
    for name in _TEXTS:
        out[name] = _text(body.get(name))
    queues = body.get("queues")
    if not isinstance(queues, dict) or len(queues) > _MAX_QUEUES:
        raise ValueError(f"queues: not an object of at most {_MAX_QUEUES} queues")
    out["queues"] = {_text(q): _count(queues, q) for q in sorted(queues)}
    return out


def _count(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise ValueError(f"{_text(name)}: not a count")
    return value


def _number(body: dict[str, Any], name: str) -> float:
    value = body.get(name)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 <= value <= _MAX_SECONDS
    ):
        raise ValueError(f"{name}: not a number of seconds")
    return float(value)


def _text(value: object) -> str:
    """A string cut at 256 characters, any lone surrogate as ``\\udXXX`` (escaping is the output's).

    JSON can carry a lone surrogate (``"\\ud800"``) that no output can encode: kept, it would
    break the terminal's output, ``/metrics`` and the overview alike.
    """
    text = value if isinstance(value, str) else "" if value is None else str(value)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"


def forget(redis_url: str, owner: str) -> bool:
    """Remove ``owner`` from the view (a forwarder removed for good); False if it was not listed.

    A forwarder still running reappears at its next snapshot.

    Raises:
        TransportError: Redis does not answer (or refuses this URL).
    """
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415 - redis-py only when asked

    transport = RQTransport(redis_url, socket_timeout_s=2.0)
    try:
        return transport.forget_stats(owner)
    finally:
        transport.close()


def fleet_or_error(redis_url: str) -> dict[str, Any]:
    """:func:`fleet`, or ``{"error": ...}`` when Redis does not answer (the dashboard's overview)."""
    try:
        return fleet(redis_url)
    except TransportError as exc:
        return {"redis": {"url": redact_url(redis_url)}, "error": str(exc), "forwarders": []}
