"""The compact map of a segment's outcomes (``hybridq.ledger.outcomes``) against a plain ``dict``.

A lookup that missed a finished job would let it run again, so every operation is checked
against a ``dict`` given the same random operations: offsets in and out of order, repeated,
past ``2**32`` and outside what an array holds, outcomes ranked up in place, names with no code,
merges at and around the threshold (made small here so that each run crosses it many times),
and the saved index's groups read back. Then :class:`LedgerIndex` over it against the rank rule.
"""

from __future__ import annotations

import json
import random

import pytest
from hybridq.ledger import outcome_arrays, outcomes, saved_codec, saved_index
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import _RANK, LedgerIndex
from hybridq.ledger.outcomes import SegmentOutcomes

NAMES = ("succeeded", "failed", "cancelled", "invalid")


@pytest.fixture(params=[(4, 2), (16, 8), (1024, 64)], ids=["floor4", "floor16", "default"])
def merge_rule(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """The merge threshold's floor and fraction (small ones: many merges in a short run)."""
    floor, fraction = request.param
    monkeypatch.setattr(outcomes, "MERGE_FLOOR", floor)
    monkeypatch.setattr(outcomes, "MERGE_FRACTION", fraction)
    return floor, fraction


def an_offset(rng: random.Random, pool: list[int]) -> int:
    """Mostly a new offset near the last, sometimes one seen before or far off."""
    roll = rng.random()
    if pool and roll < 0.3:
        return rng.choice(pool)
    if roll < 0.32:
        return rng.choice([-1, -(2**40), 2**32 - 1, 2**32, 2**32 + 7, 2**64 - 1, 2**64, 2**70])
    if roll < 0.5:
        return rng.randrange(0, 4096 + 300 * len(pool) + 1)  # out of order
    offset = (pool[-1] if pool else 4096) + rng.randrange(1, 600)  # in order: the common case
    pool.append(offset)
    return offset


def a_name(rng: random.Random) -> str:
    return rng.choice(NAMES) if rng.random() < 0.97 else rng.choice(["expired", "odd"])


def check_same(done: SegmentOutcomes, model: dict[int, str], probes: list[int]) -> None:
    assert len(done) == len(model)
    for offset in probes:
        assert (offset in done) == (offset in model), offset
        assert done.get(offset) == model.get(offset), offset


def check_whole(done: SegmentOutcomes, model: dict[int, str]) -> None:
    assert done == model
    assert model == done
    assert dict(done.items()) == model
    assert sorted(done) == sorted(model)
    assert sorted(done.values()) == sorted(model.values())
    tally: dict[str, int] = {}
    for outcome in model.values():
        tally[outcome] = tally.get(outcome, 0) + 1
    assert done.tally() == tally
    for end in (0, 5000, 2**32, 2**65, *list(model)[:3]):
        assert done.count_below(end) == sum(1 for offset in model if offset < end)
    groups = done.groups()
    assert {o: n for n, offsets in groups.items() for o in offsets} == model
    assert all(offsets == sorted(offsets) for offsets in groups.values())
    assert SegmentOutcomes.from_groups(groups) == model


def one_step(done: SegmentOutcomes, model: dict[int, str], offset: int, name: str, op: float) -> None:
    """One random change made to the map and to the plain dict it is checked against (``op``: which)."""
    if op < 0.6:
        assert done.insert(offset, name) == model.get(offset)
        model.setdefault(offset, name)
    elif op < 0.85:
        done[offset] = name  # a rank upgrade when there already, in place (in a spilled map's file)
        model[offset] = name
    elif op < 0.95:
        if offset in model:
            del done[offset]
            del model[offset]
        else:
            with pytest.raises(KeyError):
                del done[offset]
    else:
        assert done.pop(offset, None) == model.pop(offset, None)


@pytest.mark.parametrize("seed", range(40))
def test_the_map_answers_as_a_dict_does(seed: int, merge_rule: tuple[int, int]) -> None:
    rng = random.Random(seed)
    done, model = SegmentOutcomes(), {}
    pool: list[int] = []
    for step in range(rng.randrange(200, 3000)):
        offset, name, op = an_offset(rng, pool), a_name(rng), rng.random()
        one_step(done, model, offset, name, op)
        check_same(done, model, [offset, offset + 1, offset - 1, *rng.sample(pool, min(len(pool), 3))])
        if step % 97 == 0:
            check_whole(done, model)
    check_whole(done, model)
    check_same(done, model, [*model, *pool])


@pytest.mark.parametrize("order", ["increasing", "decreasing", "shuffled", "interleaved", "late"])
def test_every_finished_job_is_found_after_each_merge(order: str, merge_rule: tuple[int, int]) -> None:
    """Each added offset is found right after it is added and after every later merge."""
    offsets = [4096 + 300 * i for i in range(5000)]
    if order == "decreasing":
        offsets.reverse()
    elif order == "shuffled":
        random.Random(29).shuffle(offsets)
    elif order == "interleaved":  # two queues of one segment drained at once, one behind
        offsets = [o for pair in zip(offsets[2500:], offsets[:2500], strict=True) for o in pair]
    elif order == "late":  # a drain in order, every 97th job finishing 3,000 jobs later (a retry)
        offsets.sort(key=lambda o: o + (900_000 if o % 97 == 0 else 0))
    done = SegmentOutcomes()
    for n, offset in enumerate(offsets, 1):
        assert done.insert(offset, "succeeded") is None
        assert offset in done
        if n % 499 == 0:
            assert all(o in done for o in offsets[:n])
            assert not any(o + 1 in done for o in offsets[:n])
    assert len(done) == len(offsets)
    assert done == dict.fromkeys(offsets, "succeeded")


def test_an_offset_past_four_bytes_widens_the_arrays(merge_rule: tuple[int, int]) -> None:
    done = SegmentOutcomes((4096 + i, "succeeded") for i in range(3000))
    done[2**32 + 5] = "failed"
    done.update((2**33 + i, "cancelled") for i in range(3000))
    assert done.get(2**32 + 5) == "failed"
    assert done.get(4096) == "succeeded"
    assert 5 + 2**33 in done
    assert len(done) == 6001


def apply_by_the_rule(model: dict[int, str], offset: int, outcome: str) -> None:
    """What ``LedgerIndex.apply`` keeps: the first outcome, unless a higher rank comes."""
    old = model.get(offset)
    if old is None or _RANK.get(outcome, 0) > _RANK.get(old, 0) > 0:
        model[offset] = outcome


@pytest.mark.parametrize("seed", range(24))
def test_the_index_keeps_the_outcome_the_rank_rule_says(seed: int, merge_rule: tuple[int, int]) -> None:
    """Through ``apply`` and ``apply_succeeded`` in any order, then the saved index's encode/decode."""
    rng = random.Random(seed)
    index, model = LedgerIndex(), {}
    jobs = [4096 + 300 * i for i in range(rng.randrange(100, 2500))]
    reports = [(o, rng.choice(NAMES)) for o in jobs] + [(rng.choice(jobs), rng.choice(NAMES)) for _ in jobs]
    rng.shuffle(reports) if seed % 2 else reports.sort(key=lambda r: r[0] + rng.randrange(0, 30_000))
    for offset, outcome in reports:
        loc = ("w", 3, offset)
        if outcome == "succeeded" and rng.random() < 0.5:
            index.apply_succeeded(loc)
        else:
            index.apply(Entry("done", "j", loc, outcome=outcome, at=1.0))
        apply_by_the_rule(model, offset, outcome)
        assert index.is_terminal(loc)
        assert index.outcome(loc) == model[offset]
    assert index.terminal[("w", 3)] == model
    assert index.terminal_count == len(model)
    assert all(index.is_terminal(("w", 3, o)) for o in jobs)
    assert not any(index.is_terminal(("w", 3, o + 1)) for o in jobs)
    for name in NAMES:
        assert index.totals[name] == sum(1 for o in model.values() if o == name)
    back = saved_index.decode(saved_index.encode(index, {}, {}, {})).index
    assert back.terminal == {("w", 3): model}
    assert (back.terminal_count, back.totals) == (index.terminal_count, index.totals)
    assert index.counts([("w", 3)]) == back.counts([("w", 3)])
    index.forget_segment(("w", 3))
    assert index.terminal_count == 0
    assert all(n == 0 for n in index.totals.values())


def test_a_saved_index_written_before_the_compact_map_loads() -> None:
    """The terminal map's format is unchanged: a payload as the dict-based index wrote it loads.

    (Version 2 only moved the key owners out, to the key table.)
    """
    body = {
        "v": 2,
        "covered": {},
        "through": {},
        "first": {},
        "terminal": [
            ["w", 0, {"succeeded": [4396, 4096, 5000], "failed": [4696]}],
            ["w", 1, {"cancelled": [64]}],
        ],
        "dups": [],
        "dup_events": [],
        "retries": [],
        "lost": [],
        "later": [],
        "requeued": [],
        "failed": [],
        "keys_table": ["", 0],
        "duplicates": [],
        "cancels": [],
    }
    index = saved_index.decode(json.dumps(body).encode()).index
    assert index.terminal == {
        ("w", 0): {4096: "succeeded", 4396: "succeeded", 4696: "failed", 5000: "succeeded"},
        ("w", 1): {64: "cancelled"},
    }
    assert index.is_terminal(("w", 0, 4696))
    assert not index.is_terminal(("w", 0, 4697))
    assert (index.terminal_count, index.totals["succeeded"], index.totals["cancelled"]) == (5, 3, 1)
    again = saved_codec.body_of_payload(saved_index.encode(index, {}, {}, {}))["terminal"]
    assert again == [  # (format 6: the outcomes in name order, one line per segment)
        ["w", 0, {"failed": [4696], "succeeded": [4096, 4396, 5000]}],
        ["w", 1, {"cancelled": [64]}],
    ]


@pytest.mark.parametrize("failing", ["bisect_right", "array"])
def test_a_merge_that_fails_halfway_keeps_every_finished_job(
    monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A merge that raises (a ``MemoryError`` while an array grows) leaves the map as it was: a
    finished job missing from it would be pushed and run again."""
    monkeypatch.setattr(outcomes, "MERGE_FLOOR", 16)
    done, model = SegmentOutcomes(), {}
    for i in range(40):
        done.insert(4096 + 330 * i, "succeeded")
        model[4096 + 330 * i] = "succeeded"

    def fail(*args: object) -> None:
        raise MemoryError

    real = getattr(outcome_arrays, failing)  # the merge's arrays are built there
    monkeypatch.setattr(outcome_arrays, failing, fail)
    for i in range(40):  # past 2**32 (widened), one out of order and failed, until a merge fails
        offset, name = (4096 + 165, "failed") if i == 3 else (2**32 + 330 * i, "succeeded")
        model[offset] = name
        try:
            done.insert(offset, name)
        except MemoryError:
            break
    else:
        pytest.fail("no merge")
    check_same(done, model, list(model))
    monkeypatch.setattr(outcome_arrays, failing, real)
    check_whole(done, model)
    for i in range(40):  # and the next merge takes them all in
        done.insert(2**33 + i, "cancelled")
        model[2**33 + i] = "cancelled"
    check_whole(done, model)
    check_same(done, model, list(model))


def test_lookups_in_offset_order_and_back_answer_as_a_dict_does() -> None:
    """The pushes ask in offset order (a lookup tries the slot after the last answer's first):
    every offset in order, then backwards and at random, from any slot the hint may be left at."""
    rng = random.Random(29)
    done, model = SegmentOutcomes(), {}
    for i in range(0, 2000, 2):
        done.insert(4096 + 3 * i, "succeeded")
        model[4096 + 3 * i] = "succeeded"
    done._merge()
    everything = list(range(4090, 4096 + 3 * 2000 + 5))
    for order in (everything, everything[::-1], rng.sample(everything, len(everything))):
        done._at = rng.randrange(len(done._offsets) + 3)
        for offset in order:
            assert done.has(offset) == (offset in model), offset
            if rng.random() < 0.01:
                done._at = rng.randrange(len(done._offsets) + 3)
