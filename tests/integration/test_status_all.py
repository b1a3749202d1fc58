"""``hybridq status --all``: two journals, two ``hybridq forward`` processes, one Redis.

Each forwarder publishes its stats snapshot to Redis (``--stats-every``); ``status --all`` lists
both with their own counts, the totals add up, and a forwarder SIGKILLed is flagged stale once
its snapshot's TTL (three intervals) has passed, while the other stays fresh.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import Queue
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.testing.embedded import RedisServer

from tests import tasks
from tests.support.processes import ForwarderProcess, wait_until

EVERY = "0.3"  # --stats-every: a TTL of 0.9 s


def status_all(url: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridq", "status", "--all", "--redis", url, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def by_journal(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {Path(f["journal"]).name: f for f in out["forwarders"] if "journal" in f}


def test_status_all_lists_every_forwarder_and_flags_a_dead_one_stale(
    tmp_path: Path, redis_server: RedisServer, subprocess_env: dict[str, str]
) -> None:
    effects = tmp_path / "effects"
    counts = {"a": 12, "b": 7}
    journals = {name: tmp_path / name for name in counts}
    for name, n in counts.items():
        queue = Queue("shared", journal=journals[name])
        for i in range(n):
            queue.enqueue(tasks.record, str(effects), f"{name}{i}")
        Queue(f"only-{name}", journal=journals[name]).enqueue(tasks.record, str(effects), f"{name}-own")
    forwarders = {
        name: ForwarderProcess(
            journal,
            redis_server.url,
            env=subprocess_env,
            log_path=tmp_path / f"forward-{name}.log",
            extra_args=("--stats-every", EVERY),
        )
        for name, journal in journals.items()
    }
    try:

        def listed(want: dict[str, int], field: str) -> dict[str, Any] | None:
            for proc in forwarders.values():
                proc.assert_alive()
            out = hybridq.stats(all=True, redis_url=redis_server.url)  # what status --all --json prints
            seen = by_journal(out)
            return out if {k: seen[k][field] for k in seen} == want else None

        # Nothing ran yet: every job pending, each forwarder's own queue its own.
        out = wait_until(lambda: listed({k: n + 1 for k, n in counts.items()}, "pending"), what="both listed")
        seen = by_journal(out)
        for name, n in counts.items():
            assert seen[name]["accepted"] == n + 1
            assert seen[name]["queues"] == {"shared": n, f"only-{name}": 1}
            assert seen[name]["stale"] is False
            assert seen[name]["pid"] == forwarders[name].pid
        assert out["total"]["accepted"] == sum(counts.values()) + 2
        assert out["total"]["queues"]["shared"] == sum(counts.values())
        assert (out["fresh"], out["stale"], out["invalid"]) == (2, 0, 0)

        # One worker runs both journals' shared jobs: each forwarder counts its own.
        conn = redis_server.client()
        total = sum(counts.values())
        wait_until(lambda: conn.llen("rq:queue:shared") == total, what="every shared job pushed")
        conn.close()
        # The pool worker (not --simple: RQ's own worker can take a minute to tear its pubsub down).
        worker = subprocess.run(
            [sys.executable, "-m", "hybridq", "worker", "--burst", "--redis", redis_server.url, "shared"],
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert worker.returncode == 0, worker.stderr
        out = wait_until(lambda: listed(counts, "succeeded"), what="the outcomes counted")
        assert {k: f["pending"] for k, f in by_journal(out).items()} == {"a": 1, "b": 1}
        done = status_all(redis_server.url, subprocess_env, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["total"]["succeeded"] == sum(counts.values())

        # Forwarder a dies: flagged stale after its TTL; b stays fresh; exit 4.
        forwarders["a"].kill()

        wait_until(
            lambda: hybridq.stats(all=True, redis_url=redis_server.url)["stale"], timeout=10, what="a stale"
        )
        done = status_all(redis_server.url, subprocess_env)
        assert done.returncode == 4, done.stderr
        checkpoint = load_checkpoint(str(journals["a"]))
        assert checkpoint is not None
        stale_line = next(line for line in done.stdout.splitlines() if line.startswith("STALE"))
        assert checkpoint.owner in stale_line
        out = json.loads(status_all(redis_server.url, subprocess_env, "--json").stdout)
        assert (out["fresh"], out["stale"]) == (1, 1)
        assert set(by_journal(out)) == {"b"}  # a's snapshot expired: only its owner id and last seen
        assert out["total"]["accepted"] == counts["b"] + 1
    finally:
        for proc in forwarders.values():
            proc.kill()


def snapshot(**fields: Any) -> dict[str, Any]:
    """A snapshot as a forwarder publishes it (forged here: anyone who can write to Redis can)."""
    counts = ("accepted", "forwarded", "succeeded", "failed", "pending")
    zeros = ("not_yet_forwarded", "delayed_held", "retrying", "cancelled", "duplicates_suppressed")
    return {
        "v": 1,
        **dict.fromkeys(counts, 1),
        **dict.fromkeys(zeros, 0),
        "pid": 1,
        "host": "h",
        "journal": "/j",
        "queues": {"q": 1},
        "oldest_pending_age_s": 1.0,
        "forwarding_lag_s": 0.0,
        "every_s": 5.0,
        "ttl_s": 15.0,
        "published_at": 1.0,
        **fields,
    }


def test_status_all_shows_forged_snapshots_escaped_and_invalid_ones_as_invalid(
    redis_server: RedisServer,
) -> None:
    """Anyone who can write to Redis can write a snapshot: it is checked, escaped, never trusted."""
    from click.testing import CliRunner
    from hybridq.cli import cli
    from hybridq.protocol import keys

    good = snapshot(host="evil\x1b]0;pwned\x07host", queues={"q\x1b[2J": 1})
    conn = redis_server.client()
    forged = {
        "forged-ok": json.dumps(good),
        "not-json": "{",
        "negative": json.dumps({**good, "pending": -5}),
        "huge": "x" * 70_000,
    }
    for owner, body in forged.items():
        conn.set(keys.stats(owner), body, ex=60)
        conn.zadd(keys.forwarders(), {owner: 1.0})
    conn.close()
    result = CliRunner().invoke(cli, ["status", "--all", "--redis", redis_server.url])
    assert result.exit_code == 4, result.output
    assert "\x1b" not in result.output
    print(result.output)
    assert "evil\\x1b]0;pwned\\x07host" in result.output
    lines = {
        line.split()[1].rstrip(":"): line
        for line in result.output.splitlines()
        if line.startswith(("ok ", "INVALID ", "STALE "))
    }
    assert lines["forged-ok"].startswith("ok")
    assert all(lines[o].startswith("INVALID") for o in ("not-json", "negative", "huge"))
    out = hybridq.stats(all=True, redis_url=redis_server.url)
    assert (out["fresh"], out["invalid"], out["total"]["pending"]) == (1, 3, 1)


def test_status_all_needs_redis_and_says_so_in_one_line(redis_server: RedisServer) -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli

    result = CliRunner().invoke(cli, ["status", "--all"], env={"HYBRIDQ_REDIS_URL": ""})
    assert result.exit_code == 2
    assert "give --redis URL" in result.output
    port = redis_server.port
    redis_server.stop()
    result = CliRunner().invoke(cli, ["status", "--all", "--redis", f"redis://127.0.0.1:{port}/0"])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_serve_metrics_and_overview_show_every_forwarder_escaped(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A standalone ``hybridq serve --redis``: /metrics per journal, the overview's table, escaped."""
    from hybridq.http.config import ServeConfig
    from hybridq.protocol import keys

    from tests.support.http import request, served

    conn = redis_server.client()
    conn.set(keys.stats("fresh-one"), json.dumps(snapshot(host="<script>alert(1)</script>")), ex=60)
    conn.zadd(keys.forwarders(), {"fresh-one": time.time(), "gone": time.time() - 100})
    conn.close()
    config = ServeConfig(journal=tmp_path / "journal", redis_url=redis_server.url, port=0)
    with served(config) as base:
        metrics = request(base, "GET", "/metrics").raw.decode()
        overview = request(base, "GET", "/").raw.decode()
    assert (
        'hybridq_fleet_jobs{count="pending",forwarder="fresh-one",host="<script>alert(1)</script>",journal="/j"} 1.0'
        in metrics
    )
    assert 'hybridq_fleet_stale{forwarder="gone"} 1.0' in metrics
    assert 'hybridq_fleet_stale{forwarder="fresh-one"} 0.0' in metrics
    assert "hybridq_fleet_redis_up 1.0" in metrics
    assert "Every forwarder" in overview
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in overview
    assert "<script>alert" not in overview
    assert "STALE" in overview


