"""The CI tier of ``hybridq chaos`` (S1, S2, S8-S12 over real processes), and the harness's own test.

The default run's schedule (45 s, faults 1 s apart on average) runs every fault class once or more
with a fixed seed; the chaos tier (``-m chaos``) is the 70-second schedule (1.5 s apart) whose
figures docs/reliability.md shows, and the soak tier is the same harness for longer
(``scripts/chaos --duration 1800``, docs/reliability.md). The harness
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


#: The default run's schedule: the same seed, its gaps two thirds of the tier's. Its first round
#: of all 15 fault classes has begun its last fault by about 35 s (34.5 s measured while the S18
#: test ran beside it, load average 2.7): 45 s leaves a fourth of that to spare. The tier's
#: 1.5 s gaps need about 42 s for the same round.
DEFAULT = {"duration_s": 45.0, "gap_s": 1.0}
#: The chaos tier (``-m chaos``): the 70-second schedule docs/reliability.md reports.
TIER = {"duration_s": 70.0, "gap_s": 1.5}


def test_every_fault_class_loses_nothing_and_reruns_no_finished_job(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    _every_fault_class(tmp_path, figures, **DEFAULT)


@pytest.mark.chaos
def test_the_tiers_70_second_schedule_loses_nothing_and_reruns_no_finished_job(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    _every_fault_class(tmp_path, figures, **TIER)


def _every_fault_class(tmp_path: Path, figures: Callable[[str], None], **schedule: float) -> None:
    result = _run(tmp_path, seed=20261130, **schedule)
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
    # its end; 20 s of it cost 14 s of the default run for nothing.) 8 s of faults 1.5 s apart (the
    # first at 1.2 s with this seed) leave jobs queued in a Redis that forgets them: lost=11 in a
    # run measured (14 s cost 6 s more for nothing more proven).
    result = _run(tmp_path, duration_s=8.0, seed=7, faults=("redis-restart", "flushall"), drain_s=6.0)
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
