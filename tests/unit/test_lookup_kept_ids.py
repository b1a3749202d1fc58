"""The lookup index reads each ledger ids file once while it stays the same (``hybridq.lookup.fold.KeptIds``).

A catch-up that reads the ledger from a mark in a punched segment folds in the successes punched
out of it from the segment's ids file (docs/journal.md, "Entries punched out of pinned ledger
segments"). Each catch-up reads the file and checks its checksum; one whose bytes are the ones
decoded last time uses the entries made then; a damaged file raises each time, as before.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import StateFileCorrupt
from hybridq.journal.format import segment_name
from hybridq.journal.records import Loc
from hybridq.ledger import punched_ids
from hybridq.ledger.entries import Entry
from hybridq.ledger.punched_ids import IDS_SUFFIX, PunchedId, write_ids
from hybridq.ledger.store import ledger_dir, open_ledger_writer
from hybridq.lookup.fold import KeptIds
from hybridq.lookup.index import LookupIndex
from hybridq.lookup.reads import find

from tests import tasks

#: Ledger writers (a chain's id is 16 hex digits); GONE's segments are gone, its ids file stays.
L1 = "0000000000000001"
GONE = "00000000000000ff"


def _ids(n: int, writer: str = "00000000000000aa", start: int = 0) -> list[PunchedId]:
    return [
        PunchedId(f"{i:032x}", (writer, 0, 100 + 10 * i), "default", result_kept=True, at=1_700_000_000)
        for i in range(start, start + n)
    ]


def _path(ledger: Path, writer: str, index: int) -> Path:
    return ledger / (segment_name(writer, index) + IDS_SUFFIX + ".state")


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids files decoded (how many ids each held)."""
    reads: list[int] = []
    real = punched_ids.decode

    def decode(raw: bytes) -> list[PunchedId]:
        ids = real(raw)
        reads.append(len(ids))
        return ids

    monkeypatch.setattr(punched_ids, "decode", decode)
    return reads


def test_a_second_read_does_not_decode_again_and_a_rewritten_file_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _count_reads(monkeypatch)
    write_ids(str(tmp_path), L1, 0, _ids(3))
    kept = KeptIds(str(tmp_path))
    first = list(kept.entries({}))
    assert [e.job_id for e in first] == [p.job_id for p in _ids(3)]
    assert list(kept.entries({})) == first
    assert reads == [3]
    write_ids(str(tmp_path), L1, 0, _ids(4))  # renamed in: a new inode
    assert [e.job_id for e in kept.entries({})] == [p.job_id for p in _ids(4)]
    assert reads == [3, 4]
    assert kept.decoded == 2


def test_a_damaged_file_raises_every_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _count_reads(monkeypatch)
    write_ids(str(tmp_path), L1, 0, _ids(3))
    kept = KeptIds(str(tmp_path))
    assert len(list(kept.entries({}))) == 3
    path = _path(tmp_path, L1, 0)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    damaged = tmp_path / "damaged"
    damaged.write_bytes(bytes(raw))
    os.replace(damaged, path)  # as a restore of a bad copy would
    for _ in range(2):
        with pytest.raises(StateFileCorrupt, match="checksum mismatch"):
            list(kept.entries({}))
    assert reads == [3]  # the damaged one fails its checksum before any decode
    write_ids(str(tmp_path), L1, 0, _ids(2))  # repaired: read again
    assert len(list(kept.entries({}))) == 2


def test_files_gone_or_read_past_are_dropped_and_the_cap_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _count_reads(monkeypatch)
    for index in range(3):
        write_ids(str(tmp_path), L1, index, _ids(1, start=index))
    kept = KeptIds(str(tmp_path), cap=2)
    assert len(list(kept.entries({}))) == 3
    assert len(kept._files) == 2  # the cap: the third is decoded, not kept
    assert len(list(kept.entries({L1: (1, 0, 0)}))) == 2  # segment 0 read past
    assert len(reads) == 4  # the one not kept, again
    assert sorted(kept._files) == [_path(tmp_path, L1, i).name for i in (1, 2)]
    _path(tmp_path, L1, 1).unlink()
    assert len(list(kept.entries({L1: (1, 0, 0)}))) == 1
    assert sorted(kept._files) == [_path(tmp_path, L1, 2).name]
    assert list(KeptIds(str(tmp_path / "none")).entries({})) == []


