"""Hole maps: punched ranges of a sealed segment are skipped by every reader, as compacted records."""

from __future__ import annotations

import errno
import os
import random
import stat
from pathlib import Path

import pytest
from hybridq.errors import JournalCorruption, StateFileCorrupt
from hybridq.journal import JournalReader, JournalWriter, holes
from hybridq.journal.background import BackgroundCheck, sealed_segments
from hybridq.journal.compact import remove_oldest_segment
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import FILE_HEADER_SIZE, segment_name
from hybridq.journal.holes import Hole, RecordPunched, add_holes, read_holes, tidy_hole_maps
from hybridq.journal.random_access import SegmentFile, read_record_at
from hybridq.journal.recovery import verify
from hybridq.journal.repair import repair


def _journal(path: Path, n: int = 400, size: int = 16384) -> list:
    with JournalWriter(path, max_segment_bytes=size) as writer:
        for start in range(0, n, 10):  # one call is one append: it never spans segments
            writer.append_many([b"%06d" % i + b"x" * 200 for i in range(start, start + 10)])
    return list(JournalReader(path).records())


def _run(records: list, first: int, last: int) -> Hole:
    a, b = records[first], records[last]
    return Hole(a.offset, b.end, a.seq, b.seq + 1, last - first + 1)


def _segment(records: list, index: int) -> list:
    return [r for r in records if r.segment_index == index]


def _punched_then_rotted(journal_dir: Path, runs: list[tuple[int, int]], rot: int) -> tuple[list, str]:
    """Segment 0 with ``runs`` (record indices) punched, then bit rot in its record ``rot``."""
    seg0 = _segment(_journal(journal_dir), 0)
    writer = seg0[0].writer_id
    add_holes(str(journal_dir), writer, 0, [_run(seg0, a, b) for a, b in runs])
    path = os.path.join(journal_dir, segment_name(writer, 0))
    os.chmod(path, 0o600)  # made writable for it, then sealed again
    with open(path, "r+b") as f:
        f.seek(seg0[rot].offset + 30)
        f.write(b"\xff\xff")
    os.chmod(path, 0o400)
    return seg0, writer


