"""The torture tier's checker sees what it must (a checker that cannot fail proves nothing)."""

from __future__ import annotations

import time

import pytest
from hybridq.testing import torture
from hybridq.testing.torture_check import Progress, Run, judge
from hybridq.testing.torture_stack import HarnessError, _wait_synced


def run(kind: str, job: str, at: float, pid: int = 1) -> Run:
    return Run(kind, job, f"t-{job}", 1, pid, at)


def test_a_run_that_starts_after_the_ledger_held_its_job_finished_is_a_violation() -> None:
    runs = {
        "j": [run("B", "j", 1.0), run("E", "j", 1.5), run("B", "j", 3.0, pid=2), run("E", "j", 3.1, pid=2)]
    }
    verdict = judge(["j"], runs, {"j": 2.0})
    assert len(verdict.after_finished) == 1
    assert not verdict.ok


def test_a_repeat_before_the_ledger_had_it_is_explained_not_a_violation() -> None:
    runs = {
        "j": [run("B", "j", 1.0), run("E", "j", 1.5), run("B", "j", 3.0, pid=2), run("E", "j", 3.1, pid=2)],
        "k": [run("B", "k", 1.0), run("B", "k", 2.0, pid=2), run("E", "k", 2.5, pid=2)],
    }
    verdict = judge(["j", "k"], runs, {"j": 3.5, "k": 3.0})
    assert verdict.ok
    assert verdict.repeats == {
        "finished, not yet in the ledger when Redis lost its outcome": 1,
        "running when its lease was lost (or its process killed)": 1,
    }


def test_an_accepted_job_never_run_to_its_end_is_a_violation() -> None:
    verdict = judge(
        ["j", "k"], {"j": [run("B", "j", 1.0), run("E", "j", 1.1)], "k": [run("B", "k", 1.0)]}, {}
    )
    assert verdict.never_ran == ["k"]
    assert not verdict.ok


def test_a_stall_is_noted_once_per_stretch() -> None:
    progress = Progress(stall_s=0.05)
    progress.check(ended=3, waiting=5)
    time.sleep(0.1)
    progress.check(ended=3, waiting=5)
    progress.check(ended=3, waiting=5)
    assert len(progress.stalls) == 1
    progress.check(ended=4, waiting=4)  # progress again
    assert len(progress.stalls) == 1


def test_a_replica_that_never_syncs_is_a_harness_failure_not_a_promotion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review of i26-fix, item 5: it returned quietly after its wait, and the master was killed anyway."""

    class Loading:
        def info(self) -> dict[str, object]:
            return {"master_link_status": "down", "loading": 1}

    monkeypatch.setattr(time, "sleep", lambda _s: None)
    with pytest.raises(HarnessError, match="did not load its master's data"):
        _wait_synced(Loading(), timeout_s=0.05)


def test_the_torture_command_says_a_harness_failure_in_one_line_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(*_a: object, **_k: object) -> None:
        raise HarnessError("the replica did not load its master's data in 30 s")

    monkeypatch.setattr(torture, "run_torture", fail)
    assert torture.main(["--seed", "7", "--duration", "1"]) == 2
    out = capsys.readouterr().out
    assert "HARNESS FAILURE seed=7: the replica did not load" in out
