"""The counts a start reads: the stats' count a restart defers, the run table's kept counts.

The deferred count (hybridq.lookup.pending) reads the journal a slice per step after the first
push; compaction deleting the segment it was about to read made ``step()`` raise
FileNotFoundError and the forwarder exit. ``status`` without a forwarder counted every row of
the run table.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.forwarder.runs import RunTable
from hybridq.journal import JournalWriter
from hybridq.journal.reader import list_chains
from hybridq.ops.window_stats import window_figures
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
    (journal_dir / "lookup" / "pending.state").unlink()  # as after a crash: counted again
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


def test_status_without_a_forwarder_reads_the_kept_counts_not_every_row(tmp_path: Path) -> None:
    # ``status`` with no forwarder's snapshot counted the run table with a GROUP BY over every
    # row (about 3 s at a million); the file keeps its counts per queue and priority.
    table = RunTable(str(tmp_path))
    table.open()
    table.add((("w", 0, 64 + i), "q", 100.0 + i, i % 2, "") for i in range(10))
    table.commit()
    table.close()
    db = sqlite3.connect(table.path)
    with db:
        db.execute("UPDATE counts SET n = n * 1000")  # told apart from a count of the rows
    db.close()
    detail = window_figures(str(tmp_path), None, exact=True)["queue_detail"]["q"]
    assert (detail["backlog"], detail["waiting_by_priority"]) == (10_000, {"1": 5000, "0": 5000})
    assert detail["oldest_waiting_age_s"] > 0
