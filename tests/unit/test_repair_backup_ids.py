"""A repair's backup of a ledger segment holds its ids file (docs/journal.md, "Entries punched out
of pinned ledger segments"): without it, a segment the repair moves aside loses its kept ids.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridq.journal import OS_FILEOPS, repair_apply
from hybridq.journal.format import segment_name
from hybridq.ledger.punched_ids import IDS_SUFFIX, PunchedId, read_ids, write_ids


def test_the_backup_of_a_ledger_segment_copies_its_ids_file(tmp_path: Path) -> None:
    """Failed before this fix: only the hole map was copied."""
    ledger, backup = tmp_path / "ledger", tmp_path / "backup"
    ledger.mkdir()
    backup.mkdir()
    ids = [PunchedId("a" * 32, ("w1", 3, 64), "default", result_kept=True, at=1_700_000_000)]
    write_ids(str(ledger), "l1", 0, ids)
    segment = os.path.join(ledger, segment_name("l1", 0))
    repair_apply._backup_holes(OS_FILEOPS, str(backup), segment)
    assert read_ids(str(backup), "l1", 0) == ids


def test_the_repair_names_the_ids_suffix_the_ledger_writes() -> None:
    assert repair_apply.IDS_SUFFIX == IDS_SUFFIX  # the journal package may not import the ledger's