def test_a_punched_range_is_skipped_by_the_scan_and_its_blocks_freed(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    path = os.path.join(journal_dir, segment_name(writer, 0))
    before = os.stat(path)
    freed = add_holes(str(journal_dir), writer, 0, [_run(seg0, 1, len(seg0) - 2)])
    assert freed == seg0[-2].end - seg0[1].offset
    after = os.stat(path)
    assert after.st_size == before.st_size  # every location stays valid
    assert after.st_blocks < before.st_blocks  # the blocks are freed
    assert stat.S_IMODE(after.st_mode) == 0o400  # still sealed
    assert read_holes(str(journal_dir), writer, 0) == (_run(seg0, 1, len(seg0) - 2),)
    left = [r.payload for r in JournalReader(journal_dir).records()]
    gone = {r.payload for r in seg0[1:-1]}
    assert left == [r.payload for r in records if r.payload not in gone]
    reader = JournalReader(journal_dir)
    assert reader.check() == len(records)  # verify counts them, as the seal does
    verify(journal_dir)  # raises on damage


def test_a_read_in_a_hole_answers_gone_as_a_compacted_segment(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    add_holes(str(journal_dir), writer, 0, [_run(seg0, 2, 5)])
    with pytest.raises(RecordPunched) as caught:
        read_record_at(str(journal_dir), writer, 0, seg0[3].offset)
    assert isinstance(caught.value, FileNotFoundError)
    assert read_record_at(str(journal_dir), writer, 0, seg0[1].offset).payload == seg0[1].payload
    assert read_record_at(str(journal_dir), writer, 0, seg0[6].offset).payload == seg0[6].payload
    with SegmentFile(str(journal_dir), writer, 0) as seg, pytest.raises(RecordPunched):
        seg.read_data(seg0[0].offset, seg0[6].offset)
    with SegmentFile(str(journal_dir), writer, 0) as seg:
        assert [p for _, p in seg.read_data(seg0[6].offset, seg0[8].offset)] == [r.payload for r in seg0[6:9]]


def test_reading_resumes_inside_or_before_a_hole(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    add_holes(str(journal_dir), writer, 0, [_run(seg0, 3, 6)])
    want = [r.payload for r in records[7:]]
    assert [r.payload for r in JournalReader(journal_dir).records({writer: seg0[2].position})] == want


@pytest.mark.parametrize("first", [3, 4, 5, 6])  # the hole's first record, its middle, its last
def test_a_read_resuming_inside_a_hole_skips_the_rest_of_it_and_counts_it(
    journal_dir: Path, first: int
) -> None:
    """A mark saved before the punch (pushed list, lookup index) may lie inside the punched run."""
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    add_holes(str(journal_dir), writer, 0, [_run(seg0, 3, 6)])
    since = {writer: seg0[first - 1].position}  # the next record to read is record ``first``
    want = [r.payload for r in records[7:]]
    assert [r.payload for r in JournalReader(journal_dir).records(since)] == want
    assert JournalReader(journal_dir).check(since) == len(records) - first


def test_two_punches_merge_and_the_background_check_and_repair_see_no_damage(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg1 = _segment(records, 1)
    writer = seg1[0].writer_id
    add_holes(str(journal_dir), writer, 1, [_run(seg1, 0, 2)])
    add_holes(str(journal_dir), writer, 1, [_run(seg1, 3, 5), _run(seg1, 8, 9)])
    assert len(read_holes(str(journal_dir), writer, 1)) == 2
    check = BackgroundCheck(journal_dir, sealed_segments(str(journal_dir)), bytes_per_s=0)
    check.run()
    assert check.failure is None
    report = repair(journal_dir, accept_loss=False)
    assert report.healthy
    assert not report.repairs


def test_a_wrong_hole_map_is_corruption_not_a_skip(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    bad = Hole(seg0[2].offset, seg0[4].end, seg0[2].seq + 1, seg0[4].seq + 2, 3)
    add_holes(str(journal_dir), writer, 0, [bad])
    with pytest.raises(JournalCorruption, match=r"hole map range at offset .* starts at sequence"):
        list(JournalReader(journal_dir).records())


def test_a_hole_map_off_the_record_boundaries_is_corruption(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    bad = Hole(seg0[2].offset + 1, seg0[4].end, seg0[2].seq, seg0[4].seq + 1, 3)
    add_holes(str(journal_dir), writer, 0, [bad])
    with pytest.raises(JournalCorruption, match=r"in a sealed segment|hole map"):
        list(JournalReader(journal_dir).records())


def test_an_unsealed_segment_is_never_punched(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        writer.append_many([b"a" * 100, b"b" * 100])
        records = list(JournalReader(journal_dir).records())
        with pytest.raises(ValueError, match="not sealed"):
            add_holes(str(journal_dir), records[0].writer_id, 0, [_run(records, 0, 0)])


def test_the_map_goes_with_its_segment_and_a_crash_leftover_is_tidied(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0, seg1 = _segment(records, 0), _segment(records, 1)
    writer = seg0[0].writer_id
    add_holes(str(journal_dir), writer, 0, [_run(seg0, 0, 1)])
    add_holes(str(journal_dir), writer, 1, [_run(seg1, 0, 1)])
    remove_oldest_segment(str(journal_dir), writer, 0)
    assert read_holes(str(journal_dir), writer, 0) == ()
    # A crash between the unlink and the map's removal; and one while a segment was writable.
    os.unlink(os.path.join(journal_dir, segment_name(writer, 1)))
    path2 = os.path.join(journal_dir, segment_name(writer, 2))
    add_holes(str(journal_dir), writer, 2, [_run(_segment(records, 2), 0, 0)])
    os.chmod(path2, 0o600)
    assert tidy_hole_maps(str(journal_dir)) == [segment_name(writer, 1) + ".holes.state"]
    assert stat.S_IMODE(os.stat(path2).st_mode) == 0o400


def test_a_damaged_map_is_loud(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    add_holes(str(journal_dir), writer, 0, [_run(seg0, 0, 1)])
    state = os.path.join(journal_dir, segment_name(writer, 0) + ".holes.state")
    with open(state, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    with pytest.raises(StateFileCorrupt):
        list(JournalReader(journal_dir).records())


def test_a_punch_while_a_scan_reads_the_segment_is_no_damage(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    scan = JournalReader(journal_dir, chunk_bytes=4096).records()  # the rest of the segment unread
    first = next(scan)
    assert first.payload == seg0[0].payload
    add_holes(str(journal_dir), writer, 0, [_run(seg0, 1, len(seg0) - 3)])  # another process's punch
    rest = [r.payload for r in scan]
    got = [first.payload, *rest]
    # Records read before the punch reached them may come too (they were there); none is lost.
    assert got[-len(records) + len(seg0) :] == [r.payload for r in records[len(seg0) :]]
    assert seg0[-2].payload in got
    assert seg0[-1].payload in got


def test_a_punch_under_an_open_segment_file_answers_gone(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    with SegmentFile(str(journal_dir), writer, 0) as seg:
        assert seg.read(seg0[3].offset).payload == seg0[3].payload
        add_holes(str(journal_dir), writer, 0, [_run(seg0, 2, 5)])
        with pytest.raises(RecordPunched):
            seg.read(seg0[3].offset)
        with pytest.raises(RecordPunched):
            seg.read_data(seg0[0].offset, seg0[6].offset)


def test_a_crash_between_the_map_and_the_punch_is_punched_at_the_next_start(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    path = os.path.join(journal_dir, segment_name(writer, 0))
    before = os.stat(path).st_blocks
    with monkeypatch.context() as m:
        m.setattr(holes, "_punch_ranges", lambda *_a: 0)  # killed after the map was written
        add_holes(str(journal_dir), writer, 0, [_run(seg0, 0, len(seg0) - 1)])
    assert os.stat(path).st_blocks == before
    assert next(r.payload for r in JournalReader(journal_dir).records()) == records[len(seg0)].payload
    assert tidy_hole_maps(str(journal_dir)) == []
    assert os.stat(path).st_blocks < before


def test_a_filesystem_without_punch_keeps_working(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id

    def refuse(*_a: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(holes, "_punch", refuse)
    monkeypatch.setattr(holes, "_unsupported", set())
    assert add_holes(str(journal_dir), writer, 0, [_run(seg0, 0, 1)]) == 0
    assert not holes.punch_supported(str(journal_dir))
    assert add_holes(str(journal_dir), writer, 1, [_run(_segment(records, 1), 0, 1)]) == 0
    assert read_holes(str(journal_dir), writer, 1) == ()  # no more tries: nothing written
    verify(journal_dir)


def test_a_repair_of_damage_right_after_a_punched_range_keeps_the_range_and_counts_it(
    journal_dir: Path,
) -> None:
    # Bit rot in the record just after the punched range.
    _, writer = _punched_then_rotted(journal_dir, [(2, 5)], rot=6)
    report = repair(journal_dir, accept_loss=True)
    assert report.applied
    verify(journal_dir)  # the map still falls on the records, the new seals after it
    from hybridq.journal.compact import sealed_data_count

    assert sealed_data_count(str(journal_dir), writer, 0) == 6  # two read, four punched


def test_a_repair_cut_before_a_punched_range_drops_the_range_from_the_map(journal_dir: Path) -> None:
    # Bit rot between the two ranges: the second one is cut away.
    seg0, writer = _punched_then_rotted(journal_dir, [(1, 2), (6, 8)], rot=4)
    assert repair(journal_dir, accept_loss=True).applied
    verify(journal_dir)
    assert read_holes(str(journal_dir), writer, 0) == (_run(seg0, 1, 2),)


def test_an_unsealed_tail_does_not_look_its_hole_map_up(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forwarder reads its chains' tails every step: no map lookup there (only sealed segments have one)."""
    from hybridq.journal import random_access, scan

    looked: list[str] = []

    def counting(path: str, **kwargs: object) -> tuple[Hole, ...]:
        looked.append(os.path.basename(path))
        return ()

    monkeypatch.setattr(scan, "holes_of", counting)
    monkeypatch.setattr(random_access, "holes_of", counting)
    with JournalWriter(journal_dir) as writer:
        writer.append_many([b"x" * 200] * 10)
        records = list(JournalReader(journal_dir).records())
        rec = records[0]
        read_record_at(str(journal_dir), rec.writer_id, 0, rec.offset)
        assert looked == []


def test_the_start_neither_punches_nor_seals_on_a_map_that_does_not_fit(journal_dir: Path) -> None:
    """A restored or stale map off the records: its bytes stay, and the scan reports it."""
    records = _journal(journal_dir)
    seg0, seg1 = _segment(records, 0), _segment(records, 1)
    writer = seg0[0].writer_id
    path0 = os.path.join(journal_dir, segment_name(writer, 0))
    bad = Hole(seg0[2].offset + 1, seg0[4].end, seg0[2].seq, seg0[4].seq + 1, 3)
    holes.write_state(str(journal_dir), segment_name(writer, 0) + holes.HOLES_SUFFIX, holes._encode([bad]))
    path_tail = os.path.join(journal_dir, segment_name(writer, seg1[0].segment_index))
    holes.write_state(  # a map next to a writable segment that holds no seals: never sealed by the start
        str(journal_dir), segment_name(writer, 1) + holes.HOLES_SUFFIX, holes._encode([_run(seg1, 0, 1)])
    )
    with open(path_tail, "r+b") as f:  # segment 1 made writable and its seals torn off
        os.chmod(path_tail, 0o600)
        f.truncate(seg1[-1].end)
    before = Path(path0).read_bytes()
    tidy_hole_maps(str(journal_dir))
    assert Path(path0).read_bytes() == before  # nothing punched
    assert stat.S_IMODE(os.stat(path_tail).st_mode) == 0o600  # not made read-only
    with pytest.raises(JournalCorruption):
        list(JournalReader(journal_dir).records())


def test_a_repair_reports_a_punched_range_past_its_cut_as_punched_and_backs_its_map_up(
    journal_dir: Path,
) -> None:
    # Damage before the punched range: the cut drops it.
    seg0, writer = _punched_then_rotted(journal_dir, [(6, 20)], rot=4)
    dropped = repair(journal_dir, accept_loss=False).dropped
    kinds = [(d.kind, d.seq, d.last_seq) for d in dropped if d.segment == 0]
    assert ("punched", seg0[6].seq, seg0[20].seq) in kinds
    assert all(d.last_seq is None or d.last_seq < seg0[6].seq for d in dropped if d.kind == "damaged")
    report = repair(journal_dir, accept_loss=True)
    assert report.backup is not None
    assert read_holes(report.backup, writer, 0) == (_run(seg0, 6, 20),)  # the original reads with its map


class _NotRoot(FileOps):
    """Permission checks as for a user who is not root (the tests may run as root)."""

    def __init__(self) -> None:
        self.modes: list[int] = []

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if (
            flags & (os.O_WRONLY | os.O_RDWR)
            and os.path.exists(path)
            and not os.stat(path).st_mode & stat.S_IWUSR
        ):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return super().open(path, flags, mode)

    def fchmod(self, fd: int, mode: int) -> None:
        self.modes.append(mode)
        super().fchmod(fd, mode)


def test_a_punch_not_as_root_opens_the_sealed_segment_writable_and_seals_it_again(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    path = os.path.join(journal_dir, segment_name(writer, 0))
    ops = _NotRoot()
    freed = add_holes(str(journal_dir), writer, 0, [_run(seg0, 1, len(seg0) - 2)], fileops=ops)
    assert freed > 0
    assert ops.modes == [0o600, 0o400]  # u+w for the open only
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    assert JournalReader(journal_dir).check() == len(records)


def test_hole_at_answers_as_a_look_at_every_range() -> None:
    """A bisect on the starts (review 2 of issue 29, L1), held against the linear test it replaces."""
    rng = random.Random(29)
    at, ranges = FILE_HEADER_SIZE, []
    for i in range(300):
        start = at + rng.randrange(0, 3) * 100
        ranges.append(Hole(start, start + rng.randrange(1, 4) * 100, i * 10, i * 10 + 1, 1))
        at = ranges[-1].end
    for n in (0, 1, 2, len(ranges)):
        some = tuple(ranges[:n])
        for off in [*range(0, at + 200, 50), *(h.start for h in some), *(h.end for h in some)]:
            assert holes.hole_at(some, off) == next((h for h in some if h.start <= off < h.end), None)


def test_hole_maps_read_each_map_once_and_a_damaged_one_as_none(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0, seg1 = _segment(records, 0), _segment(records, 1)
    writer = seg0[0].writer_id
    add_holes(str(journal_dir), writer, 0, [_run(seg0, 2, 5)])
    holes.write_state(str(journal_dir), segment_name(writer, 1) + holes.HOLES_SUFFIX, b"\x01")  # damaged
    maps = holes.HoleMaps(str(journal_dir))
    assert maps.hole_at(writer, 0, seg0[3].offset) == _run(seg0, 2, 5)
    assert maps.hole_at(writer, 0, seg0[6].offset) is None
    assert maps.hole_at(writer, 1, seg1[0].offset) is None
    assert maps.hole_at(writer, 7, FILE_HEADER_SIZE) is None  # no such segment: no map
    holes.remove_holes(str(journal_dir), writer, 0)
    assert maps.hole_at(writer, 0, seg0[3].offset) == _run(seg0, 2, 5)  # read once


def test_the_starts_check_of_a_map_reads_its_segment_through_the_fileops(journal_dir: Path) -> None:
    """An I/O error there leaves the map for the scan to report (review 2 of issue 29, L2: it used ``open``)."""
    records = _journal(journal_dir)
    seg0 = _segment(records, 0)
    writer = seg0[0].writer_id
    add_holes(str(journal_dir), writer, 0, [_run(seg0, 2, 5)])
    path = os.path.join(journal_dir, segment_name(writer, 0))

    class _Failing(FileOps):
        def open(self, name: str, flags: int, mode: int = 0o600) -> int:
            if name == path:
                raise OSError(errno.EIO, "Input/output error", name)
            return super().open(name, flags, mode)

    assert tidy_hole_maps(str(journal_dir), fileops=_Failing()) == []
    assert read_holes(str(journal_dir), writer, 0) == (_run(seg0, 2, 5),)
