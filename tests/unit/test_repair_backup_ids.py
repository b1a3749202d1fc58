"""A repair's backup of a ledger segment holds its ids file (docs/journal.md, "Entries punched out
of pinned ledger segments"): without it, a segment the repair moves aside loses its kept ids.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridq.journal import OS_FILEOPS, repair_apply
from hybridq.journal.format import segment_name
from hybridq.journal.holes import HOLES_SUFFIX, Hole, punch_holes
from hybridq.journal.reader import list_chains
from hybridq.journal.statefile import STATE_SUFFIX
from hybridq.ledger.punched_ids import IDS_SUFFIX, PunchedId, read_ids, write_ids
from hybridq.ops.journal_repair import repair

from tests.support.writers import small_segments


def _ids_file(tmp_path: Path) -> tuple[Path, list[PunchedId], str]:
    """A ledger directory with the ids file of segment ``l1`` 0, and the backup directory beside it."""
    ledger, backup = tmp_path / "ledger", tmp_path / "backup"
    ledger.mkdir()
    backup.mkdir()
    ids = [PunchedId("a" * 32, ("w1", 3, 64), "default", result_kept=True, at=1_700_000_000)]
    write_ids(str(ledger), "l1", 0, ids)
    return backup, ids, os.path.join(ledger, segment_name("l1", 0))


def test_the_backup_of_a_ledger_segment_copies_its_ids_file(tmp_path: Path) -> None:
    """Failed before this fix: only the hole map was copied."""
    backup, ids, segment = _ids_file(tmp_path)
    repair_apply._backup_holes(OS_FILEOPS, str(backup), segment)
    assert read_ids(str(backup), "l1", 0) == ids


def test_the_repair_names_the_ids_suffix_the_ledger_writes() -> None:
    assert repair_apply.IDS_SUFFIX == IDS_SUFFIX  # the journal package may not import the ledger's


def test_a_segment_the_repair_removes_takes_its_hole_map_and_ids_file_along(tmp_path: Path) -> None:
    """Failed on main: both stayed in ledger/ (copied into the backup) until the next punch pass or start."""
    ledger = tmp_path / "journal" / "ledger"
    records = small_segments(ledger)
    chain = records[0].writer_id
    indices = list_chains(str(ledger))[chain]
    assert len(indices) >= 4
    removed = indices[2:]  # the damage is in segment 1: every later one goes
    for index in removed:  # sealed (the writer closed): a map and an ids file each
        first = next(r for r in records if r.segment_index == index)
        punch_holes(str(ledger), chain, index, [Hole(first.offset, first.end, first.seq, first.seq + 1, 1)])
        write_ids(
            str(ledger), chain, index, [PunchedId("b" * 32, ("w1", index, 64), None, result_kept=False, at=1)]
        )
    victim = [r for r in records if r.segment_index == 1][3]
    path = ledger / segment_name(chain, 1)
    path.chmod(0o600)
    with path.open("r+b") as f:
        f.seek(victim.offset + 20)
        f.write(b"\xff\xff")
    path.chmod(0o400)

    report = repair(str(ledger), accept_loss=True)
    assert report.applied
    assert report.backup is not None
    left = sorted(n for n in os.listdir(ledger) if n.endswith(STATE_SUFFIX))
    assert left == [], left
    for index in removed:
        name = segment_name(chain, index)
        assert read_ids(report.backup, chain, index), name
        assert (Path(report.backup) / (name + HOLES_SUFFIX + STATE_SUFFIX)).exists(), name


def test_a_damaged_side_file_not_copied_to_the_backup_stays(tmp_path: Path) -> None:
    """The repair deletes a side file only once its copy is in the backup: a damaged ids file has none."""
    backup, _ids, segment = _ids_file(tmp_path)
    side = Path(segment + IDS_SUFFIX + STATE_SUFFIX)
    side.write_bytes(side.read_bytes()[:-1] + b"\xff")  # its checksum no longer fits
    repair_apply._backup_holes(OS_FILEOPS, str(backup), segment)
    assert not (backup / side.name).exists()
    repair_apply._remove_side_files(OS_FILEOPS, str(backup), segment)
    assert side.exists()
