"""Per-key limits: the key gate and the push's arguments replayed against fixed digests.

Seeded random runs of :class:`KeyLimits` (a fake clock, a transport that answers at random,
fails now and then) and of ``rq_push.chunks`` (limited and unlimited jobs, keys ``None``, empty
and non-ASCII, parts split around ``PUSH_CHUNK``, odd leases). The digests were taken on main
``3569028``, before issue 30's branch i30one reworked both for speed without changing what they
do: a change that means to change behaviour updates them, after checking why they moved.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from hybridq.errors import TransportError
from hybridq.forwarder import keylimits
from hybridq.forwarder.keylimits import KeyLimits
from hybridq.protocol.keylimits import parse_limits
from hybridq.transport import rq_push
from hybridq.transport.base import KeyUse

GATE_DIGEST = "24a316be29826ede44d66c4239ce4c25f047fdb29a54057d4677648ca8e85f50"
PUSH_DIGEST = "a9f4238c805a0c0504ffd401271ae8c9863d4ff455554fbbda19ddae40e71c32"
FIELDS = ("key", "policy", "running", "queued", "started", "quarantine_s", "room", "blocked_since", "at")


def _digest(log: list[Any]) -> str:
    return hashlib.sha256(repr(log).encode()).hexdigest()


def gate_log(seed: int, clock: list[float]) -> list[Any]:
    """What a gate answers and reads over 300 random operations."""
    rng = random.Random(seed)
    log: list[Any] = []

    class Transport:
        counts_limited_pushes = rng.random() < 0.5

        def key_use(
            self, periods: Mapping[str, int], added: Mapping[str, int], *, lease_s: float
        ) -> dict[str, KeyUse]:
            log.append(("read", sorted(periods.items()), sorted(added.items())))
            if rng.random() < 0.05:
                raise TransportError("down")
            return {
                k: KeyUse(
                    rng.randint(0, 3), rng.randint(0, 3), rng.randint(0, 3), rng.choice([0.0, 0.0, 2.0])
                )
                for k in periods
            }

    limits = parse_limits(["a:*=concurrency:3", "b:*=rate:4/s", "c:1=concurrency:1,rate:2/m"])
    gate = KeyLimits(limits, Transport(), 2.0)  # type: ignore[arg-type]
    keys = ["a:1", "a:2", "b:1", "b:2", "c:1", "c:2", "z", "y:1"]
    for _ in range(300):
        op = rng.random()
        clock[0] += rng.choice([0.0, 0.1, 0.6, 1.5, 12.0, 70.0])
        try:
            if op < 0.4:
                key = rng.choice(keys)
                log.append(("room", key, min(gate.room(key), 2**40)))
            elif op < 0.6:
                gate.pushed(rng.choice(keys), rng.randint(1, 3), by_push=rng.random() < 0.7)
            elif op < 0.75:
                gate.prefetch(rng.sample(keys, 3))
            elif op < 0.92:
                log.append(("look", gate.look()))
            elif op < 0.95:
                gate.forget()
            else:
                log.append(("figures", gate.figures()))
        except TransportError:
            log.append("down")
    log.append(("states", [tuple(getattr(s, f) for f in FIELDS) for s in gate.states()]))
    return log


def push_log(seed: int) -> list[Any]:
    """The script calls ``chunks`` makes of a random batch (or the error it raises)."""
    rng = random.Random(seed)
    n = rng.choice([0, 1, 2, 5, rq_push.PUSH_CHUNK - 1, rq_push.PUSH_CHUNK, rq_push.PUSH_CHUNK + 1])
    jobs, fields = [], []
    for i in range(n):
        env = SimpleNamespace(
            queue=rng.choice(["a", "b", "c"]),
            limit_key=rng.choice([None, "", "k:1", "k:2", "tenant:é", "x" * 50]),
            id=f"id{seed}-{i}",
        )
        limit = rng.choice([None, "1,0,0,k", "0,5,1000,k"])
        lease = rng.choice([0.0, 0.0004, 1.0, 2.5, 30, 2, 2.0, float("nan"), 1e-9])
        jobs.append(SimpleNamespace(envelope=env, limit=limit, lease_s=lease))
        fields.append([f"f{i}", b"\x00bytes", "v"])
    try:
        calls = rq_push.chunks(jobs, fields, "2026-12-07T00:00:00Z")  # type: ignore[arg-type]
    except Exception as exc:  # the error is part of the behaviour
        return [repr(exc)]
    return [([d.envelope.id for d in part], chunk) for part, chunk in calls]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    fake = SimpleNamespace(monotonic=lambda: now[0], time=lambda: now[0] + 1e9)
    monkeypatch.setattr(keylimits, "time", fake)
    return now


def test_the_gate_answers_as_on_main(clock: list[float]) -> None:
    logs = []
    for seed in range(60):
        clock[0] = 1000.0
        logs.append(gate_log(seed, clock))
    assert sys.maxsize >= 2**40
    assert _digest(logs) == GATE_DIGEST


def test_the_gates_key_states_are_made_in_their_fields_order(clock: list[float]) -> None:
    """The gate makes a ``KeyState`` by ``tuple.__new__`` (no arity check): in this order only."""
    assert keylimits.KeyState._fields == FIELDS
    kind, states = gate_log(3, clock)[-1]
    assert kind == "states"
    assert states
    for state in states:
        key, policy, running, queued, started, quarantine_s, room, blocked_since, at = state
        assert all(isinstance(s, str) for s in (key, policy))
        assert all(isinstance(n, int) for n in (running, queued, started, room))
        assert all(isinstance(f, float) for f in (quarantine_s, at))
        assert (blocked_since is None) == (room > 0)


def test_the_push_makes_the_same_calls_as_on_main() -> None:
    assert _digest([push_log(seed) for seed in range(300)]) == PUSH_DIGEST
