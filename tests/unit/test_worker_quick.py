"""Which tasks' claims send a started event (hybridq.worker.quick, docs/worker.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hybridq.worker import quick


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    quick._streaks.clear()
    yield
    quick._streaks.clear()


def test_a_task_is_quick_after_a_streak_of_quick_runs() -> None:
    for _ in range(quick.STREAK - 1):
        quick.ran("m.f", 0.001)
    assert not quick.is_quick("m.f")
    quick.ran("m.f", 0.001)
    assert quick.is_quick("m.f")
    assert not quick.is_quick("m.g")  # per task


def test_one_slow_run_makes_it_report_again() -> None:
    for _ in range(quick.STREAK):
        quick.ran("m.f", 0.001)
    quick.ran("m.f", quick.QUICK_S)
    assert not quick.is_quick("m.f")
    for _ in range(quick.STREAK):
        quick.ran("m.f", 0.001)
    assert quick.is_quick("m.f")
