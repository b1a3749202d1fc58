"""Compaction decodes only failures, requeue marks and the one ledger segment it may delete.

Issue 29: after a long drain the ledger holds a million successes, and each compaction read
every entry of it into memory (the forwarder's RSS peaked at 698 MB over a 1,000,000-job
drain). Counted here: the entries decoded by a compaction pass, not its time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq.journal.reader import list_chains
from hybridq.ledger import store
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import open_ledger_writer, read_ledger_failures, read_ledger_segment

JOBS = 3_000


def _ledger(journal: Path) -> None:
    writer = open_ledger_writer(str(journal))
    outcomes = ["succeeded"] * (JOBS - 2) + ["failed"]
    entries = [Entry("done", f"j{i}", ("w", 0, 64 + i), outcome=o, at=1.0) for i, o in enumerate(outcomes)]
    entries.append(Entry("requeued", "j1", ("w", 0, 65), at=2.0))
    writer.append_many(e.to_bytes() for e in entries)
    writer.close()


def test_the_failures_pass_decodes_only_failures_and_requeues(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ledger(journal_dir)
    decoded: list[bytes] = []
    real = Entry.from_bytes

    def counting(raw: bytes) -> Entry:
        decoded.append(raw)
        return real(raw)

    monkeypatch.setattr(store.Entry, "from_bytes", staticmethod(counting))
    found = [e for _, e in read_ledger_failures(str(journal_dir))]
    assert sorted(e.kind for e in found) == ["done", "requeued"]
    assert found[0].outcome == "failed" or found[1].outcome == "failed"
    assert len(decoded) == 2  # not the 2,998 successes


def test_a_segment_is_read_alone(journal_dir: Path) -> None:
    _ledger(journal_dir)
    chains = list_chains(store.ledger_dir(str(journal_dir)))
    ((writer, indices),) = chains.items()
    total = sum(len(read_ledger_segment(str(journal_dir), writer, i)) for i in indices)
    assert total == JOBS
