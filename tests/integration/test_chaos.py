"""The CI tier of ``hybridq chaos`` (S1, S2, S8-S12 over real processes), and the harness's own test.

The short schedule runs every fault class once or more with a fixed seed; the soak tier is the
same harness for longer (``scripts/chaos --duration 1800``, docs/reliability.md). The harness
is tested against broken forwarders (a ``sitecustomize`` that patches hybridq in every child
process): a harness that cannot see a loss or a re-execution proves nothing.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.testing.chaos import FAULTS, ChaosConfig, ChaosResult, run_chaos

pytestmark = pytest.mark.timeout(400)


def _run(tmp_path: Path, **options: object) -> ChaosResult:
    options = {"gap_s": 1.5, "drain_s": 60.0, "rate": 6.0, **options}
    cfg = ChaosConfig(directory=str(tmp_path / "chaos"), **options)  # type: ignore[arg-type]
    return run_chaos(cfg, say=lambda _line: None)


def test_every_fault_class_loses_nothing_and_reruns_no_finished_job(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    result = _run(tmp_path, duration_s=70.0, seed=20261130)
    for stats in result.per_fault.values():
        figures(f"chaos seed={result.seed} {stats.line()}")
    figures(f"chaos seed={result.seed} {result.total_line()}")
    assert result.violations == []
    assert result.lost_tokens == []
    assert result.failed == {}
    assert result.ok
    assert result.accepted > 300
    missing = [name for name in FAULTS if result.per_fault[name].injected == 0]
    assert missing == [], f"fault classes never injected: {missing}"
    assert result.status["pending"] == 0
    assert result.status["failed"] == 0


def _break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patch: str) -> None:
    """Apply ``patch`` in every Python process the harness starts (forwarder, workers, producers)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(patch))
    monkeypatch.setenv("PYTHONPATH", str(site))


def test_the_harness_sees_a_forwarder_that_loses_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Callable[[str], None]
) -> None:
    # No epoch check and no reconcile passes: what Redis forgets is never delivered again.
    _break(
        tmp_path,
        monkeypatch,
        """
        from hybridq.forwarder.reconcile import Reconciler as Completions
        Completions.check_epoch = lambda self: None
        Completions.reconcile_step = lambda self: []
        """,
    )
    # (A drain of 6 s without progress: a lost job never finishes, so the drain always ran to
    # its end; 20 s of it cost 14 s of the default run for nothing.)
    result = _run(tmp_path, duration_s=14.0, seed=7, faults=("redis-restart", "flushall"), drain_s=6.0)
    figures(f"chaos mutant=forgets-redis-loss {result.total_line()}")
    assert result.lost > 0
    assert not result.ok


def test_the_harness_sees_a_forwarder_that_reruns_finished_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Callable[[str], None]
) -> None:
    # The ledger ignored: after Redis loses its data, every job is delivered again, long-finished
    # ones included, and nothing is left to stop them from running.
    _break(
        tmp_path,
        monkeypatch,
        """
        from hybridq.ledger.store import LedgerIndex
        LedgerIndex.is_terminal = lambda self, loc: False
        """,
    )
    result = _run(tmp_path, duration_s=24.0, seed=8, faults=("flushall",), gap_s=10.0, drain_s=6.0)
    figures(f"chaos mutant=ignores-ledger {result.total_line()}")
    assert result.dup_execution > 0
    assert not result.ok
