"""The queue → Redis map (--redis-for, HYBRIDQ_REDIS_FOR) and the composed epoch of several Redis."""

from __future__ import annotations

import pytest
from hybridq.errors import ConfigError
from hybridq.transport import MemoryTransport, Transport
from hybridq.transport.routes import Routes, parse_redis_for, split_env
from hybridq.transport.sharded import ShardedTransport, compose_epoch, split_epoch


def test_the_env_form_splits_between_entries_not_inside_urls() -> None:
    text = "q1=redis+sentinel://h1:26379,h2:26379/mymaster/0, q2=redis://b:6380/1;q3=unix:///r.sock?db=2"
    assert split_env(text) == [
        "q1=redis+sentinel://h1:26379,h2:26379/mymaster/0",
        "q2=redis://b:6380/1",
        "q3=unix:///r.sock?db=2",
    ]
    assert split_env("  ") == []


def test_entries_are_checked() -> None:
    assert parse_redis_for(["a=redis://h:1/0", "b=redis://h:2/0"]) == {
        "a": "redis://h:1/0",
        "b": "redis://h:2/0",
    }
    for bad in ("nourl", "=redis://h:1/0", "a=", "-x=redis://h:1/0", "a=redis://h:notaport/0"):
        with pytest.raises(ConfigError):
            parse_redis_for([bad])
    with pytest.raises(ConfigError, match="two different"):
        parse_redis_for(["a=redis://h:1/0", "a=redis://h:2/0"])


def test_a_bad_url_is_shown_redacted() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_redis_for(["a=redis://u:s3cret@h:1/zz"])
    assert "s3cret" not in str(caught.value)


def test_routes_default_first_then_sorted() -> None:
    routes = Routes("redis://d/0", {"x": "redis://z/0", "y": "redis://b/0", "w": "redis://d/0"})
    assert routes.urls == ["redis://d/0", "redis://b/0", "redis://z/0"]
    assert routes.url_for("other") == "redis://d/0"
    assert routes.queues_on("redis://d/0") == ["w"]
    assert routes.sharded
    assert not Routes("redis://d/0", {"w": "redis://d/0"}).sharded


def test_the_composed_epoch_round_trips_and_any_lost_part_changes_it() -> None:
    epoch = "7:aa,bb:0123abcd"
    parts = split_epoch(epoch, 2)
    assert parts == ["7:aa:0123abcd", "7:bb:0123abcd"]
    assert compose_epoch(parts) == epoch
    assert split_epoch(epoch, 3) is None
    # One Redis flushed (its part gone), or brought back from an older snapshot (an older part).
    assert compose_epoch(["7:aa:0123abcd", None]) not in (epoch, None)
    older = compose_epoch(["7:aa:0123abcd", "5:bb:feed"])
    assert older != epoch
    assert older is not None
    assert older.split(":")[0] == "7"  # the new generation goes above the highest seen
    assert compose_epoch([None, None]) is None
    # An ACL that denies INFO: empty run ids still compose to what was set.
    assert compose_epoch(split_epoch("3:,:tok", 2) or []) == "3:,:tok"
    # A value not in the composed form is stored as it is on every Redis.
    assert compose_epoch(["e1", "e1"]) == "e1"


@pytest.mark.parametrize("command", ["forward", "worker", "status", "doctor"])
@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--redis-for", "nourl"], {}),
        (["--redis-for", "q=redis://u:s3cret@h:1/zz"], {}),
        ([], {"HYBRIDQ_REDIS_FOR": "a=redis://h:1/0,bad queue=redis://h:2/0"}),
    ],
)
def test_a_bad_entry_is_one_line_and_exit_1_before_anything_starts(
    tmp_path, command: str, args: list[str], env: dict[str, str]
) -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli

    journal = ["--journal", str(tmp_path / "j")] if command != "worker" else []
    result = CliRunner().invoke(cli, [command, *journal, *args], env=env)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hybridq: error: --redis-for"), lines
    assert "s3cret" not in result.output
    assert not (tmp_path / "j").exists()


def test_a_worker_given_queues_of_two_redis_is_told_to_run_one_per_redis() -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli

    env = {"HYBRIDQ_REDIS_FOR": "b=redis://127.0.0.1:1/0"}
    result = CliRunner().invoke(cli, ["worker", "--burst", "a", "b"], env=env)
    assert result.exit_code == 1
    assert "run one worker per Redis" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_the_map_is_part_of_the_composed_epoch() -> None:
    before = Routes("redis://a/0", {"emails": "redis://b/0", "reports": "redis://b/0"})
    moved = Routes("redis://a/0", {"reports": "redis://b/0"})  # emails: from b to a, b kept
    repassworded = Routes("redis://a/0", {"emails": "redis://:pw@b/0", "reports": "redis://:pw@b/0"})
    assert before.digest != moved.digest
    assert before.digest == repassworded.digest  # nothing moved
    epoch = f"4:aa,bb@{before.digest}:0123"
    parts = split_epoch(epoch, 2)
    assert parts == ["4:aa:0123", "4:bb:0123"]
    assert compose_epoch(parts, before.digest) == epoch
    assert compose_epoch(parts, moved.digest) != epoch


@pytest.mark.parametrize(("counts", "expected"), [((True, True), True), ((True, False), False)])
def test_a_sharded_transport_counts_limited_pushes_as_its_shards_do(
    counts: tuple[bool, bool], expected: bool
) -> None:
    """Each shard's push adds its limited copies itself: said as the sharded one's own, else a
    gate reading keys through it would add every copy a second time (docs/forwarder.md)."""
    from hybridq.transport.rq import RQTransport

    by_url = dict(zip(("redis://a", "redis://b"), counts, strict=True))

    def make(url: str) -> Transport:
        shard = MemoryTransport()
        shard.counts_limited_pushes = by_url[url]  # type: ignore[misc]
        return shard

    sharded = ShardedTransport(Routes("redis://a", {"beta": "redis://b"}), make=make)
    try:
        assert sharded.counts_limited_pushes is expected
    finally:
        sharded.close()
    assert RQTransport.counts_limited_pushes is True  # what each real shard says
