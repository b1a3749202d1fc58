"""A reconcile pass reads at most ``SCAN_BUDGET`` records per step (issue 29).

Over a long backlog most records are jobs waiting in the run table (no candidate): a pass read
the whole journal in one step, and the harvest and the refill waited for it (4 s at a million
jobs). The pass now goes on at the next step instead; it still reaches every record.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder import reconcile
from hybridq.forwarder.loop import Forwarder
from hybridq.transport import MemoryTransport

from tests import tasks


def test_a_pass_reads_at_most_the_budget_per_step(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(50):
        queue.enqueue(tasks.add, i, i)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()  # all 50 pushed (the memory transport has no window)
        reconciler = forwarder.completions.reconciler
        monkeypatch.setattr(reconcile, "SCAN_BUDGET", 10)
        read: list[int] = []
        candidate = reconciler._candidate

        def counting(record, **kwargs):  # type: ignore[no-untyped-def]
            read[-1] += 1
            return candidate(record, **kwargs)

        monkeypatch.setattr(reconciler, "_candidate", counting)
        reconciler._start_pass(refill=True)
        steps = 0
        while reconciler.refilling:
            read.append(0)
            reconciler.reconcile_step()
            steps += 1
        assert max(read) <= 10
        assert sum(read) == 50  # every record, once
        assert steps == 6  # five full steps, and one that finds the end