def test_a_sharded_forwarder_publishes_to_its_default_redis(make_redis_server) -> None:
    """With --redis-for, status --all is given --redis (the default): the snapshot is there."""
    from hybridq.transport.routes import Routes
    from hybridq.transport.sharded import ShardedTransport

    default, other = make_redis_server(), make_redis_server()
    transport = ShardedTransport(Routes(default.url, {"far": other.url}))
    try:
        transport.publish_stats("owner-1", json.dumps(snapshot()).encode(), 30.0)
        assert [p.owner for p in transport.read_stats(10)] == ["owner-1"]
    finally:
        transport.close()
    assert [f["owner"] for f in hybridq.stats(all=True, redis_url=default.url)["forwarders"]] == ["owner-1"]
    assert hybridq.stats(all=True, redis_url=other.url)["forwarders"] == []


def test_what_a_forger_writes_breaks_no_view_and_fakes_no_line(redis_server: RedisServer) -> None:
    """Forged entries the review found breaking the view: each is listed (INVALID), the real one too.

    A lone surrogate in a string (it cannot be encoded: a traceback, /metrics 500), a key of
    another type (the whole read failed), a newline in a reason (a fake line), ages near the
    float maximum (``Infinity``: not JSON), a 1 MiB value (downloaded whole before the size
    check), an owner name of 100,000 characters, and 1,000 entries seen "in the future" that
    pushed the real forwarder out of the 1,000 read.
    """
    from click.testing import CliRunner
    from hybridq.cli import cli
    from hybridq.http.dashboard.fleet_view import fleet_section
    from hybridq.http.dashboard.templating import render
    from hybridq.http.metrics import FleetCollector
    from hybridq.protocol import keys
    from hybridq.transport.rq import RQTransport
    from prometheus_client import CollectorRegistry, generate_latest

    conn = redis_server.client()
    transport = RQTransport(redis_server.url)
    transport.publish_stats("real", json.dumps(snapshot(pending=7, queues={"q": 7})).encode(), 60)
    transport.close()
    now = time.time()
    forged = {
        "surrogate": json.dumps(snapshot(host="\ud800", queues={"\udfff": 1})),
        "newline": json.dumps(snapshot(queues={"q\nok      fake-line": -1})),
        "huge-ages": json.dumps(snapshot(ttl_s=1.7e308, oldest_pending_age_s=1.7e308)),
        "big": "x" * (1 << 20),
        "o" * 100_000: json.dumps(snapshot()),
    }
    for owner, body in forged.items():
        conn.set(keys.stats(owner), body, ex=60)
        conn.zadd(keys.forwarders(), {owner: now})
    conn.hset(keys.stats("wrongtype"), "a", "b")
    conn.zadd(keys.forwarders(), {"wrongtype": now})
    conn.zadd(keys.forwarders(), {f"ghost{i}": 1e18 for i in range(1000)})
    sent_before = int(conn.info("stats")["total_net_output_bytes"])
    out = hybridq.stats(all=True, redis_url=redis_server.url)
    sent = int(conn.info("stats")["total_net_output_bytes"]) - sent_before
    conn.close()
    assert sent < 400_000, f"{sent} bytes read for a view of 7 entries (the 1 MiB value downloaded?)"
    listed = {f["owner"][:20]: f for f in out["forwarders"]}
    assert "real" in listed, "the real forwarder was pushed out by entries seen in the future"
    assert not any(o.startswith("ghost") for o in listed)
    assert out["total"]["pending"] == 7 + 1  # the real one and the surrogate's (shown escaped)
    assert listed["surrogate"]["host"] == "\\ud800"
    for owner in ("newline", "huge-ages", "big", "o" * 20, "wrongtype"):
        assert "invalid" in listed[owner], listed[owner]
    json.loads(json.dumps(out, allow_nan=False))  # no Infinity anywhere
    result = CliRunner().invoke(cli, ["status", "--all", "--redis", redis_server.url])
    assert result.exit_code == 4, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        result.output
    )
    lines = result.output.splitlines()
    assert all(line.startswith(("ok ", "INVALID ", "STALE ", "        ", "total ")) for line in lines), lines
    assert not any(line.startswith("ok      fake-line") for line in lines)
    result = CliRunner().invoke(cli, ["status", "--all", "--json", "--redis", redis_server.url])
    json.loads(result.output, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    registry = CollectorRegistry()
    registry.register(FleetCollector(redis_server.url))
    metrics = generate_latest(registry).decode()
    assert "hybridq_fleet_redis_up 1.0" in metrics
    render("sections/fleet.html", section=fleet_section(redis_server.url)).encode()  # no surrogate left


def test_status_all_forget_removes_a_forwarder_scaled_down(redis_server: RedisServer) -> None:
    """A removed forwarder was listed STALE (and alerted on) for a week: --forget drops it now."""
    from click.testing import CliRunner
    from hybridq.cli import cli
    from hybridq.transport.rq import RQTransport

    transport = RQTransport(redis_server.url)
    transport.publish_stats("gone", json.dumps(snapshot()).encode(), 0.001)
    transport.publish_stats("kept", json.dumps(snapshot()).encode(), 60)
    transport.close()
    base = ["status", "--all", "--redis", redis_server.url]
    result = CliRunner().invoke(cli, [*base, "--forget", "gone"])
    assert (result.exit_code, result.output) == (0, "forgot gone\n")
    assert [f["owner"] for f in hybridq.stats(all=True, redis_url=redis_server.url)["forwarders"]] == ["kept"]
    result = CliRunner().invoke(cli, [*base, "--forget", "gone"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == ["hybridq: error: no forwarder 'gone' in the view"]
    result = CliRunner().invoke(cli, ["status", "--forget", "kept", "--journal", "/nonexistent"])
    assert result.exit_code == 2
    assert "--forget needs --all" in result.output
