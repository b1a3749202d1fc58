"""What keeps a ledger segment and its ids file, and what removes the file (docs/journal.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq.journal.format import segment_name
from hybridq.journal.reader import list_chains
from hybridq.ledger import store
from hybridq.ledger.punched_ids import PunchedId, find_punched, named_segments, remove_orphans, write_ids
from hybridq.ledger.segment_scan import all_gone, scan_ledger_segment
from hybridq.ledger.store import ledger_dir

from tests.unit.test_punch_lookup import _punched_journal, _run


def test_a_fully_punched_ledger_segment_stays_while_its_journal_is_pinned(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ids name the pinned journal segment: the scan's reach keeps the ledger segment."""
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    _queue, _ids, transport = _punched_journal(journal_dir)
    _run(journal_dir, transport, 20).close()
    ledger = ledger_dir(str(journal_dir))
    seg, kept = next(iter(find_punched(ledger)))
    named = named_segments(ledger, *seg)
    assert (kept.loc[0], kept.loc[1]) in named
    reach = scan_ledger_segment(str(journal_dir), *seg).reach
    assert reach.get(kept.loc[0], -1) >= kept.loc[1]
    journal_segs = {(w, i) for w, indices in list_chains(str(journal_dir)).items() for i in indices}
    assert (kept.loc[0], kept.loc[1]) in journal_segs  # pinned: still there
    assert not all_gone(reach, lambda s: s not in journal_segs)
    assert seg[1] in list_chains(ledger)[seg[0]]  # so the ledger segment stays, its ids with it


def test_remove_orphans_removes_only_the_files_of_deleted_segments(tmp_path: Path) -> None:
    """An ids file outlives its deleted ledger segment only until the next pass."""
    ledger = str(tmp_path)
    kept = PunchedId("job-a", ("w" * 16, 0, 10), "default", result_kept=True, at=1)
    write_ids(ledger, "a" * 16, 1, [kept])
    write_ids(ledger, "a" * 16, 2, [kept])
    assert remove_orphans(ledger, {("a" * 16, 1), ("a" * 16, 2)}) == 0
    assert remove_orphans(ledger, {("a" * 16, 2)}) == 1
    assert not (tmp_path / (segment_name("a" * 16, 1) + ".ids.state")).exists()
    assert [seg for seg, _ in find_punched(ledger)] == [("a" * 16, 2)]
