"""The stats' count a restart defers (hybridq.lookup.pending) while compaction deletes segments.

The count reads the journal a slice per step after the first push; compaction deleting the
segment it was about to read made ``step()`` raise FileNotFoundError and the forwarder exit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.reader import list_chains
from hybridq.testing.memory import MemoryTransport


def segments(journal: Path) -> int:
    return sum(len(v) for v in list_chains(str(journal)).values())


def test_compaction_waits_for_the_deferred_count(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    q = Queue(journal=journal_dir)
    with JournalWriter(journal_dir, max_segment_bytes=16 << 10) as w:
        for b in range(0, 6000, 100):
            w.append_many(q.prepare("tests.tasks.add", (i, i)).to_bytes() for i in range(b, b + 100))
    transport = MemoryTransport()
    f = Forwarder(journal_dir, transport, reconcile_interval_s=3600.0)
    f.open()
    for _ in range(5):
        f.step()
    f.close()
    f = Forwarder(journal_dir, transport, reconcile_interval_s=3600.0)
    f.open()
    try:
        f.state.count_pending(budget_s=0)  # a first slice: the count stops mid-chain
        with monkeypatch.context() as busy:
            busy.setattr(f.state, "count_pending", lambda *_a, **_k: None)  # later slices come later
            transport.work()
            for _ in range(3):
                f.completions.hurry(reconcile=False)
                f.step()
        f.step()  # the count goes on: it raised FileNotFoundError here
        while not f.state.pending_ready:
            f.step()
        assert sum(f.state.pending.pending.values()) == 0  # every job ran: none counted pending
        f.completions.hurry(reconcile=False)
        f.step()
        assert segments(journal_dir) <= 2  # and compaction runs once the count is done
    finally:
        f.close()
