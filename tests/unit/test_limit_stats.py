"""The per-key limits' figures: ``stats()``/``status --json``'s ``limit_keys``, ``doctor``'s line, the metrics."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from hybridq.forwarder.runs import RUNS_DIR, RUNS_FILE
from hybridq.lookup.stats import Snapshot
from hybridq.ops.limit_stats import LONG_WAIT_S, limit_figures, long_waits
from hybridq.ops.metrics import limit_metrics


def snapshot(blocked_since: float | None) -> Snapshot:
    snap = Snapshot()
    snap.limit_keys = {
        "tenant:1": {
            "policy": "concurrency:2",
            "running": 2,
            "queued": 0,
            "started": 0,
            "quarantine_s": 0.0,
            "room": 0,
            "blocked_since": blocked_since,
        }
    }
    return snap


def run_table(path: Path, keys: dict[str, int]) -> None:
    os.makedirs(path / RUNS_DIR)
    db = sqlite3.connect(path / RUNS_DIR / RUNS_FILE)
    db.execute("CREATE TABLE runs (queue TEXT, lkey TEXT NOT NULL DEFAULT '')")
    for key, n in keys.items():
        db.executemany("INSERT INTO runs VALUES ('q', ?)", [(key,)] * n)
    db.commit()
    db.close()


def test_the_figures_count_each_keys_waiting_jobs_from_the_run_table(tmp_path: Path) -> None:
    run_table(tmp_path, {"tenant:1": 7, "": 3})
    out = limit_figures(str(tmp_path), snapshot(time.time() - 30))["limit_keys"]
    assert out["tenant:1"]["waiting"] == 7
    assert out["tenant:1"]["policy"] == "concurrency:2"
    assert 29 <= out["tenant:1"]["waiting_on_limit_s"] < 60
    assert limit_figures(str(tmp_path), None) == {"limit_keys": {}}


def test_doctor_names_a_key_held_for_long_only_while_its_jobs_wait(tmp_path: Path) -> None:
    run_table(tmp_path, {"tenant:1": 1})
    assert long_waits(str(tmp_path), snapshot(time.time() - 60)) == []
    (line,) = long_waits(str(tmp_path), snapshot(time.time() - LONG_WAIT_S - 5))
    assert "tenant:1" in line
    assert "concurrency:2" in line
    assert long_waits(str(tmp_path / "none"), snapshot(time.time() - LONG_WAIT_S - 5)) == [], "none waits"


def test_the_metrics_per_limit_key() -> None:
    families = {f.name: f for f in limit_metrics(snapshot(time.time() - 10).limit_keys)}
    assert families["hybridq_limit_key_running"].samples[0].value == 2
    assert families["hybridq_limit_key_running"].samples[0].labels == {"key": "tenant:1"}
    assert 9 <= families["hybridq_limit_key_held_seconds"].samples[0].value < 60


def test_the_figures_count_each_fair_keys_waiting_jobs_from_the_run_tables_lanes(tmp_path: Path) -> None:
    from hybridq.forwarder.runs import RunTable
    from hybridq.forwarder.selector import Lanes, parse_fair_keys
    from hybridq.ops.limit_stats import fair_figures
    from hybridq.ops.metrics import fair_metrics

    runs = RunTable(str(tmp_path))
    runs.open()
    lanes = Lanes(parse_fair_keys(["tenant:*"]))
    runs.lanes(lanes.lane, lanes.signature)
    keys = ["tenant:1"] * 7 + ["tenant:2"] * 2 + ["other"] * 3 + [""] * 4
    runs.add((("w", 1, i), "q", float(i), 0, key) for i, key in enumerate(keys))
    runs.commit()
    try:
        out = fair_figures(str(tmp_path), snapshot(None))["fair_keys"]
    finally:
        runs.close()
    # The fair keys' lanes only (the rest of the queue is one lane, not a key); running where
    # the key is also a limit key the gate read.
    assert out == {"tenant:1": {"waiting": 7, "running": 2}, "tenant:2": {"waiting": 2, "running": None}}
    assert list(out) == ["tenant:1", "tenant:2"], "the most waiting first"
    assert fair_figures(str(tmp_path / "none"), None) == {"fair_keys": {}}
    (family,) = fair_metrics(out)
    assert family.name == "hybridq_fair_key_waiting"
    assert {s.labels["key"]: s.value for s in family.samples} == {"tenant:1": 7, "tenant:2": 2}
    assert list(fair_metrics({})) == []


def test_without_fair_keys_the_figures_read_no_row_and_with_them_a_scrape_reuses_a_recent_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Called on every metrics scrape and status: a scan of the whole run table each time (0.15-0.2
    # s a million rows) is paid only with fair keys, and then once per FAIR_TTL_S.
    from hybridq.forwarder.runs import RunTable
    from hybridq.forwarder.selector import Lanes, parse_fair_keys
    from hybridq.ops import limit_stats

    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        db = connect(*args, **kwargs)
        db.set_trace_callback(statements.append)
        return db

    runs = RunTable(str(tmp_path))
    runs.open()
    runs.add((("w", 1, i), "q", float(i), 0, "tenant:1") for i in range(3))
    runs.commit()
    monkeypatch.setattr(limit_stats.sqlite3, "connect", traced)
    try:
        assert limit_stats.fair_figures(str(tmp_path), None) == {"fair_keys": {}}
        assert not [s for s in statements if "FROM runs" in s], "scanned the run table without fair keys"
        lanes = Lanes(parse_fair_keys(["tenant:*"]))
        runs.lanes(lanes.lane, lanes.signature)
        statements.clear()
        for _ in range(3):
            assert limit_stats.fair_figures(str(tmp_path), None)["fair_keys"] == {
                "tenant:1": {"waiting": 3, "running": None}
            }
        assert len([s for s in statements if "FROM runs" in s]) == 1, "each scrape scanned the run table"
    finally:
        runs.close()
