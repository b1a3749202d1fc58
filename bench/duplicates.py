"""Pending duplicates of one pending owner: what they cost the forwarder (issue 29).

A ``ForwarderState`` admits a job owning key ``k``, then ``--duplicates`` jobs with that key
(1,000 per step, each step's ``Admission.flush``, which settles), and reports:

  * ``bytes/dup``: tracemalloc bytes per pending duplicate over the admissions;
  * ``admit_flush_us``: CPU µs per duplicate of 10,000 more admitted (without tracemalloc);
  * ``settle_ms``: CPU ms of ``Admission.settle`` after 100 other jobs finished (a delivered
    batch), median and least of 20;
  * ``member_us``: CPU µs of ``loc in index.duplicates`` for a pending duplicate, a job of
    another segment, and a job read after the last duplicate of the same segment;
  * ``saved_kb``: the saved index's size after a clean stop.

Runs against whatever ``hybridq`` is importable: by its path with PYTHONPATH set to each tree
(``PYTHONPATH=TREE python TREE/bench/duplicates.py``). CPU time (``time.process_time``), not
wall clock.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from hybridq.envelope.model import Envelope
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from tests.unit import test_ledger_replay


def _env(job_id: str) -> Envelope:
    return Envelope(id=job_id, func="m.f", queue="q", idempotency_key="k", created_at=0.0)


def _member_us(state: ForwarderState, loc: tuple[str, int, int]) -> float:
    started = time.process_time()
    for _ in range(10_000):
        _ = loc in state.index.duplicates
    return (time.process_time() - started) / 10_000 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duplicates", type=int, default=100_000)
    n = parser.parse_args().duplicates
    with tempfile.TemporaryDirectory() as tmp:
        journal, writer = test_ledger_replay.journal_of_three_segments(Path(tmp))
        state = ForwarderState(journal, ForwarderConfig())
        state.load()
        admission = Admission(state)
        assert admission.admit(_env("owner"), (writer, 0, 32))
        admission.flush()

        def admit(start: int, stop: int) -> None:
            for lo in range(start, stop, 1000):
                for i in range(lo, lo + 1000):
                    assert not admission.admit(_env(f"d{i}"), (writer, 1, 32 + 200 * i))
                admission.flush()

        gc.collect()
        tracemalloc.start()
        admit(0, n)
        gc.collect()
        grown, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        started = time.process_time()
        admit(n, n + 10_000)
        admit_us = (time.process_time() - started) / 10_000 * 1e6
        admission.settle()
        times = []
        for step in range(20):
            for i in range(100):
                state.index.apply_succeeded((writer, 2, 32 + 1000 * step + i))
            started = time.process_time()
            admission.settle()
            times.append(time.process_time() - started)
        pending = _member_us(state, (writer, 1, 32 + 200 * 7))
        other = _member_us(state, (writer, 2, 32))
        later = _member_us(state, (writer, 1, 32 + 200 * (n + 20_000)))
        state.close()
        saved_kb = os.path.getsize(os.path.join(journal, "ledger-index.state")) / 1024
    print(
        f"duplicates={n} bytes/dup={grown / n:.1f} admit_flush_us={admit_us:.1f} "
        f"settle_ms_median={statistics.median(times) * 1000:.3f} settle_ms_min={min(times) * 1000:.3f} "
        f"member_us pending={pending:.2f} other_segment={other:.2f} read_after={later:.2f} "
        f"saved_kb={saved_kb:.0f}"
    )


if __name__ == "__main__":
    main()
