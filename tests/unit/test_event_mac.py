"""Completion-event MACs (issue 13.5), without Redis: what they bind, and that checking never raises."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hybridq.security.signing import ENV_KEY, ENV_KEY_FILE, EVENT_MAC, Keyring, admit_event
from hypothesis import given, settings
from hypothesis import strategies as st

KEY = "m" * 64
RING = Keyring((KEY.encode(),))
EVENT: dict[str, Any] = {
    "id": "0" * 32,
    "loc": ["w", 0, 64],
    "queue": "default",
    "outcome": "succeeded",
    "final": True,
    "retry_delay": None,
    "attempt": 1,
    "dup": False,
    "error": None,
    "at": 1764612345.123456,
}
FORWARDED = {"w": (0, 1000, 7)}


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setenv(ENV_KEY, KEY)


def test_a_signed_event_survives_the_json_round_trip_and_nothing_else() -> None:
    signed = json.loads(json.dumps(RING.sign_event("owner1", EVENT)))
    assert admit_event("owner1", "1-0", signed, FORWARDED)
    for field, value in [("outcome", "failed"), ("id", "1" * 32), ("loc", ["w", 0, 65]), ("attempt", 2)]:
        assert not admit_event("owner1", "1-0", {**signed, field: value}, FORWARDED), field
    assert not admit_event("owner2", "1-0", signed, FORWARDED)  # another forwarder's stream
    assert not admit_event("owner1", "1-0", EVENT, FORWARDED)  # no MAC
    assert not RING.verify_event("owner1", {**signed, EVENT_MAC: signed[EVENT_MAC].upper()})


def test_a_key_rotation_keeps_events_of_the_old_key_verifying() -> None:
    old = Keyring((b"o" * 64,)).sign_event("owner1", EVENT)
    assert Keyring((KEY.encode(), b"o" * 64)).verify_event("owner1", old)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    body=st.dictionaries(
        st.sampled_from([*EVENT, EVENT_MAC, "x"]),
        _json | st.just(["w", 0, 5]) | st.just("succeeded"),
        max_size=8,
    ),
    keyed=st.booleans(),
)
def test_checking_any_event_never_raises(body: dict[str, Any], keyed: bool) -> None:
    import os

    if not keyed:
        os.environ.pop(ENV_KEY, None)
    try:
        assert isinstance(admit_event("owner1", "1-0", body, FORWARDED), bool)
    finally:
        os.environ[ENV_KEY] = KEY
