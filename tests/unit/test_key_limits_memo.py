"""Per-key limits: the memo of each key's policy (``Limits.of``) and a delivery's policy text.

The forwarder asks a key's policy once per delivery; the memo must neither slow a key never
seen for long (a key per job) nor hold more than its bound (docs/benchmarks.md, "One call
fewer per claim").
"""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Mapping

import pytest
from hybridq.forwarder.keylimits import KeyLimits
from hybridq.protocol import keylimits
from hybridq.protocol.keylimits import Limit, parse_limits
from hybridq.transport.base import KeyUse


@pytest.fixture
def small_bound(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(keylimits, "_OF_MAX", 8)
    return 8


def test_the_memo_is_emptied_at_its_bound_and_keeps_new_keys(small_bound: int) -> None:
    limits = parse_limits(["k:*=concurrency:2"])
    for i in range(small_bound):
        assert limits.of(f"k:{i}") == Limit(2, 0, 0)
    assert len(limits._of) == small_bound
    assert limits.of("k:new") == Limit(2, 0, 0)  # past the bound: emptied, then remembered
    assert limits._of == {"k:new": Limit(2, 0, 0)}
    for i in range(3 * small_bound):
        assert len(limits._of) <= small_bound
        assert limits.of(f"other:{i}") is None
        assert limits.of(f"k:x{i}") == Limit(2, 0, 0)


def test_a_key_past_the_bound_is_answered_right(small_bound: int) -> None:
    limits = parse_limits(["vip:*=concurrency:9", "k:*=rate:3/s"])
    keys = [f"{p}:{i}" for i in range(5 * small_bound) for p in ("vip", "k", "none")]
    want = {"vip": Limit(9, 0, 0), "k": Limit(0, 3, 1000), "none": None}
    for _ in range(2):  # once as new keys, once as keys the emptied memo may or may not hold
        for key in keys:
            assert limits.of(key) == want[key.partition(":")[0]]


def test_without_rules_nothing_is_remembered() -> None:
    limits = parse_limits(None)
    for i in range(100):
        assert limits.of(f"tenant:{i}") is None
    assert limits._of == {}


def test_a_key_limited_as_none_is_remembered_as_none() -> None:
    limits = parse_limits(["k:*=concurrency:1"])
    assert limits.of("other") is None
    assert limits._of == {"other": None}
    assert limits.of("other") is None


def test_the_wire_text_is_the_policy_and_the_key() -> None:
    for limit in (Limit(3, 7, 1000), Limit(1), Limit(0, 5, 60_000), parse_limits(["a=rate:2/h"]).rules[0][1]):
        for key in ("tenant:1", "", "ключ", "a,b"):
            assert limit.wire(key) == f"{limit.concurrency},{limit.rate},{limit.period_ms},{key}"


@pytest.mark.parametrize("rules", [["k:*=concurrency:2", "v=rate:1/s"], []])
def test_a_pickled_or_copied_limits_carries_no_memo(rules: list[str]) -> None:
    limits = parse_limits(rules)
    for i in range(1000):
        limits.of(f"k:{i}")
    small = len(pickle.dumps(parse_limits(rules)))
    for copied in (pickle.loads(pickle.dumps(limits)), copy.copy(limits), copy.deepcopy(limits)):
        assert copied == limits
        assert hash(copied) == hash(limits)
        assert copied._of == {}
        assert copied.of("k:1") == limits.of("k:1")
        assert copied.of("v") == limits.of("v")
    assert len(pickle.dumps(limits)) == small


def test_the_memo_is_not_compared_hashed_or_shown() -> None:
    used, fresh = parse_limits(["k:*=concurrency:2"]), parse_limits(["k:*=concurrency:2"])
    used.of("k:1")
    used.of("other")
    assert used == fresh
    assert hash(used) == hash(fresh)
    assert repr(used) == repr(fresh) == "Limits(rules=(('k:*', Limit(concurrency=2, rate=0, period_ms=0)),))"
    assert Limit(2) == Limit(2, 0, 0)
    assert hash(Limit(2)) == hash(Limit(2, 0, 0))
    assert repr(Limit(2)) == "Limit(concurrency=2, rate=0, period_ms=0)"


class _Counting:
    """A transport that holds nothing (room everywhere) and counts the keys it is asked."""

    counts_limited_pushes = True

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def key_use(
        self, periods: Mapping[str, int], added: Mapping[str, int], *, lease_s: float
    ) -> dict[str, KeyUse]:
        self.asked.append(sorted(periods))
        return {k: KeyUse(0, 0, 0, 0.0) for k in periods}


def test_room_asks_the_policy_only_of_a_key_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = parse_limits(["k:*=concurrency:2"])
    transport = _Counting()
    gate = KeyLimits(limits, transport, lease_s=2.0)  # type: ignore[arg-type]
    asked: list[str] = []
    of = limits.of

    def counted(key: str | None) -> Limit | None:
        asked.append(str(key))
        return of(key)

    monkeypatch.setattr(gate, "_policy", counted)
    assert gate.room("free") == sys.maxsize, "a key no pattern matches is not limited"
    assert gate.room("k:1") == 0, "a limited key never read has no room until it is read"
    assert asked == ["free", "k:1"]
    gate.look()
    assert transport.asked == [["k:1"]], "only the limited key is read"
    asked.clear()
    assert gate.room("k:1") == 2
    gate.pushed("k:1", 1)
    assert gate.room("k:1") == 1
    assert asked == [], "a key with a room is limited: its policy is not looked up again"
    state = gate.states()[0]
    assert (state.key, state.policy, state.room, state.blocked_since) == ("k:1", "concurrency:2", 2, None)
