"""Per-key limits: the policies' text (``--limit``, ``HYBRIDQ_LIMITS``, ``limits=``) and the forwarder's gate."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from hybridq.errors import ConfigError
from hybridq.forwarder import keylimits
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.keylimits import KeyLimits
from hybridq.lookup.stats import Snapshot
from hybridq.protocol import Delivery
from hybridq.protocol.keylimits import Limit, parse_limit, parse_limits
from hybridq.testing.memory import MemoryTransport
from hybridq.transport.base import KeyUse, PushResult


def test_specs_parse_to_a_policy() -> None:
    assert parse_limit("concurrency:2") == Limit(2, 0, 0)
    assert parse_limit("rate:100/s,concurrency:10") == Limit(10, 100, 1000)
    assert parse_limit(" rate:5/m ") == Limit(0, 5, 60_000)
    assert parse_limit("rate:1/h").text() == "rate:1/h"
    assert Limit(3, 7, 1000).wire("tenant:1") == "3,7,1000,tenant:1"


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "concurrency",
        "concurrency:0",
        "concurrency:-1",
        "concurrency:2.5",
        "rate:10",
        "rate:10/d",
        "rate:0/s",
        "concurrency:1,concurrency:2",
        "speed:3",
        "concurrency:1,,",
        "concurrency:9999999999",
    ],
)
def test_a_bad_spec_is_one_line(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_limit(spec)
    assert "\n" not in str(err.value)


def test_the_first_matching_pattern_wins() -> None:
    limits = parse_limits(["tenant:vip=concurrency:10", "tenant:*=concurrency:2"])
    assert limits.of("tenant:vip") == Limit(10, 0, 0)
    assert limits.of("tenant:42") == Limit(2, 0, 0)
    assert limits.of("other") is None
    assert limits.of(None) is None
    assert parse_limits({"a*": "rate:3/s"}).texts() == ["a*=rate:3/s"]


@pytest.mark.parametrize(
    "items",
    [
        ["tenant:*"],
        ["=concurrency:1"],
        ["tenant:*="],
        ["a b=concurrency:1"],
        ["a=concurrency:1", "a=rate:1/s"],
    ],
)
def test_a_bad_item_is_one_line(items: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_limits(items)
    assert "\n" not in str(err.value)


def test_the_forwarder_config_takes_the_limits_in_any_form() -> None:
    assert ForwarderConfig(limits=["k=concurrency:1"]).key_limits.of("k") == Limit(1, 0, 0)
    assert ForwarderConfig(limits={"k": "rate:2/s"}).key_limits.of("k") == Limit(0, 2, 1000)
    assert not ForwarderConfig().key_limits
    with pytest.raises(ConfigError):
        ForwarderConfig(limits=["k=bogus:1"])
    with pytest.raises(TypeError):
        ForwarderConfig(limits="k=concurrency:1")


def test_a_delivery_carries_its_limit_and_an_unreadable_one_is_none() -> None:
    from hybridq.envelope.model import Envelope, new_job_id

    job_id = new_job_id(1.0)
    env = Envelope(
        id=job_id, func="tests.tasks.add", args=(1, 2), queue="q", idempotency_key=job_id, created_at=1.0
    )
    d = Delivery(env, "owner", ("w", 0, 0), limit="2,0,0,k")
    assert Delivery.from_json(d.to_json()).limit == "2,0,0,k"
    assert "lim" not in Delivery(env, "owner", ("w", 0, 0)).to_json()
    raw = {**d.to_json(), "lim": 12}
    assert Delivery.from_json(raw).limit is None


class Uses(MemoryTransport):
    """A transport that reports what the test says (and records what it was told)."""

    def __init__(self, uses: dict[str, KeyUse]) -> None:
        super().__init__()
        self.uses = uses
        self.calls: list[tuple[dict[str, int], dict[str, int]]] = []

    def key_use(
        self, periods: Mapping[str, int], added: Mapping[str, int], *, lease_s: float
    ) -> dict[str, KeyUse] | None:
        del lease_s
        self.calls.append((dict(periods), dict(added)))
        return {k: self.uses.get(k, KeyUse(0, 0, 0, 0.0)) for k in periods}


def test_the_gate_reads_the_keys_asked_about_once_per_look_and_counts_pushes_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transport = Uses({"t:1": KeyUse(1, 0, 0, 0.0), "r": KeyUse(0, 1, 8, 0.0)})
    gate = KeyLimits(parse_limits(["t:*=concurrency:3", "r=rate:10/s"]), transport, lease_s=2.0)
    assert gate.room("free") == sys.maxsize, "an unlimited key is never held"
    assert gate.room("t:1") == 0, "not looked at yet: it waits a step"
    assert gate.room("r") == 0
    gate.look()
    assert transport.calls == [({"t:1": 0, "r": 1000}, {})]
    assert gate.room("t:1") == 2
    assert gate.room("r") == 1, "10 a second, 8 started, 1 queued"
    gate.pushed("t:1", 2)
    assert gate.room("t:1") == 0
    gate.look()
    assert transport.calls[-1][1] == {"t:1": 2}, "what was pushed is added to the queued count"
    transport.uses["t:1"] = KeyUse(1, 0, 0, 3.0)
    gate.room("t:1")
    calls = len(transport.calls)
    gate.look()
    assert len(transport.calls) == calls, "a key with room read within FRESH_S is not read again"
    monkeypatch.setattr(keylimits, "FRESH_S", -1.0)
    gate.room("t:1")  # older than FRESH_S, but all of the room its read gave is left: trusted
    gate.look()
    assert len(transport.calls) == calls, "a key with at least half its room left is trusted to TRUST_S"
    monkeypatch.setattr(keylimits, "TRUST_S", -1.0)
    gate.room("t:1")  # asked while its jobs wait, its room older than TRUST_S: read at the next look
    gate.look()
    assert gate.room("t:1") == 0, "quarantined after Redis lost its state"
    states = {s.key: s for s in gate.states()}
    assert states["t:1"].quarantine_s == 3.0
    assert states["t:1"].blocked_since is not None


def test_a_transport_that_cannot_say_leaves_every_key_open() -> None:
    gate = KeyLimits(parse_limits(["k=concurrency:1"]), MemoryTransport(), lease_s=2.0)
    gate.room("k")
    gate.look()
    assert gate.room("k") == sys.maxsize


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--limit", "tenant:*"], {}),
        (["--limit", "tenant:*=concurrency:0"], {}),
        (["--limit", "a=rate:5/d"], {}),
        ([], {"HYBRIDQ_LIMITS": "a=concurrency:1;b=bogus"}),
    ],
)
def test_a_bad_limit_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli

    result = CliRunner().invoke(cli, ["forward", "--journal", str(tmp_path / "j"), *args], env=env)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(("hybridq: error: bad limit", "hybridq: error: bad --limit")), lines
    assert not (tmp_path / "j").exists()


def test_forward_help_says_what_a_limit_is() -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli

    text = " ".join(CliRunner().invoke(cli, ["forward", "--help"]).output.split())
    assert "--limit PATTERN=SPEC" in text
    assert "concurrency:N" in text
    assert "rate:N/s|N/m|N/h" in text
    assert "HYBRIDQ_LIMITS" in text
    assert "first matching PATTERN wins" in text


class WindowedUses(Uses):
    """:class:`Uses` reporting queue lengths too (a window the test sizes), and what it was pushed."""

    def __init__(self, uses: dict[str, KeyUse]) -> None:
        super().__init__(uses)
        self.pushed_keys: list[str | None] = []

    def queue_lengths(self, queues: Sequence[str]) -> dict[str, int]:
        return {q: len(self.queues.get(q, [])) for q in queues}

    def key_use(
        self, periods: Mapping[str, int], added: Mapping[str, int], *, lease_s: float
    ) -> dict[str, KeyUse] | None:
        for key, n in added.items():  # nothing claims them: they stay queued
            use = self.uses.get(key, KeyUse(0, 0, 0, 0.0))
            self.uses[key] = KeyUse(use.running, use.queued + n, use.started, use.quarantine_s)
        return super().key_use(periods, added, lease_s=lease_s)

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        self.pushed_keys += [d.envelope.limit_key for d in jobs]
        return super().push(jobs)


def test_a_keys_first_sight_reads_its_room_with_its_chunk_not_through_the_run_table(
    journal_dir: Path,
) -> None:
    from hybridq import Queue
    from hybridq.forwarder import Forwarder

    from tests import tasks

    q = Queue("default", journal=journal_dir)
    q.enqueue_many(q.prepare(tasks.add, [i, i], limit_key=f"t:{i % 300}") for i in range(600))
    q.enqueue_many(q.prepare(tasks.add, [i, i], limit_key="two") for i in range(5))
    transport = WindowedUses({"two": KeyUse(1, 0, 0, 0.0)})
    f = Forwarder(
        journal_dir,
        transport,
        window_min=10_000,
        window_max=10_000,
        limits=["t:*=concurrency:3", "two=concurrency:3"],
    )
    f.open()
    try:
        f.step()
        # Before: a key not read yet had no room until the step's look: all 605 went through the
        # run table (a row written, fsync'd, picked and read back), and the refill pushed them.
        assert f.backlog.refilled == 0, "none went through the run table"
        assert len(transport.pushed_keys) == 602, "every t: key's 2 jobs, and the 2 slots 'two' has left"
        assert transport.pushed_keys.count("two") == 2
        assert f.state.runs.waiting("default") == 3
        reads = [periods for periods, _ in transport.calls if periods]
        assert sum(len(p) for p in reads) == 301, "each key read once, by the chunk it came in"
        assert len(reads) <= 3, "one call per chunk of 500 jobs read"
        calls = len(transport.calls)
        f.step()
        periods = [k for p, _ in transport.calls for k in p]
        assert periods.count("t:0") == 1, "a key with room is not read again within FRESH_S"
        added = Counter[str]()
        for _, add in transport.calls:
            added.update(add)
        assert (added["t:0"], added["two"]) == (2, 2), "but what went is added to its queued count"
        assert [set(p) for p, _ in transport.calls[calls:] if p] == [{"two"}], (
            "a key without room is read again"
        )
        assert transport.pushed_keys.count("two") == 2, "its room is gone: its others wait on disk"
    finally:
        f.close()


def test_jobs_read_behind_a_full_window_have_their_keys_read_once_by_the_refill_not_also_at_the_read(
    journal_dir: Path,
) -> None:
    from hybridq import Queue
    from hybridq.forwarder import Forwarder

    from tests import tasks

    q = Queue("default", journal=journal_dir)
    q.enqueue_many(q.prepare(tasks.add, [i, i], limit_key=f"t:{i}") for i in range(300))
    transport = WindowedUses({})
    f = Forwarder(journal_dir, transport, window_min=100, window_max=100, limits=["t:*=concurrency:3"])
    f.open()
    try:
        f.step()
        reads = Counter(k for periods, _ in transport.calls for k in periods)
        pushed = set(transport.pushed_keys)
        assert len(pushed) == 100, "the window's 100"
        assert set(reads) == pushed, "only the keys of jobs that could go were read (before: all 300)"
        assert set(reads.values()) == {1}
    finally:
        f.close()


def test_after_redis_lost_its_state_no_room_is_trusted_until_read_again() -> None:
    transport = Uses({})
    gate = KeyLimits(parse_limits(["t:*=concurrency:5"]), transport, lease_s=2.0)
    gate.prefetch(["t:1"])
    assert gate.room("t:1") == 5
    transport.uses["t:1"] = KeyUse(0, 0, 0, 2.0)  # a new epoch: quarantined for a lease
    gate.forget()
    assert gate.room("t:1") == 0, "its room is not trusted (it was read within FRESH_S)"
    gate.prefetch(["t:1"])
    assert gate.room("t:1") == 0
    assert [set(periods) for periods, _ in transport.calls] == [{"t:1"}, {"t:1"}]


def test_the_figures_are_reused_for_a_second_unless_a_key_is_held_or_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transport = Uses({"t:1": KeyUse(0, 0, 0, 0.0), "t:2": KeyUse(0, 0, 0, 0.0)})
    gate = KeyLimits(parse_limits(["t:*=concurrency:2"]), transport, lease_s=2.0)
    gate.room("t:1")
    assert gate.look(), "a first look is news"
    first = gate.figures()
    assert set(first) == {"t:1"}
    gate.room("t:2")
    assert not gate.look(), "a new key with room is not news at once"
    assert gate.figures() is first, "the same figures within FRESH_S (their JSON is reused)"
    monkeypatch.setattr(keylimits, "FRESH_S", -1.0)
    assert gate.look(), "a new key is news once the figures are older than FRESH_S"
    assert set(gate.figures()) == {"t:1", "t:2"}
    monkeypatch.setattr(keylimits, "FRESH_S", 60.0)
    shown = gate.figures()
    transport.uses["t:1"] = KeyUse(2, 0, 0, 0.0)
    gate.room("t:1")
    gate.forget()  # (read again at the next look)
    gate.room("t:1")
    assert gate.look(), "a key held is news at once"
    again = gate.figures()
    assert again is not shown
    assert again["t:1"]["blocked_since"] is not None


def test_the_snapshot_reuses_the_limit_figures_json_only_for_the_same_object() -> None:
    a = Snapshot(limit_keys={"k": {"running": 1}})
    assert Snapshot.from_bytes(a.to_bytes()).limit_keys == {"k": {"running": 1}}
    b = Snapshot(limit_keys={"k": {"running": 2}})
    assert Snapshot.from_bytes(b.to_bytes()).limit_keys == {"k": {"running": 2}}
    assert Snapshot.from_bytes(Snapshot().to_bytes()).limit_keys == {}


def test_the_gate_leaves_the_add_to_a_push_that_counts_its_copies_but_adds_the_refills() -> None:
    # RQ's push adds its limited copies to their keys' queued counts in the same script call
    # (transport.rq_push): the look then adds nothing for them (no INCRBY and PEXPIRE a key a
    # step), and a copy is never claimed before its add. The refill's copies it still adds.
    transport = Uses({})
    transport.counts_limited_pushes = True  # type: ignore[misc]
    gate = KeyLimits(parse_limits(["t:*=concurrency:3"]), transport, lease_s=2.0)
    gate.look()
    gate.room("t:1")
    gate.look()
    gate.pushed("t:1", 2)
    assert gate.room("t:1") == 1, "the room is still counted down"
    gate.pushed("t:2", 1, by_push=False)  # the refill's copy
    gate.look()
    assert transport.calls[-1][1] == {"t:2": 1}, "only the refill's copy is added by the look"


@pytest.mark.parametrize("counts_pushes", [True, False])
def test_a_chunks_keys_told_in_one_call_count_as_told_one_by_one(counts_pushes: bool) -> None:
    # Backlog.sent tells the gate a chunk's keys in one call (pushed_keys): the same rooms and
    # adds as a pushed() per key, a key never read and an unlimited one included.
    gates = []
    for _ in range(2):
        transport = Uses({})
        transport.counts_limited_pushes = counts_pushes  # type: ignore[misc]
        gate = KeyLimits(parse_limits(["t:*=concurrency:3"]), transport, lease_s=2.0)
        gate.prefetch(["t:1"])
        gates.append((gate, transport))
    counts = {"t:1": 2, "t:2": 1, "free": 4}
    for key, n in counts.items():
        gates[0][0].pushed(key, n, by_push=True)
    gates[1][0].pushed_keys(counts, by_push=True)
    for gate, _ in gates:
        assert (gate.room("t:1"), gate.room("t:2"), gate.room("free")) == (1, 0, sys.maxsize)
        gate.look()
    assert gates[0][1].calls[-1] == gates[1][1].calls[-1]


def test_a_key_with_room_is_read_again_once_less_than_half_of_its_room_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: read again at the next look whenever its read was older than FRESH_S, so a key of
    # a job or two (a key per tenant) was read once per job (docs/benchmarks.md, "The add in
    # the push"). Counted down by this forwarder's pushes, the room never grows without a read.
    transport = Uses({})
    transport.counts_limited_pushes = True  # type: ignore[misc]
    gate = KeyLimits(parse_limits(["t:*=concurrency:10"]), transport, lease_s=2.0)
    gate.prefetch(["t:1"])
    calls = len(transport.calls)
    monkeypatch.setattr(keylimits, "FRESH_S", -1.0)
    gate.pushed("t:1", 5)
    assert gate.room("t:1") == 5
    gate.look()
    assert len(transport.calls) == calls, "half of the room left: not read again"
    gate.pushed("t:1", 1)
    assert gate.room("t:1") == 4
    gate.look()
    assert transport.calls[-1][0] == {"t:1": 0}, "less than half left and older than FRESH_S: read"
    monkeypatch.setattr(keylimits, "FRESH_S", 60.0)
    gate.pushed("t:1", 6)
    gate.room("t:1")
    gate.look()
    assert len(transport.calls) == calls + 1, "less than half left, but read within FRESH_S"


def test_the_forwarder_has_its_gate_add_the_refills_copies_and_not_its_pushes(journal_dir: Path) -> None:
    # The wiring (forwarder.loop): the refill's script counts nothing, so its copies go to the
    # gate as by_push=False, while a counting push's (and the reconciler's) are left to the push.
    from hybridq.envelope.model import Envelope, new_job_id
    from hybridq.forwarder import Forwarder

    def copy(key: str) -> Delivery:
        job_id = new_job_id()
        env = Envelope(
            id=job_id, idempotency_key=job_id, func="tests.tasks.add", queue="default",
            created_at=1_700_000_000.0, args=(1, 2), limit_key=key,
        )  # fmt: skip
        return Delivery(env, "owner", ("w", 0, 0), limit=f"3,0,0,{key}")

    transport = Uses({})
    transport.counts_limited_pushes = True  # type: ignore[misc]
    f = Forwarder(journal_dir, transport, limits=["t:*=concurrency:3"])
    f.open()
    try:
        f.completions.reconciler.refill_sent([copy("t:1"), copy("t:1")])
        f.completions.reconciler.sent([copy("t:2")])
        f.backlog.sent([copy("t:3")])  # the push's (delivery, maintain, the run table's)
        f.key_limits.look()
        assert transport.calls[-1][1] == {"t:1": 2}, "only the refill's copies are added by the read"
    finally:
        f.close()
