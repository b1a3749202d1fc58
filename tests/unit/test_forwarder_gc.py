"""The collector's pace while the forwarder's loop runs (hybridq.forwarder.gcpolicy).

The loop collects the youngest generation less often (a tenth of its CPU per job went to the
collector, docs/benchmarks.md), and leaves the process's thresholds as it found them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder.gcpolicy import GEN0_THRESHOLD, fewer_collections
from hybridq.forwarder.loop import Forwarder
from hybridq.transport import MemoryTransport

from tests import tasks


@pytest.fixture(autouse=True)
def thresholds() -> Iterator[tuple[int, int, int]]:
    """The process's thresholds, put back after each test whatever it did."""
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_the_youngest_generation_waits_longer_inside_and_is_put_back_after() -> None:
    gc.set_threshold(700, 10, 10)
    with fewer_collections():
        assert gc.get_threshold() == (GEN0_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_an_applications_own_pace_is_kept() -> None:
    for own in ((50_000, 10, 10), (0, 10, 10)):  # higher already; 0: automatic collection off
        gc.set_threshold(*own)
        with fewer_collections():
            assert gc.get_threshold() == own
        assert gc.get_threshold() == own


def test_put_back_when_the_block_raises() -> None:
    gc.set_threshold(700, 10, 10)
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10)


def test_overlapping_loops_put_the_thresholds_back_once_the_last_leaves() -> None:
    gc.set_threshold(700, 10, 10)
    first, second = fewer_collections(), fewer_collections()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gc.get_threshold() == (GEN0_THRESHOLD, 10, 10), "the second loop still runs"
    second.__exit__(None, None, None)
    assert gc.get_threshold() == (700, 10, 10)


def test_the_forwarders_loop_runs_at_that_pace_and_puts_it_back(journal_dir: Path) -> None:
    gc.set_threshold(700, 10, 10)
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = Forwarder(journal_dir, transport)
    forwarder.open()
    seen: list[tuple[int, int, int]] = []
    step = forwarder.step

    def one_step() -> int:
        seen.append(gc.get_threshold())
        done = step()
        forwarder.stop()
        return done

    forwarder.step = one_step  # type: ignore[method-assign]
    try:
        forwarder.run()
    finally:
        forwarder.close()
    assert seen == [(GEN0_THRESHOLD, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)
    assert len(transport.queues["default"]) == 1
