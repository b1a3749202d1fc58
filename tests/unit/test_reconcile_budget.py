"""A reconcile pass reads at most ``PROBE_BATCH`` records per step (issue 29).

A pass reads the records of the jobs the forwarder pushed (hybridq.forwarder.pushed), a batch
per step: the harvest and the refill never wait for a whole pass. It still reaches every job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder import reconcile
from hybridq.forwarder.loop import Forwarder
from hybridq.transport import MemoryTransport

from tests import tasks


def test_a_pass_reads_at_most_a_batch_per_step(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(50):
        queue.enqueue(tasks.add, i, i)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()  # all 50 pushed (the memory transport has no window)
        reconciler = forwarder.completions.reconciler
        monkeypatch.setattr(reconcile, "PROBE_BATCH", 10)
        read: list[list[tuple[str, int, int]]] = []
        original = reconcile.read_pushed

        def counting(journal, loc):  # type: ignore[no-untyped-def]
            read[-1].append(loc)
            return original(journal, loc)

        monkeypatch.setattr(reconcile, "read_pushed", counting)
        reconciler._start_pass(refill=True)
        steps = 0
        while reconciler.refilling:
            read.append([])
            reconciler.reconcile_step()
            steps += 1
        assert max(len(r) for r in read) <= 10
        every = [loc for r in read for loc in r]
        assert len(every) == len(set(every)) == 50  # every job, once
        assert steps == 6  # five full steps, and one that finds the end