def test_files_past_the_entries_cap_are_decoded_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _count_reads(monkeypatch)
    write_ids(str(tmp_path), L1, 0, _ids(3))
    write_ids(str(tmp_path), L1, 1, _ids(2, start=3))
    kept = KeptIds(str(tmp_path), entries_cap=4)
    for _ in range(2):
        assert len(list(kept.entries({}))) == 5
    assert reads == [3, 2, 2]  # the first kept, the second (3 + 2 > 4) read again


def _settled(index: LookupIndex) -> None:
    checked = threading.Event()
    index.on_checked = checked.set
    index.open()
    assert checked.wait(10.0)
    for _ in range(5):
        index.catch_up()
        if not index.building:
            return
    raise AssertionError("the index did not finish its build")


def test_each_catch_up_that_reads_the_ledger_decodes_an_unchanged_ids_file_once(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer's entries make each catch-up read the ledger; fails before (a decode each)."""
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(3)]
    locs: list[Loc] = []
    for job in jobs:
        assert job.record is not None
        locs.append((job.record.writer_id, job.record.segment, job.record.offset))
    ledger = ledger_dir(str(journal_dir))
    os.makedirs(ledger, exist_ok=True)
    write_ids(
        ledger, GONE, 0, [PunchedId(jobs[0].id, locs[0], "default", result_kept=True, at=1_700_000_000)]
    )
    reads = _count_reads(monkeypatch)
    index = LookupIndex(str(journal_dir))
    try:
        _settled(index)
        assert len(reads) == 1
        for i, job in enumerate(jobs[1:], 1):
            with open_ledger_writer(str(journal_dir)) as writer:  # another writer's entry
                writer.append(Entry("done", job.id, locs[i], outcome="failed", at=2.0).to_bytes())
            index.catch_up()
        assert len(reads) == 1
        write_ids(
            ledger,
            GONE,
            0,
            [
                PunchedId(job.id, loc, "default", result_kept=True, at=1_700_000_000)
                for job, loc in zip(jobs, locs, strict=True)
            ],
        )
        with open_ledger_writer(str(journal_dir)) as writer:
            writer.append(Entry("retry", jobs[2].id, locs[2], at=3.0).to_bytes())
        index.catch_up()
        assert len(reads) == 2
    finally:
        index.close()
    row = find(str(journal_dir), jobs[0].id)  # its kept id folded in
    assert row is not None
    assert (row.state, row.outcome) == ("done", "succeeded")


def test_a_file_rewritten_with_the_same_size_time_and_inode_is_decoded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its review's MEDIUM: keyed by (size, mtime_ns, inode), the first version answered the old ids.

    Inodes alternate between two rewrites and a coarse clock gives one tick to several, so a third
    rewrite of the same count can stat as the first: the bytes decide, not the stat.
    """
    reads = _count_reads(monkeypatch)
    write_ids(str(tmp_path), L1, 0, _ids(3))
    path = _path(tmp_path, L1, 0)
    st = os.stat(path)
    kept = KeptIds(str(tmp_path))
    assert [e.job_id for e in kept.entries({})] == [p.job_id for p in _ids(3)]
    data = path.read_bytes()
    other = [
        PunchedId(f"{9 - i:032x}", p.loc, p.queue, result_kept=True, at=p.at) for i, p in enumerate(_ids(3))
    ]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_ids(str(elsewhere), L1, 0, other)  # the same size: three other ids at the same places
    new = _path(elsewhere, L1, 0).read_bytes()
    assert len(new) == len(data)
    assert new != data
    with path.open("r+b") as f:  # into the same inode, its time set back: as a reused inode in one tick
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [e.job_id for e in kept.entries({})] == [p.job_id for p in other]
    assert reads == [3, 3]
