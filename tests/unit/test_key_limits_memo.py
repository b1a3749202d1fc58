"""Per-key limits: how ``Limits.of`` finds a key's policy (its rules' tests, its memo), a policy's texts.

The forwarder asks a key's policy once per delivery; the memo must neither slow a key never
seen for long (a key per job) nor hold more than its bound (docs/benchmarks.md, "One call
fewer per claim"). Each rule's test, made once (a ``PREFIX*`` rule a ``startswith``), must
match as ``fnmatchcase`` does, the first rule that matches winning (docs/forwarder.md, "Limits
per key"; docs/benchmarks.md, "The limits' Python per job").
"""

from __future__ import annotations

import copy
import fnmatch
import pickle
import sys
from collections.abc import Mapping

import pytest
from hybridq.forwarder.keylimits import KeyLimits
from hybridq.protocol import keylimits
from hybridq.protocol.keylimits import Limit, Limits, parse_limit, parse_limits
from hybridq.transport import rq_limits
from hybridq.transport.base import KeyUse
from hypothesis import given, settings
from hypothesis import strategies as st


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


# -- the rules' tests against fnmatchcase ---------------------------------------------------

#: Pattern, key, whether the pattern matches: ``[..]*``, ``?..*`` and ``*..*`` are not prefixes
#: (matched as a prefix, ``tenant:[12]*`` would limit no ``tenant:1`` key); a backslash is no
#: escape in fnmatch; case counts.
MATCHES = [
    ("tenant:[12]*", "tenant:1x", True),
    ("tenant:[12]*", "tenant:2", True),
    ("tenant:[12]*", "tenant:3", False),
    ("tenant:[12]*", "tenant:[12]x", False),
    ("[!a]*", "b:1", True),
    ("[!a]*", "a:1", False),
    ("[!a]*", "[!a]", True),
    ("[]]*", "]x", True),
    ("[]]*", "[]]x", False),
    ("[*", "[x", True),  # an unclosed bracket is a literal [
    ("t?n:*", "tan:1", True),
    ("t?n:*", "t?n:1", True),
    ("t?n:*", "tn:1", False),
    ("a*b*", "axxb", True),
    ("a*b*", "ab", True),
    ("a*b*", "a*b", True),
    ("a*b*", "ax", False),
    ("*:x", "q:x", True),
    ("*:x", "q:xy", False),
    ("a**", "a", True),
    ("exact", "exact", True),
    ("exact", "exactly", False),
    ("exact", "Exact", False),
    ("A*", "a", False),
    ("a]*", "a]b", True),
    ("a\\*", "a\\x", True),
    ("a\\*", "a*", False),
    ("a\\?*", "a\\?", True),
    ("a\\?*", "ax", False),
    ("*", "anything", True),
]


def _copies(limits: Limits) -> list[Limits]:
    """``limits`` and its pickled and copied selves (each makes its rules' tests again)."""
    return [limits, pickle.loads(pickle.dumps(limits)), copy.deepcopy(limits), copy.copy(limits)]


@pytest.mark.parametrize(("pattern", "key", "matches"), MATCHES)
def test_a_rule_matches_a_key_as_fnmatchcase_does(pattern: str, key: str, matches: bool) -> None:
    assert fnmatch.fnmatchcase(key, pattern) is matches  # (the table itself)
    for limits in _copies(Limits(((pattern, Limit(1)),))):
        for _ in range(2):  # new, then from the memo
            assert (limits.of(key) is not None) is matches, (pattern, key)


@pytest.mark.parametrize(
    ("rules", "key", "winner"),
    [
        (["tenant:[12]*", "tenant:*"], "tenant:1", 0),
        (["tenant:[12]*", "tenant:*"], "tenant:3", 1),
        (["t?n:*", "tan:*"], "tan:1", 0),
        (["tan:*", "t?n:*"], "tan:1", 0),
        (["a*b*", "a*"], "ab", 0),
        (["exact", "ex*"], "exact", 0),
        (["ex*", "exact"], "exact", 0),
        (["[!a]*", "b*"], "b", 0),
        (["z*", "*"], "b", 1),
    ],
)
def test_the_first_rule_that_matches_wins_whatever_its_kind(rules: list[str], key: str, winner: int) -> None:
    given_limits = Limits(tuple((p, Limit(i + 1)) for i, p in enumerate(rules)))
    for limits in _copies(given_limits):
        assert limits.of(key) == Limit(winner + 1), (rules, key)


_ALPHABET = "ab:*?[]!-\\^A."


