"""The supervisor's lease keeper: renewals at a third of each lease, no scan of every lease per message."""

from __future__ import annotations

import os
import random
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


def test_no_lease_is_left_overdue_whatever_the_order_of_holds_releases_and_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model check (review of the next-due bound): 100 seeded runs of holds with shorter and
    longer leases, re-holds, releases, renewals failing and leases lost, on two processes; after
    each wait the bound is never later than the earliest lease due, and no lease is left due."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    now = [100.0]
    monkeypatch.setattr(keeper.time, "monotonic", lambda: now[0])
    state: dict[str, Any] = {"fail": False, "lost": set()}

    def renew_many(_conn: object, leases: list[tuple[str, str, int]]) -> list[int]:
        if state["fail"]:
            raise RedisConnectionError("down")
        return [0 if token in state["lost"] else 1 for _, token, _ in leases]

    monkeypatch.setattr(keeper, "renew_many", renew_many)
    rng = random.Random(1)
    for _ in range(100):
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        k = Keeper("redis://unused")
        k._conn = object()  # type: ignore[assignment]
        k.add(1, r1)
        k.add(2, r2)
        channels = {1: Channel(w1), 2: Channel(w2)}
        held: set[str] = set()
        for n in range(200):
            op, p = rng.random(), rng.choice([1, 2])
            if op < 0.3:
                token = f"t{n}"
                channels[p].hold([(f"k{token}", token, rng.choice([300, 1000, 3000, 30000, 60000]))])
                held.add(token)
            elif op < 0.45 and held:
                token = rng.choice(sorted(held))
                channels[p].hold([(f"k{token}", token, rng.choice([300, 3000, 60000]))])
            elif op < 0.6 and held:
                token = rng.choice(sorted(held))
                channels[1].release([token])
                channels[2].release([token])
            elif op < 0.65:
                state["fail"] = not state["fail"]
            elif op < 0.68 and held:
                state["lost"].add(rng.choice(sorted(held)))
            now[0] += rng.choice([0, 0.001, 0.01, 0.05, 0.2, 1.0])
            k.wait(0)
            leases = [lease for per in k._leases.values() for lease in per.values()]
            assert k._due <= min((lease.due for lease in leases), default=float("inf")) + 1e-12
            assert not [lease for lease in leases if lease.due <= now[0]]
        for fd in (w1, w2):
            os.close(fd)
        k.drop(1)
        k.drop(2)
