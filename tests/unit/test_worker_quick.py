"""Which tasks' claims send a started event (hybridq.worker.quick, docs/worker.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hybridq.worker import quick


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    quick._streaks.clear()
    quick._running.clear()
    quick._recent.clear()
    yield
    quick._streaks.clear()
    quick._running.clear()
    quick._recent.clear()


def _runs(func: str, n: int, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(quick.time, "monotonic", lambda: clock[0])
    for _ in range(n):
        token = quick.started(func)
        clock[0] += seconds
        quick.ran(func, token)


def test_a_task_is_quick_after_a_streak_of_quick_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    _runs("m.f", quick.STREAK - 1, 0.001, monkeypatch)
    assert not quick.is_quick("m.f")
    _runs("m.f", 1, 0.001, monkeypatch)
    assert quick.is_quick("m.f")
    assert not quick.is_quick("m.g")  # per task


def test_one_slow_run_makes_it_report_again(monkeypatch: pytest.MonkeyPatch) -> None:
    _runs("m.f", quick.STREAK, 0.001, monkeypatch)
    _runs("m.f", 1, quick.QUICK_S, monkeypatch)
    assert not quick.is_quick("m.f")
    _runs("m.f", quick.STREAK, 0.001, monkeypatch)
    assert quick.is_quick("m.f")


def test_a_long_run_in_flight_makes_claims_report_again(monkeypatch: pytest.MonkeyPatch) -> None:
    _runs("m.f", quick.STREAK, 0.001, monkeypatch)
    clock = [2000.0]
    monkeypatch.setattr(quick.time, "monotonic", lambda: clock[0])
    token = quick.started("m.f")
    assert quick.is_quick("m.f")  # just started: may still be quick
    clock[0] += 2 * quick.QUICK_S
    assert not quick.is_quick("m.f")  # running long: jobs claimed meanwhile say "started"
    quick.ran("m.f", token)
    assert not quick.is_quick("m.f")


def test_a_process_whose_last_runs_were_all_quick_takes_further_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _runs("m.f", quick.WINDOW - 1, 0.001, monkeypatch)
    assert not quick.all_quick()  # not enough runs seen yet
    _runs("m.g", 1, 0.001, monkeypatch)
    assert quick.all_quick()  # any task: the window is the process's
    _runs("m.f", 1, quick.QUICK_S, monkeypatch)
    assert not quick.all_quick()  # one slow run in the window
    _runs("m.g", quick.WINDOW - 1, 0.001, monkeypatch)
    assert not quick.all_quick()
    _runs("m.g", 1, 0.001, monkeypatch)
    assert quick.all_quick()  # the slow run left the window


def test_a_long_run_in_flight_stops_taking_further_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    _runs("m.f", quick.WINDOW, 0.001, monkeypatch)
    clock = [2000.0]
    monkeypatch.setattr(quick.time, "monotonic", lambda: clock[0])
    token = quick.started("m.h")
    assert quick.all_quick()
    clock[0] += 2 * quick.QUICK_S
    assert not quick.all_quick()
    quick.ran("m.h", token)
    assert not quick.all_quick()


def test_the_runner_takes_a_job_per_thread_four_ahead_while_runs_are_quick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hybridq.worker.runner import AHEAD, AHEAD_QUICK, Runner

    runner = Runner(3, 100, lambda _item: True, None, lambda _item: None, lambda _at: None)  # type: ignore[arg-type]
    try:
        assert runner.room() == AHEAD * 3 == 3
        _runs("m.f", quick.WINDOW, 0.001, monkeypatch)
        assert runner.room() == AHEAD_QUICK * 3 == 12
        _runs("m.f", 1, 1.0, monkeypatch)
        assert runner.room() == 3
    finally:
        runner.close()


def test_max_jobs_counts_the_jobs_given_and_those_done_but_not_yet_ended() -> None:
    # A process could run --max-jobs + 1 when finished jobs not yet ended were left out
    # (CI saw a process run 4 jobs with --max-jobs 3).
    from hybridq.worker.runner import Runner

    runner = Runner(3, 100, lambda _item: True, None, lambda _item: None, lambda _at: None)  # type: ignore[arg-type]
    try:
        assert runner.room(3) == 3
        runner.sync_pending = 1  # one job running
        runner.done.put(object())  # type: ignore[arg-type]  # one finished, its end not sent yet
        assert runner.room(3) == 1
        assert runner.room(2) == 0
        assert runner.room() == 2  # no --max-jobs: only the free threads (1 x 3 - 1)
    finally:
        runner.sync_pending = 0
        runner.close()
