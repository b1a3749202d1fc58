"""The pool worker's torture tier, its CI run (issue 26): a short seeded schedule of every fault.

Snapshot restarts, a pool cut off past the lease, warm and hard stops during bursts, take-ahead
backlogs, a lagging replica promoted, and GIL-holding tasks in the workload; the independent
checker (:mod:`hybridq.testing.torture_check`) fails it on a run after the ledger's finish, an
accepted job never run, or a stall. About 50 s. The long run is ``scripts/torture --duration
1800`` (docs/torture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.testing.torture import FAULTS, TortureConfig, run_torture

pytestmark = pytest.mark.timeout(240)


def test_the_pool_survives_every_torture_fault_with_no_run_after_the_ledgers_finish(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    cfg = TortureConfig(duration_s=30.0, seed=20261205, gap_s=2.5, rate=5.0, directory=str(tmp_path / "t"))
    result = run_torture(cfg, say=lambda _line: None)
    for line in result.lines():
        figures(f"torture seed={cfg.seed} {line}")
    assert result.verdict.after_finished == []
    assert result.verdict.never_ran == []
    assert result.verdict.stalls == []
    missing = [name for name in FAULTS if result.faults.get(name, 0) == 0]
    assert missing == [], f"faults never injected: {missing}"
    assert result.verdict.accepted > 200
