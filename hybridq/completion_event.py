"""A completion event, as a worker writes it to the forwarder's stream, parsed into a ledger entry.

Anyone who can write to Redis can add an event, so every field is checked for type and range
before it reaches the ledger: a number that does not fit (``10**400``, ``Infinity``) or a field of
the wrong type raises here, and the forwarder drops and counts the event instead of stopping on
it (see ``Harvester._entry``).

This module must not import redis or rq.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridq.ledger import Entry
from hybridq.limits import finite, is_int, opt_finite, opt_str, typed
from hybridq.transport.base import Loc

__all__ = ["parse_event"]

#: The largest segment index, offset or attempt number an event may name (a C ``long``).
_MAX_INT = 2**63 - 1


def parse_event(event_id: str, body: Mapping[str, Any] | None, clock: Callable[[], float]) -> Entry:
    """The ledger entry an event stands for (``done`` or ``retry``).

    Raises:
        ValueError, TypeError, KeyError: the event is garbled (not JSON, a field missing, of the
            wrong type or out of range).
    """
    if body is None:
        raise ValueError("not JSON")
    writer, segment, offset = typed("loc", body["loc"], list)
    loc: Loc = (
        typed("loc writer", writer, str),
        _count("loc segment", segment),
        _count("loc offset", offset),
    )
    outcome, final = str(body["outcome"]), bool(body.get("final", True))
    retry_delay = opt_finite("retry_delay", body.get("retry_delay"))
    at = opt_finite("at", body.get("at"))
    terminal = outcome == "succeeded" or final
    return Entry(
        "done" if terminal else "retry",
        typed("id", body["id"], str),
        loc,
        outcome=outcome if terminal else None,
        attempt=_count("attempt", body.get("attempt", 1)),
        dup=bool(body.get("dup", False)),
        error=opt_str("error", body.get("error")),
        run_at=None if terminal else clock() + finite("retry_delay", retry_delay or 0.0),
        at=clock() if at is None else at,
        queue=opt_str("queue", body.get("queue")),
        event_id=event_id,
    )


def _count(name: str, value: object) -> int:
    if not is_int(value) or not 0 <= value <= _MAX_INT:  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer from 0 to 2**63-1, not {value!r:.60}")
    return value  # type: ignore[return-value]
