"""``scripts/bench-selection`` (bench/selection.py) runs: a smoke test with tiny tables.

The benchmark itself is a separate command (docs/benchmarks.md); its gate variant once failed on
its first refill and nobody noticed until a review ran it. This runs every variant over 200 rows
(well under a second here) and checks each takes what it is asked, the gate's refused keys left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"
VARIANTS = ["before", "no keys", "10k keys", "10k keys, fair", "10k keys, gate"]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def selection(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import selection

    return selection


def test_the_benchmark_runs_every_variant_with_tiny_arguments() -> None:
    argv = [
        sys.executable,
        str(BENCH / "selection.py"),
        "--rows",
        "200",
        "--batch",
        "50",
        "--rounds",
        "1",
        "--json",
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.splitlines()[-1])
    assert list(figures) == VARIANTS
    assert all(f["add_us"] > 0 and f["take_us"] > 0 for f in figures.values()), figures


def test_each_variant_takes_what_it_is_asked(selection: Any, tmp_path: Path) -> None:
    variants = [
        selection.Old(str(tmp_path / "old")),
        selection.New("no keys", str(tmp_path / "plain"), keys=False),
        selection.New("10k keys", str(tmp_path / "keys"), keys=True),
        selection.New("10k keys, fair", str(tmp_path / "fair"), keys=True, fair=True),
        selection.New("10k keys, gate", str(tmp_path / "gate"), keys=True, gate=True),
    ]
    try:
        for v in variants:
            v.add(0, 200)
            assert v.take(50) == 50, v.name
        gate = variants[-1]
        # Every key the gate refuses is still waiting: 200 rows, taken until none is left.
        taken = 50 + gate.take(200)
        refused = sum(selection.key_of(i).endswith("3") for i in range(200))
        assert taken == 200 - refused
    finally:
        for v in variants:
            v.close()