def _first(rules: tuple[tuple[str, Limit], ...], key: str) -> Limit | None:
    return next((limit for pattern, limit in rules if fnmatch.fnmatchcase(key, pattern)), None)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text(_ALPHABET, min_size=1, max_size=8), min_size=1, max_size=4, unique=True),
    st.lists(st.text(_ALPHABET + "B", min_size=1, max_size=10), min_size=1, max_size=6),
)
def test_of_is_the_first_rule_fnmatchcase_matches(patterns: list[str], keys: list[str]) -> None:
    rules = tuple((p, Limit(i + 1)) for i, p in enumerate(patterns))
    for limits in _copies(Limits(rules)):
        for key in keys + keys:  # new, then from the memo
            assert limits.of(key) == _first(rules, key), (patterns, key)


# -- the gate takes each key's own policy ---------------------------------------------------


class _Extra(_Counting):
    """Answers the keys asked and also ``extra``, never asked (a transport may read more)."""

    def __init__(self, extra: dict[str, KeyUse]) -> None:
        super().__init__()
        self.extra = extra

    def key_use(
        self, periods: Mapping[str, int], added: Mapping[str, int], *, lease_s: float
    ) -> dict[str, KeyUse]:
        return {**super().key_use(periods, added, lease_s=lease_s), **self.extra}


@pytest.mark.parametrize("how", ["look", "prefetch"])
def test_a_key_answered_unasked_takes_its_own_policy(how: str) -> None:
    limits = parse_limits(["vip:*=concurrency:5", "k:*=concurrency:3,rate:4/s", "held:*=concurrency:1"])
    extra = {"k:2": KeyUse(1, 0, 0, 0.0), "held:1": KeyUse(1, 0, 0, 0.0), "free": KeyUse(7, 0, 0, 0.0)}
    transport = _Extra(extra)
    gate = KeyLimits(limits, transport, lease_s=2.0)  # type: ignore[arg-type]
    if how == "look":
        assert gate.room("vip:1") == 0
        gate.look()
    else:
        gate.prefetch(["vip:1"])
    assert transport.asked == [["vip:1"]]
    assert gate.room("vip:1") == 5
    assert gate.room("k:2") == 2, "its own concurrency:3 less its one running (not unlimited)"
    assert gate.room("held:1") == 0, "its own concurrency:1 is held"
    assert gate.room("free") == sys.maxsize, "a key no pattern matches is not limited"
    states = {s.key: (s.policy, s.room, s.blocked_since is None) for s in gate.states()}
    assert states["k:2"] == ("concurrency:3,rate:4/s", 2, True)
    assert states["held:1"] == ("concurrency:1", 0, False)
    assert states["free"][0] == ""
    assert transport.asked == [["vip:1"]], "no read more: the answers unasked were taken"


# -- the named tuples made by tuple.__new__ -------------------------------------------------


def test_the_limits_read_makes_each_key_use_in_its_fields_order() -> None:
    assert KeyUse._fields == ("running", "queued", "started", "quarantine_s")

    def script(keys: list[str], args: list[object]) -> list[int]:
        return [1, 2, 3, 4000, 5, 6, 7, 0]

    uses = rq_limits.key_use(script, 2.0, {"a": 1000, "b": 0}, {})
    assert uses == {"a": KeyUse(1, 2, 3, 4.0), "b": KeyUse(5, 6, 7, 0.0)}
    a = uses["a"]
    assert (a.running, a.queued, a.started, a.quarantine_s) == (1, 2, 3, 4.0)
    assert type(a) is KeyUse


# -- a policy's text, as --limit reads it back ---------------------------------------------


@pytest.mark.parametrize(
    "spec",
    ["concurrency:2", "rate:10/s", "rate:5/m", "rate:1/h", "concurrency:3,rate:7/s", "concurrency:999999999"],
)
def test_a_policys_text_is_read_back_by_limit(spec: str) -> None:
    limit = parse_limit(spec)
    assert limit.text() == spec
    assert parse_limit(limit.text()) == limit


@pytest.mark.parametrize("period_ms", [0, 1, 1234, 86_400_000])
def test_a_rate_over_a_period_limit_cannot_write_is_refused_in_one_line(period_ms: int) -> None:
    with pytest.raises(ValueError, match=r"bad limit period .* 1000, 60000 or 3600000") as info:
        Limit(2, 5, period_ms)
    assert "\n" not in str(info.value)
    assert Limit(2, 0, 1234).text() == "concurrency:2", "without a rate the period is not read"
