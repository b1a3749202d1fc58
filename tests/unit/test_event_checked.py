"""``CompletionEvent.checked`` with its checks' usual cases tested in place accepts and refuses
exactly what main's version, kept here as the reference, did: the same fields, the same error
(type and message) naming the same first bad field (docs/benchmarks.md, "The forwarder's
decoding per job")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridq.envelope.limits import opt_finite, opt_str, typed
from hybridq.protocol.events import _SUCCEEDED, CompletionEvent, _count, _worker
from hypothesis import given, settings
from hypothesis import strategies as st


def reference(body: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """Main's ``CompletionEvent.checked`` (every check called)."""
    if body is None:
        raise ValueError("not JSON")
    writer, segment, offset = typed("loc", body["loc"], list)
    loc = (
        typed("loc writer", writer, str),
        _count("loc segment", segment),
        _count("loc offset", offset),
    )
    # In the order the forwarder always checked them: the first bad field is the one named.
    outcome, final = str(body["outcome"]), bool(body.get("final", True))
    retry_delay = opt_finite("retry_delay", body.get("retry_delay"))
    at = opt_finite("at", body.get("at"))
    job_id = typed("id", body["id"], str)
    attempt = _count("attempt", body.get("attempt", 1))
    dup = bool(body.get("dup", False))
    error = opt_str("error", body.get("error"))
    queue = opt_str("queue", body.get("queue"))
    later = _count("later", body.get("later", 0))
    later_since = opt_finite("later_since", body.get("later_since"))
    result_kept = "result" in body and outcome == _SUCCEEDED
    result_bytes = _count("result_bytes", body["result_bytes"]) if "result_bytes" in body else None
    started = opt_finite("started", body.get("started"))
    worker = _worker(body.get("worker"))
    gen = _count("gen", body.get("gen", 0))
    return (
        job_id,
        loc,
        queue,
        outcome,
        final,
        retry_delay,
        attempt,
        dup,
        error,
        at,
        later,
        later_since,
        body.get("result"),
        result_kept,
        result_bytes,
        started,
        worker,
        gen,
    )


_NAMES = ["id", "loc", "queue", "outcome", "final", "retry_delay", "attempt", "dup", "error", "at"]
_NAMES += ["later", "later_since", "result", "result_bytes", "started", "worker", "gen"]
_values = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([2**63 - 1, 2**63, -(2**63), 10**400])
    | st.floats()
    | st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -0.0, 1.5])
    | st.text(max_size=3)
    | st.sampled_from(["succeeded", "failed", "x" * 300])
    | st.lists(st.integers(0, 2) | st.text(max_size=2), max_size=3)
)
_locs = st.tuples(st.text(max_size=2) | st.integers(0, 2), _values, _values).map(list) | _values


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any] | None:
    """An event body as the harvest takes it: the usual fields, each maybe absent or of any type."""
    if draw(st.integers(0, 50)) == 0:
        return None
    body: dict[str, Any] = {"id": "j", "loc": ["w", 1, 2], "outcome": "succeeded", "at": 1.5, "worker": "h/1"}
    for name in draw(st.lists(st.sampled_from(_NAMES), max_size=6)):
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(_locs) if name == "loc" else draw(_values)
    return body


def _outcome(check: Any, body: Mapping[str, Any] | None) -> tuple[str, str]:
    try:
        return "ok", repr(check(body))  # repr: NaN equals itself, 1 and 1.0 and True differ
    except Exception as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=3000, deadline=None)
@given(_bodies())
def test_checked_as_main(body: dict[str, Any] | None) -> None:
    assert _outcome(CompletionEvent.checked, body) == _outcome(reference, body)


def test_usual_event_as_main() -> None:
    body = {
        "id": "j",
        "loc": ["w", 3, 7],
        "queue": "q",
        "outcome": "failed",
        "final": False,
        "retry_delay": 2,
    }
    body |= {"attempt": 2, "dup": False, "error": "e", "at": 1.5, "started": 1.25, "worker": "h/1", "gen": 3}
    assert CompletionEvent.checked(body) == reference(body)
    assert type(CompletionEvent.checked(body)[5]) is float  # an int retry_delay made a float, as before


_TRICKY = [None, True, False, -1, 0, 7, 2**63 - 1, 2**63, 10**400, -0.0, 2.5, math.inf, -math.inf, math.nan]
_TRICKY += ["", "s", "x" * 300, [], ["w", 1, 2], {}]


def test_each_field_each_tricky_value_as_main() -> None:
    """Every field, and each part of ``loc``, set to each value a check decides on."""
    usual = {"id": "j", "loc": ["w", 1, 2], "outcome": "succeeded", "at": 1.5, "worker": "h/1"}
    bodies = [{**usual, name: value} for name in _NAMES for value in _TRICKY]
    bodies += [
        {**usual, "loc": [v if j == i else part for j, part in enumerate(["w", 1, 2])]}
        for i in range(3)
        for v in _TRICKY
    ]
    for body in bodies:
        assert _outcome(CompletionEvent.checked, body) == _outcome(reference, body), body
