"""A ledger entry's bytes: an outcome's entry written out is what the encoder writes (Entry.to_bytes)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from hybridq.ledger.entries import Entry, _encode, parse_event
from hybridq.protocol import EntryKind, Outcome
from hypothesis import given, settings
from hypothesis import strategies as st


def encoded(entry: Entry) -> bytes:
    """What every entry was written as before: its JSON object through the encoder."""
    return _encode(entry._body()).encode()


EVENT: dict[str, Any] = {
    "id": "01a25286ba8eb4b8257a6ac993838dec",
    "loc": ["f1c592cfa29ec509", 0, 64],
    "queue": "fc",
    "outcome": "succeeded",
    "final": True,
    "retry_delay": None,
    "attempt": 1,
    "dup": False,
    "error": None,
    "at": 1796680891.099739,
    "result": None,
    "started": 1796680891.0996397,
    "worker": "vm/17245",
}


def test_the_entries_a_harvest_makes_are_written_out_as_the_encoder_writes_them() -> None:
    events = [
        EVENT,
        {**EVENT, "result": {"a": [1, 2.5, "caf\u00e9"]}, "dup": True, "gen": 3},
        {**EVENT, "outcome": "failed", "final": False, "retry_delay": 2.5, "error": "boom \udcff\n"},
        {**EVENT, "outcome": "failed", "final": True, "error": "x" * 300, "worker": None, "started": None},
        {**EVENT, "result_bytes": 10**9, "queue": None, "at": 5},
        {**EVENT, "outcome": "succeeded", "later": 2, "later_since": 1.5},  # lt/ls: the encoder's
    ]
    for i, event in enumerate(events):
        entry = parse_event(f"1765144800123-{i}", json.loads(json.dumps(event)), time.time)
        assert entry.to_bytes() == encoded(entry), event
    assert parse_event("1-0", EVENT, time.time)._outcome_text() is not None


def test_entries_of_other_kinds_and_types_take_the_encoder() -> None:
    base = parse_event("1-0", EVENT, time.time)
    others = [
        dataclasses.replace(base, job={"v": 1}),
        dataclasses.replace(base, kind=EntryKind.KEY, key="k" * 64, outcome=None),
        dataclasses.replace(base, kind=EntryKind.DUPLICATE, dup_of="a", owner_loc=("w", 0, 64)),
        dataclasses.replace(base, until=5.0),
        dataclasses.replace(base, over="failed"),
        dataclasses.replace(base, under="succeeded"),
        dataclasses.replace(base, at=float("nan")),
        dataclasses.replace(base, started=float("inf")),
        dataclasses.replace(base, run_at=float("-inf")),
        dataclasses.replace(base, at=3),
        dataclasses.replace(base, attempt=True),
        dataclasses.replace(base, gen=False),
        dataclasses.replace(base, result_bytes=True),
        dataclasses.replace(base, loc=("w", 1.0, 64)),
    ]
    for entry in others:
        assert entry._outcome_text() is None, entry
        assert entry.to_bytes() == encoded(entry)


_text = st.text(max_size=12)
_number = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70)


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(["done", "retry", EntryKind.DONE, EntryKind.RETRY]),
    outcome=st.none() | st.sampled_from([Outcome.SUCCEEDED, "failed", "caf\u00e9"]),
    attempt=st.integers(0, 2**64),
    error=st.none() | _text,
    run_at=st.none() | _number,
    at=_number,
    queue=st.none() | _text,
    event_id=st.none() | _text,
    dup=st.booleans(),
    result=st.none() | st.integers() | _text | st.lists(st.integers(), max_size=3),
    result_kept=st.booleans(),
    result_bytes=st.none() | st.integers(0, 2**40),
    started=st.none() | _number,
    worker=st.none() | _text,
    gen=st.integers(0, 2**63),
    loc=st.tuples(_text, st.integers(0, 2**40), st.integers(0, 2**40)),
)
def test_any_outcome_entry_is_written_as_the_encoder_writes_it(**fields: Any) -> None:
    entry = Entry(job_id="01a2", **fields)
    assert entry.to_bytes() == encoded(entry)
