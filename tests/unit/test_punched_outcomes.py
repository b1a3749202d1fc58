"""The index keeps a punched range instead of its finished jobs' offsets, and answers as before.

``SegmentOutcomes.drop_ranges`` (``hybridq.ledger.punched``) against a plain ``dict`` over random
records, outcomes and ranges (a range holds only finished jobs, as a durable hole map does);
then :class:`LedgerIndex` with collapses between reports against the rank rule, and the saved
index read back. A finished job answered "not finished" would run again (docs/reliability.md).
Offsets are record starts (a location names one), so only those are asked inside a range.
"""

from __future__ import annotations

import random

import pytest
from hybridq.ledger import outcomes, saved_codec, saved_index
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import _RANK, LedgerIndex
from hybridq.ledger.outcomes import SegmentOutcomes

NAMES = ("succeeded", "failed", "cancelled", "invalid")
Spans = tuple[int, int, int]


@pytest.fixture(params=[(4, 2), (1024, 64)], ids=["floor4", "default"])
def merge_rule(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    floor, fraction = request.param
    monkeypatch.setattr(outcomes, "MERGE_FLOOR", floor)
    monkeypatch.setattr(outcomes, "MERGE_FRACTION", fraction)


def records(rng: random.Random) -> list[int]:
    """Record offsets of a segment: 64 on, of random lengths."""
    out, at = [], 64
    for _ in range(rng.randrange(50, 1500)):
        out.append(at)
        at += rng.randrange(40, 700)
    return [*out, at]  # the last: where the seal records start


def a_run(rng: random.Random, offsets: list[int], finished: set[int], done: SegmentOutcomes) -> list[Spans]:
    """The whole hole map once a run of finished records not punched yet is added to it.

    As the forwarder does: a run stops at a job not finished or at a range punched already,
    and the map merges adjacent ranges (``hybridq.journal.holes``).
    """
    spans = done.punched()

    def punched(offset: int) -> bool:
        return any(s <= offset < e for s, e, _ in spans)

    i = rng.randrange(len(offsets) - 1)
    if offsets[i] not in finished or punched(offsets[i]):
        return spans
    j = i
    while j + 1 < len(offsets) - 1 and offsets[j + 1] in finished and not punched(offsets[j + 1]):
        if j - i > 40 and rng.random() < 0.05:
            break
        j += 1
    merged: list[Spans] = []
    for s, e, n in sorted([*spans, (offsets[i], offsets[j + 1], j + 1 - i)]):
        if merged and merged[-1][1] == s:
            merged[-1] = (merged[-1][0], e, merged[-1][2] + n)
        else:
            merged.append((s, e, n))
    return merged


def check(done: SegmentOutcomes, model: dict[int, str], offsets: list[int]) -> None:
    assert len(done) == len(model)
    for offset in offsets:
        assert (offset in done) == (offset in model), offset
        assert done.get(offset) == model.get(offset), offset
    tally: dict[str, int] = {}
    for outcome in model.values():
        tally[outcome] = tally.get(outcome, 0) + 1
    assert done.tally() == tally
    seal = offsets[-1]
    assert done.count_below(seal) == sum(1 for o in model if o < seal)
    for end in offsets[:: max(1, len(offsets) // 7)]:
        # A range cut by ``end`` counts only its listed jobs: never more than there are.
        assert done.count_below(end) <= sum(1 for o in model if o < end)
    back = SegmentOutcomes.from_groups(done.groups())
    back.drop_ranges(done.punched())
    assert all(back.get(o) == model.get(o) for o in offsets)
    assert len(back) == len(model)


def punch_step(
    done: SegmentOutcomes,
    model: dict[int, str],
    rng: random.Random,
    offsets: list[int],
    offset: int,
    name: str,
    op: float,
) -> None:
    """One random change to the map and its plain dict, ranges punched among them (``op``: which)."""
    if op < 0.6:
        assert done.insert(offset, name) == model.get(offset)
        model.setdefault(offset, name)
    elif op < 0.8:
        done[offset] = name
        model[offset] = name
    elif op < 0.97:
        done.drop_ranges(a_run(rng, offsets, set(model), done))
    else:
        done.drop_ranges(done.punched())  # the same map again (a start after a save)


@pytest.mark.parametrize("seed", range(30))
def test_a_collapsed_map_answers_as_a_dict_does(seed: int, merge_rule: None) -> None:
    rng = random.Random(seed)
    offsets = records(rng)
    done, model = SegmentOutcomes(), {}
    for step in range(rng.randrange(300, 3000)):
        offset, name, op = rng.choice(offsets[:-1]), rng.choice(NAMES), rng.random()
        punch_step(done, model, rng, offsets, offset, name, op)
        if step % 50 == 0:
            check(done, model, offsets)
    check(done, model, offsets)
    assert len(done.punched()) > 0
    listed = len(list(done))
    assert listed < len(model) or not any(o == "succeeded" for o in model.values())


def test_a_range_that_crosses_one_kept_is_refused_and_changes_nothing() -> None:
    done = SegmentOutcomes((64 + 100 * i, "succeeded") for i in range(100))
    done.drop_ranges([(64, 64 + 100 * 10, 10)])
    with pytest.raises(ValueError, match="cross"):
        done.drop_ranges([(64 + 100 * 5, 64 + 100 * 20, 15)])
    assert done.punched() == [(64, 64 + 1000, 10)]
    assert len(done) == 100
    done.drop_ranges([(64, 64 + 100 * 20, 20)])  # a range grown over the first: fine
    assert done.punched() == [(64, 64 + 2000, 20)]
    assert len(done) == 100
    assert len(list(done)) == 80
    with pytest.raises(ValueError, match="punched"):
        del done[64 + 100]


def test_a_memory_error_while_ranges_are_dropped_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listed jobs in the ranges are counted before the swap: ``len`` and ``tally`` stay right."""
    done = SegmentOutcomes((64 + 100 * i, "cancelled" if i == 3 else "succeeded") for i in range(100))
    done.drop_ranges([(64, 64 + 100 * 10, 10)])
    before = (len(done), done.tally(), done.punched(), list(done))

    def no_memory(*args: object) -> int:
        raise MemoryError

    monkeypatch.setattr(outcomes, "listed_in", no_memory)
    with pytest.raises(MemoryError):
        done.drop_ranges([(64, 64 + 100 * 20, 20)])
    assert (len(done), done.tally(), done.punched(), list(done)) == before


def apply_by_the_rule(model: dict[int, str], offset: int, outcome: str) -> None:
    old = model.get(offset)
    if old is None or _RANK.get(outcome, 0) > _RANK.get(old, 0) > 0:
        model[offset] = outcome


@pytest.mark.parametrize("seed", range(16))
def test_the_collapsed_index_keeps_the_outcome_the_rank_rule_says(seed: int, merge_rule: None) -> None:
    """Collapses between ``apply`` and ``apply_succeeded`` in any order; the saved index read back."""
    rng = random.Random(seed)
    offsets = records(rng)
    jobs = offsets[:-1]
    index, model = LedgerIndex(), {}
    reports = [(o, rng.choice(NAMES)) for o in jobs] + [(rng.choice(jobs), rng.choice(NAMES)) for _ in jobs]
    reports.sort(key=lambda r: r[0] + rng.randrange(0, 30_000))
    for n, (offset, outcome) in enumerate(reports):
        loc = ("w", 3, offset)
        if outcome == "succeeded" and rng.random() < 0.5:
            index.apply_succeeded(loc)
        else:
            index.apply(Entry("done", "j", loc, outcome=outcome, at=1.0, dup=rng.random() < 0.1))
        apply_by_the_rule(model, offset, outcome)
        if n % 20 == 0:
            done = index.terminal[("w", 3)]
            index.collapse(("w", 3), a_run(rng, offsets, set(model), done))
        assert index.is_terminal(loc)
        assert index.outcome(loc) == model[offset]
    assert index.terminal[("w", 3)].punched()
    assert index.terminal_count == len(model)
    assert all(index.outcome(("w", 3, o)) == model.get(o) for o in jobs)
    for name in NAMES:
        assert index.totals[name] == sum(1 for o in model.values() if o == name)
    back = saved_index.decode(saved_index.encode(index, {}, {}, {})).index
    assert all(back.outcome(("w", 3, o)) == model.get(o) for o in jobs)
    assert (back.terminal_count, back.totals) == (index.terminal_count, index.totals)
    assert back.counts([("w", 3)]) == index.counts([("w", 3)])
    index.forget_segment(("w", 3))
    assert index.terminal_count == 0
    assert all(index.totals[name] == 0 for name in NAMES)


def test_a_saved_index_read_without_the_ranges_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 5 holds the ranges: a reader of the offsets alone would push their jobs again.

    So the version is new: a reader that does not know 5 (its ``READ_VERSIONS`` without it, as
    the format 4 code's) refuses the file (and replays the ledger) instead of reading it.
    """
    assert saved_codec.VERSION >= 5  # 6: the same, in lines
    index = LedgerIndex()
    for i in range(10):
        index.apply_succeeded(("w", 0, 64 + 100 * i))
    index.collapse(("w", 0), [(64, 64 + 1000, 10)])
    raw = saved_index.encode(index, {}, {}, {})
    back = saved_index.decode(raw).index
    assert back.terminal[("w", 0)].groups() == {}
    assert all(back.is_terminal(("w", 0, 64 + 100 * i)) for i in range(10))
    assert back.terminal_count == 10
    monkeypatch.setattr(saved_codec, "READ_VERSIONS", (2, 3, 4))
    with pytest.raises(ValueError, match=f"version {saved_codec.VERSION}"):
        saved_index.decode(raw)
