"""``scripts/bench-burn --faults`` (throughput under faults): a short run, and its verdict's rules.

The benchmark itself is a separate command (docs/benchmarks.md, "Throughput under faults"); this
is its smoke test (1,000 jobs, one fault of each kind: about 10 s here) and a check that its
verdict counts a lost job and a finished job run again, and excuses only what ``hybridq chaos``
excuses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hybridq.testing.topology import Fault

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def faults_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import burndown_faults

    return burndown_faults


def test_the_verdict_counts_losses_and_unexcused_reruns(faults_module: Any) -> None:
    log = [Fault("worker-kill", 101.0, 101.6, (7,)), Fault("flushall", 200.0, 200.01)]
    runs = {
        "once": [(1, 50.0)],
        "killed-before-its-outcome": [(7, 100.5), (8, 103.0)],  # ended 0.5 s before its process died
        "in-the-window": [(1, 198.5), (2, 203.0)],  # ended 1.5 s before FLUSHALL
        "long-finished": [(1, 150.0), (2, 204.0)],  # 50 s before FLUSHALL: in the ledger long since
        "other-process": [(9, 100.0), (8, 102.0)],  # pid 9 was never killed
    }
    ids = {*runs, "never-ran"}
    status = {"accepted": 6, "succeeded": 5, "failed": 0, "pending": 1, "duplicates_suppressed": 0}
    v = faults_module.verdict(ids, SimpleNamespace(runs=runs), log, status)
    assert v["never_ran"] == 1
    assert v["lost"] == 1
    assert v["excused_reruns"] == {"worker-kill": 1, "flushall": 1}
    assert v["dup_execution"] == 2
    assert {line.split()[0] for line in v["violations"]} == {"long-finished", "other-process"}
    assert v["faults"] == {"worker-kill": 1, "flushall": 1}


def test_a_short_burn_down_under_every_fault_loses_nothing_and_reruns_nothing(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    out = tmp_path / "faults.json"
    argv = [sys.executable, str(BENCH / "burndown.py"), "--faults", "--n", "1000", "--count", "4"]
    argv += [
        "--no-baseline",
        "--seed",
        "20261201",
        "--drain",
        "30",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    run = doc["rows"]["faults"]
    figures(
        f"bench-burn --faults n=1000 jobs_per_s={run['jobs_per_s']} lost={run['lost']} "
        f"dup_execution={run['dup_execution']} excused={run['excused_reruns']} faults={run['faults']}"
    )
    assert doc["ok"]
    assert run["faults"] == {"worker-kill": 1, "redis-restart": 1, "flushall": 1, "forwarder-kill": 1}
    assert (run["lost"], run["never_ran"], run["dup_execution"], run["unknown_ran"]) == (0, 0, 0, 0)
    assert run["ledger"]["succeeded"] == 1000
    assert run["ledger"]["pending"] == 0
