"""The sweep of a killed forwarder's spill files removes those and nothing else (issue 29).

A ``.index-spill`` that is a symlink (to the journal itself, say) must not have its target's
files removed: that could delete journal segments, acknowledged jobs (docs/reliability.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hybridq.ledger import spill_files
from hybridq.ledger.outcomes import SegmentOutcomes


@pytest.fixture(autouse=True)
def _fresh_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill_files, "_swept", set())


OTHER = "0123456789abcdef-7"  # another process's spill file


def test_a_killed_processes_spill_files_are_removed_and_nothing_else(tmp_path: Path) -> None:
    where = tmp_path / spill_files.SPILL_DIR
    where.mkdir(mode=0o700)
    (where / OTHER).write_bytes(b"x")
    (where / "notes.txt").write_bytes(b"kept")  # not a spill file's name
    (where / "fedcba9876543210-1").mkdir()  # a directory, not a file
    outside = tmp_path / "segment.wal"
    outside.write_bytes(b"journal")
    (where / "fedcba9876543210-2").symlink_to(outside)  # a symlink named as a spill file
    mine = f"{spill_files._token}-3"
    (where / mine).write_bytes(b"mine")
    spill_files.sweep(str(tmp_path))
    assert sorted(os.listdir(where)) == sorted(
        ["notes.txt", "fedcba9876543210-1", "fedcba9876543210-2", mine]
    )
    assert outside.read_bytes() == b"journal"


def test_a_symlinked_spill_directory_is_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / OTHER).write_bytes(b"a segment named like a spill file")
    (journal / spill_files.SPILL_DIR).symlink_to(journal)  # .index-spill -> the journal itself
    spill_files.sweep(str(journal))
    assert (journal / OTHER).read_bytes() == b"a segment named like a spill file"
    assert "left alone" in caplog.text


def test_once_a_process_per_journal(tmp_path: Path) -> None:
    where = tmp_path / spill_files.SPILL_DIR
    where.mkdir(mode=0o700)
    spill_files.sweep(str(tmp_path))
    (where / OTHER).write_bytes(b"x")  # made after this process swept: not its business again
    spill_files.sweep(str(tmp_path))
    assert os.listdir(where) == [OTHER]


def test_a_full_disk_keeps_a_spilled_maps_additions_in_memory_not_the_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of spillfix51, MEDIUM 1: a refused append read the whole map back (the cap lost)."""
    monkeypatch.setattr(spill_files, "_resume_at", 0.0)
    done = SegmentOutcomes(dict.fromkeys(range(0, 400_000, 40), "succeeded"))
    assert done.spill(str(tmp_path))
    full = dict.fromkeys(range(0, 400_000, 40), "succeeded")
    monkeypatch.setattr(spill_files, "margin", lambda directory: (0, 1))  # the journal's disk full
    for offset in range(400_000, 440_000, 4):  # jobs finishing in order: appends refused
        done[offset] = "failed"
        full[offset] = "failed"
    assert done.spilled
    assert done.resident() <= 10_000  # its additions only, never the 10,000 spilled
    assert dict(done.items()) == full
    monkeypatch.setattr(spill_files, "margin", lambda directory: (1 << 40, 1))  # room again
    monkeypatch.setattr(spill_files, "_resume_at", 0.0)
    for offset in range(440_000, 488_000, 4):  # the next merge: at twice the additions held
        done[offset] = "succeeded"
        full[offset] = "succeeded"
    assert done.spilled
    assert done.resident() < 2_000  # appended to its file once writes resume
    assert dict(done.items()) == full
    monkeypatch.setattr(spill_files, "_resume_at", 0.0)
