"""A completion event's fields and JSON object, made without the event (part of :mod:`hybridq.protocol`).

:class:`~hybridq.protocol.events.CompletionEvent` makes itself and its JSON with these; a pool
worker, which needs only the JSON of each run's event, makes it from the fields directly
(``CompletionEvent.json_of``): the frozen event cost about 2 us a job (docs/benchmarks.md,
"The pool's Python per job"). One shape for both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hybridq.protocol.delivery import Delivery, Loc
from hybridq.protocol.enums import Outcome

__all__ = ["EVENT_ERROR_CHARS", "RESULT_MAX_BYTES", "body", "fields_of"]

#: The longest error text an event carries (the last line of the stored traceback).
EVENT_ERROR_CHARS = 500
#: The largest result (its JSON, in bytes) a completion event carries, and so the ledger keeps:
#: a larger one is left out, and the event says its size instead (docs/api.md, "Looking a job up").
RESULT_MAX_BYTES = 64 * 1024

#: Enum members read on every job as module constants: on Python 3.11 a read from the class
#: goes through ``EnumType``'s ``__getattr__`` hook, about 900 instructions (docs/benchmarks.md,
#: "The forwarder's writes per job, again").
_LATER, _SUCCEEDED = Outcome.LATER, Outcome.SUCCEEDED


def fields_of(
    delivery: Delivery,
    outcome: Mapping[str, Any],
    dup: bool,
    at: float,
    result_json: str | None,
    started: float | None,
    worker: str | None,
) -> tuple[Any, ...]:
    """:meth:`~hybridq.protocol.events.CompletionEvent.of`'s fields, in the class's order (see there)."""
    env = delivery.envelope
    get = outcome.get
    final = bool(get("final", True))
    attempt = int(get("attempt", delivery.attempt))
    error = get("error")
    later = int(get("later", delivery.later))
    if get("outcome") == _LATER:
        retry_delay = get("retry_delay")
    else:  # the policy's delay after the job's attempt (runs that said RetryLater are not one)
        retry_delay = None if final or env.retry is None else env.retry.delay_s(attempt - delivery.later)
    result, kept, size = _carried(outcome, result_json)
    return (
        env.id,
        delivery.loc,
        env.queue,
        get("outcome"),
        final,
        retry_delay,
        attempt,
        dup,
        error.strip().rsplit("\n", 1)[-1][:EVENT_ERROR_CHARS] if isinstance(error, str) else None,
        at,
        later,
        get("later_since", delivery.later_since) if later else None,
        result,
        kept,
        size,
        started,
        worker,
        delivery.gen,
    )


def body(
    job_id: str,
    loc: Loc,
    queue: str | None,
    outcome: str | None,
    final: bool,
    retry_delay: float | None,
    attempt: int,
    dup: bool,
    error: str | None,
    at: float | None,
    later: int,
    later_since: float | None,
    result: Any,
    result_kept: bool,
    result_bytes: int | None,
    started: float | None,
    worker: str | None,
    gen: int,
) -> dict[str, Any]:
    """An event's JSON object from its fields (:meth:`~hybridq.protocol.events.CompletionEvent.to_json`)."""
    body = {
        "id": job_id,
        "loc": list(loc),
        "queue": queue,
        "outcome": outcome,
        "final": final,
        "retry_delay": retry_delay,
        "attempt": attempt,
        "dup": dup,
        "error": error,
        "at": at,
    }
    if later:
        body["later"] = later
        body["later_since"] = later_since
    if result_kept:
        body["result"] = result
    if result_bytes is not None:
        body["result_bytes"] = result_bytes
    if started is not None:
        body["started"] = started
    if worker is not None:
        body["worker"] = worker
    if gen:
        body["gen"] = gen
    return body


def _carried(outcome: Mapping[str, Any], result_json: str | None) -> tuple[Any, bool, int | None]:
    """The result fields of an event reporting ``outcome`` (result, result_kept, result_bytes).

    The result if it is small enough, else its size.
    """
    if outcome.get("outcome") != _SUCCEEDED or "result" not in outcome:
        return None, False, None
    value = outcome["result"]
    if result_json is None:
        try:
            result_json = json.dumps(value)
        except (TypeError, ValueError):
            return None, False, None
    size = len(result_json.encode()) if not result_json.isascii() else len(result_json)
    if size > RESULT_MAX_BYTES:
        return None, False, size
    return value, True, None
