"""The supervisor's lease keeper: renewals at a third of each lease, no scan of every lease per message."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hybridq.worker import keeper
from hybridq.worker.keeper import Channel, Keeper


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Counted(dict[int, Any]):
    """The keeper's leases by process: counts the scans of every lease (``values()``)."""

    scans = 0

    def values(self) -> Any:
        _Counted.scans += 1
        return super().values()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(keeper.time, "monotonic", c)
    return c


@pytest.fixture
def renewed(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The tokens of each renewal call made (every lease still held)."""
    calls: list[list[str]] = []

    def renew_many(_conn: object, leases: list[tuple[str, str, int]]) -> list[int]:
        calls.append([token for _, token, _ in leases])
        return [1] * len(leases)

    monkeypatch.setattr(keeper, "renew_many", renew_many)
    return calls


@pytest.fixture
def pair() -> Iterator[tuple[Keeper, Channel]]:
    read, write = os.pipe()
    k = Keeper("redis://unused")
    k._conn = object()  # type: ignore[assignment]  # renew_many is replaced: no connection made
    k.add(1, read)
    k._leases = _Counted(k._leases)
    yield k, Channel(write)
    k.drop(1)
    os.close(write)


def test_a_lease_is_renewed_at_a_third_of_it_and_again_a_third_later(
    clock: _Clock, renewed: list[list[str]], pair: tuple[Keeper, Channel]
) -> None:
    k, channel = pair
    channel.hold([("lease:a", "a", 3000)])  # lapses 3 s after it is read unless renewed
    k.wait(0)
    clock.now += 0.99
    k.wait(0)
    assert renewed == []
    clock.now += 0.01
    k.wait(0)
    assert renewed == [["a"]]
    clock.now += 0.99
    k.wait(0)
    assert renewed == [["a"]]
    clock.now += 0.01
    k.wait(0)
    assert renewed == [["a"], ["a"]]


def test_leases_due_soon_after_the_one_due_are_renewed_with_it(
    clock: _Clock, renewed: list[list[str]], pair: tuple[Keeper, Channel]
) -> None:
    k, channel = pair
    channel.hold([("lease:a", "a", 3000)])
    k.wait(0)
    clock.now += keeper.COALESCE_S / 2
    channel.hold([("lease:b", "b", 3000)])
    k.wait(0)
    clock.now += 1.0 - keeper.COALESCE_S / 2
    k.wait(0)
    assert renewed == [["a", "b"]]


def test_messages_cost_no_scan_of_every_lease_until_one_is_due(
    clock: _Clock, renewed: list[list[str]], pair: tuple[Keeper, Channel]
) -> None:
    k, channel = pair
    channel.hold([(f"lease:{i}", f"held{i}", 30_000) for i in range(50)])
    k.wait(0)
    _Counted.scans = 0
    for turn in range(100):  # a turn of the process: its claims, then the outcomes' releases
        channel.hold([("lease:t", f"t{turn}", 30_000)])
        k.wait(0)
        channel.release([f"t{turn}"])
        k.wait(0)
        clock.now += 0.001
    assert _Counted.scans == 0
    assert renewed == []
    clock.now += 10.0
    k.wait(0)
    assert _Counted.scans > 0
    assert sorted(renewed[0]) == sorted(f"held{i}" for i in range(50))


def test_a_lease_let_go_of_before_it_is_due_is_not_renewed_and_the_next_one_still_is(
    clock: _Clock, renewed: list[list[str]], pair: tuple[Keeper, Channel]
) -> None:
    k, channel = pair
    channel.hold([("lease:a", "a", 3000)])
    k.wait(0)
    clock.now += 0.5
    channel.release(["a"])
    channel.hold([("lease:b", "b", 3000)])
    k.wait(0)
    clock.now += 0.5  # a's time: nothing renewed
    k.wait(0)
    assert renewed == []
    clock.now += 0.5  # b's
    k.wait(0)
    assert renewed == [["b"]]
