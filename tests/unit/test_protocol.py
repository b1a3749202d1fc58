"""The wire contract (hybridq.protocol, issue 14.1): every message round-trips, and the JSON is what it was."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hybridq import protocol
from hybridq.envelope.model import Envelope, Retry, new_job_id
from hybridq.ledger.entries import Entry, parse_event
from hybridq.protocol import (
    ClaimStatus,
    CompletionEvent,
    Delivery,
    EntryKind,
    FinishReply,
    Outcome,
    Overwrite,
    StoredOutcome,
    Verdict,
)
from hybridq.security.signing import Keyring
from hybridq.transport import base
from hypothesis import given
from hypothesis import strategies as st


def envelope(**overrides: Any) -> Envelope:
    fields: dict[str, Any] = {
        "id": new_job_id(),
        "func": "tests.tasks.add",
        "queue": "default",
        "idempotency_key": "key",
        "created_at": 1.5,
        "args": (1, 2),
        "retry": Retry(max_attempts=3, backoff_s=2.0, jitter=False),
    }
    fields.update(overrides)
    return Envelope(**fields)


def wire(message: dict[str, Any]) -> dict[str, Any]:
    """What the other process reads: the JSON encoding, decoded."""
    decoded: dict[str, Any] = json.loads(json.dumps(message))
    return decoded


@given(
    attempt=st.integers(1, 2**31),
    lease_s=st.floats(0.01, 1e6),
    key_ttl_s=st.floats(1.0, 1e9),
    gen=st.integers(0, 2**62),
    offset=st.integers(0, 2**62),
)
def test_a_delivery_round_trips(
    attempt: int, lease_s: float, key_ttl_s: float, gen: int, offset: int
) -> None:
    d = Delivery(
        envelope(), "owner1", ("w", 3, offset), attempt, lease_s=lease_s, key_ttl_s=key_ttl_s, gen=gen
    )
    assert Delivery.from_json(wire(d.to_json())) == d


def test_the_delivery_json_is_unchanged() -> None:
    env = envelope()
    d = Delivery(env, "owner1", ("w", 0, 64), 2, overwrite=Overwrite.ALWAYS, gen=7)
    assert d.to_json() == {
        "v": 1,
        "job": env.to_dict(),
        "owner": "owner1",
        "loc": ["w", 0, 64],
        "attempt": 2,
        "lease": 10.0,
        "key_ttl": 86400.0,
        "gen": 7,
    }
    # An older forwarder's delivery (no lease, key_ttl, gen) reads with the defaults.
    old = Delivery.from_json({"v": 1, "job": env.to_dict(), "owner": "o", "loc": ["w", 0, 64]})
    assert (old.attempt, old.lease_s, old.key_ttl_s, old.gen) == (1, 10.0, 86400.0, 0)


def test_overwrite_is_one_value_and_the_older_spellings_still_build_it() -> None:
    env = envelope()
    assert Delivery(env, "o", ("w", 0, 64)).overwrite is Overwrite.NEVER
    assert Delivery(env, "o", ("w", 0, 64), force=True).overwrite is Overwrite.EARLIER
    assert Delivery(env, "o", ("w", 0, 64), replace=True).overwrite is Overwrite.ALWAYS
    assert Delivery(env, "o", ("w", 0, 64), force=True, replace=True).overwrite is Overwrite.ALWAYS
    # The values are what the RQ push script reads.
    assert [m.value for m in Overwrite] == ["0", "1", "2"]
    assert base.Delivery is Delivery  # re-exported where the transport port named it


@pytest.mark.parametrize("outcome", list(Outcome)[:2])
@pytest.mark.parametrize("token", [None, "job/1/host/42/abcd"])
def test_a_stored_outcome_round_trips(outcome: Outcome, token: str | None) -> None:
    stored = StoredOutcome(
        outcome=outcome,
        result={"x": [1]},
        error="Traceback\nValueError: x",
        job_id=new_job_id(),
        attempt=2,
        requeue=1,
        final=True,
        at=1.25,
        token=token,
    )
    body = wire(stored.to_json())
    assert list(body) == [
        "outcome", "result", "error", "job_id", "attempt", "requeue", "final", "at", *(["token"] if token else [])
    ]  # fmt: skip
    assert StoredOutcome.from_json(body) == stored
    # What the pool sends without making the outcome: the same JSON, key order included.
    made = StoredOutcome.json_of(
        outcome, {"x": [1]}, "Traceback\nValueError: x", stored.job_id, 2, 1, final=True, at=1.25, token=token
    )
    assert list(made.items()) == list(stored.to_json().items())


def test_a_later_outcomes_json_needs_the_outcome() -> None:
    with pytest.raises(ValueError, match="later"):
        StoredOutcome.json_of(Outcome.LATER, None, None, new_job_id(), 1, 0, final=False, at=1.0)


@pytest.mark.parametrize(
    ("outcome", "final", "dup"),
    [("succeeded", True, False), ("failed", False, False), ("failed", True, True), ("succeeded", True, True)],
)
def test_a_completion_event_round_trips(outcome: str, final: bool, dup: bool) -> None:
    env = envelope()
    d = Delivery(env, "owner1", ("w", 4, 128), 2)
    stored = {
        "outcome": outcome,
        "final": final,
        "attempt": 2,
        "error": "Traceback\n  ...\nValueError: boom\n",
    }
    event = CompletionEvent.of(d, stored, dup=dup, at=1764612345.5)
    body = wire(event.to_json())
    assert body == {
        "id": env.id,
        "loc": ["w", 4, 128],
        "queue": "default",
        "outcome": outcome,
        "final": final,
        "retry_delay": None if final else 4.0,
        "attempt": 2,
        "dup": dup,
        "error": "ValueError: boom",
        "at": 1764612345.5,
    }
    assert CompletionEvent.from_json(body) == event
    # The forwarder's ledger entry of it.
    entry = parse_event("1-0", body, lambda: 100.0)
    assert entry.kind == (EntryKind.DONE if final else EntryKind.RETRY)
    assert entry.run_at == (None if final else 104.0)
    assert Entry.from_bytes(entry.to_bytes()) == entry


def test_the_kept_success_event_is_what_the_outcome_script_makes() -> None:
    d = Delivery(envelope(), "owner1", ("w", 0, 64), 1)
    event = CompletionEvent.of(
        d, {"outcome": "failed", "final": False, "attempt": 1, "error": "E"}, dup=False, at=2.0
    )
    kept = event.kept_success_json()
    assert "error" not in kept
    assert "retry_delay" not in kept
    assert (kept["outcome"], kept["final"]) == ("succeeded", True)
    ring = Keyring((b"k" * 64,))
    assert ring.verify_event("owner1", wire(ring.sign_event("owner1", kept)))
    assert CompletionEvent.from_json(kept).terminal


@pytest.mark.parametrize(
    "body",
    [
        None,
        {"id": "x", "loc": ["w", 0, 10**400], "outcome": "succeeded"},
        {"id": "x", "loc": ["w", 0, 1], "outcome": "failed", "final": False, "retry_delay": float("inf")},
        {"id": 1, "loc": ["w", 0, 1], "outcome": "succeeded"},
        {"loc": ["w", 0, 1], "outcome": "succeeded"},
        {"id": "x", "loc": ["w", 0, 1], "outcome": "succeeded", "attempt": True},
    ],
)
def test_a_garbled_event_raises(body: dict[str, Any] | None) -> None:
    with pytest.raises((ValueError, TypeError, KeyError)):
        CompletionEvent.from_json(body)


def test_the_ledger_entry_of_an_event_carries_each_of_its_fields() -> None:
    """parse_event reads the checked fields by position (CompletionEvent.checked): none swapped."""
    body = {
        "id": "j1",
        "loc": ["w", 3, 99],
        "queue": "q",
        "outcome": "later",
        "final": False,
        "retry_delay": 7.5,
        "attempt": 4,
        "dup": True,
        "error": "E",
        "at": 50.0,
        "later": 2,
        "later_since": 40.0,
        "started": 49.0,
        "worker": "h/1",
        "gen": 6,
    }
    event = CompletionEvent.from_json(body)
    assert CompletionEvent(*CompletionEvent.checked(body)) == event
    retry = parse_event("9-1", body, lambda: 100.0)
    assert (retry.kind, retry.job_id, retry.loc, retry.queue, retry.attempt, retry.dup) == (
        EntryKind.RETRY,
        "j1",
        ("w", 3, 99),
        "q",
        4,
        True,
    )
    assert (retry.error, retry.run_at, retry.at, retry.later, retry.later_since) == (
        "E",
        107.5,
        50.0,
        2,
        40.0,
    )
    assert (retry.started, retry.worker, retry.gen, retry.event_id, retry.outcome) == (
        49.0,
        "h/1",
        6,
        "9-1",
        None,
    )
    done = parse_event("9-2", {**body, "outcome": "succeeded", "result": [1], "result_bytes": 3}, lambda: 0.0)
    assert (done.kind, done.outcome, done.result, done.result_kept, done.result_bytes) == (
        EntryKind.DONE,
        "succeeded",
        [1],
        True,
        3,
    )


@pytest.mark.parametrize(
    "body",
    [
        {"id": "x", "loc": ["w", 0, 1], "outcome": "succeeded", "attempt": True},
        {"id": "x", "loc": ["w", 0, 1], "outcome": "succeeded", "gen": -1},
        {"id": "x", "loc": ["w", 0, 1], "outcome": "succeeded", "worker": 5},
    ],
)
def test_a_garbled_event_is_no_ledger_entry(body: dict[str, Any]) -> None:
    with pytest.raises((ValueError, TypeError, KeyError)):
        parse_event("1-0", body, lambda: 0.0)


def test_enums_are_the_wire_values() -> None:
    assert [v.value for v in Verdict] == ["missing", "queued", "running", "done", "orphaned", "stranded"]
    assert [k.value for k in EntryKind] == ["done", "retry", "lost", "requeued", "key", "duplicate", "cancel"]
    assert json.dumps([Outcome.SUCCEEDED, EntryKind.DONE]) == '["succeeded", "done"]'
    assert [int(s) for s in ClaimStatus] == [0, 1, 2, 3, 4, 5]
    assert [int(r) for r in FinishReply] == [0, 1, 2, 3]
    assert protocol.ENTRY_POINT == "hybridq.worker.execute"
    assert (protocol.DEFAULT_LEASE_S, protocol.DEFAULT_KEY_TTL_S) == (10.0, 86400.0)
