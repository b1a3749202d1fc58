"""``journal repair``'s copy of a segment reads every byte and leaves only zeros as holes.

The copy into the backup and the cut segment kept a hole wherever ``SEEK_DATA``/``SEEK_HOLE``
said so; a filesystem that called dirty data a hole (OpenZFS 2.1 and 2.2.0-2.2.1 did) zeroed
those records in the cut segment and in its backup both, the repair reporting success. The copy
now asks the filesystem nothing: it ``pread``s every byte, as before the sparse copy, and makes
a hole of each aligned block that reads all zeros (docs/operations.md, "A corrupt journal").
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from unittest import mock

import pytest
from hybridq.journal import JournalReader, JournalWriter, repair_apply
from hybridq.journal.fileops import OS_FILEOPS
from hybridq.journal.format import segment_name
from hybridq.journal.holes import Hole, _punch, add_holes, read_holes, tidy_hole_maps
from hybridq.journal.recovery import verify
from hybridq.journal.repair import repair

SEGMENT = 256 << 10
#: A block on this machine: holes and the partial blocks at their ends come in these.
BLOCK = max(os.sysconf("SC_PAGE_SIZE"), 4096)


def _rotted(journal: Path) -> tuple[list, str, Path, bytes]:
    """Segment 0 of 256 KiB with bit rot in record 1000: the repair cuts it there."""
    with JournalWriter(journal, max_segment_bytes=SEGMENT) as writer:
        for start in range(0, 2400, 10):
            writer.append_many([b"%06d" % i + b"x" * 200 for i in range(start, start + 10)])
    seg0 = [r for r in JournalReader(journal).records() if r.segment_index == 0]
    assert len(seg0) > 1010
    path = journal / segment_name(seg0[0].writer_id, 0)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(seg0[1000].offset + 30)
        f.write(b"\xff\xff")
    os.chmod(path, 0o400)
    return seg0, seg0[0].writer_id, path, path.read_bytes()


def _check_repaired(journal: Path, seg0: list, path: Path, original: bytes, backup_dir: str | None) -> None:
    assert backup_dir is not None
    assert (Path(backup_dir) / path.name).read_bytes() == original  # the backup, byte for byte
    cut = path.read_bytes()
    assert cut[: seg0[1000].offset] == original[: seg0[1000].offset]
    verify(journal)


def test_a_filesystem_that_calls_data_a_hole_loses_nothing(journal_dir: Path) -> None:
    """Fails before this fix: 291 records zeroed in the cut segment and its backup, verify refused."""
    seg0, _, path, original = _rotted(journal_dir)
    real = os.lseek
    lie = (64 << 10, 128 << 10)  # data the filesystem calls a hole (dirty, not yet committed)

    def lying(fd: int, pos: int, how: int) -> int:
        if how == os.SEEK_DATA and lie[0] <= pos < lie[1]:
            return real(fd, lie[1], os.SEEK_DATA)
        if how == os.SEEK_HOLE:
            end = real(fd, pos, os.SEEK_HOLE)
            return lie[0] if pos < lie[0] < end else end
        return real(fd, pos, how)

    with mock.patch.object(os, "lseek", lying):
        report = repair(journal_dir, accept_loss=True)
    assert report.applied
    _check_repaired(journal_dir, seg0, path, original, report.backup)


def test_a_range_mapped_but_not_yet_punched_is_copied_then_punched_at_the_start(journal_dir: Path) -> None:
    """A crash between the map and the punch: its records are still on disk, and copied as they are."""
    seg0, writer_id, path, _ = _rotted(journal_dir)
    a, b = seg0[1], seg0[900]
    hole = Hole(a.offset, b.end, a.seq, b.seq + 1, 900)
    with mock.patch("hybridq.journal.holes._punch_ranges", return_value=0):  # the crash: no punch
        add_holes(str(journal_dir), writer_id, 0, [hole])
    original = path.read_bytes()
    assert original[a.offset : b.end] != bytes(b.end - a.offset)  # the records, not zeros
    report = repair(journal_dir, accept_loss=True)
    assert report.applied
    _check_repaired(journal_dir, seg0, path, original, report.backup)
    assert read_holes(str(journal_dir), writer_id, 0) == (hole,)
    before = os.stat(path).st_blocks * 512
    tidy_hole_maps(str(journal_dir))  # the forwarder's next start punches the map's ranges
    assert os.stat(path).st_blocks * 512 <= before - (b.end - a.offset) + 2 * BLOCK
    verify(journal_dir)


def _sparse_source(tmp_path: Path, size: int, holes: list[tuple[int, int]]) -> Path:
    src = tmp_path / "src"
    data = bytes((i * 7 + 1) % 251 or 1 for i in range(size))  # no zero byte anywhere
    src.write_bytes(data)
    fd = os.open(src, os.O_WRONLY)
    try:
        for start, end in holes:
            try:
                _punch(fd, start, end - start)
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                    pytest.skip("this filesystem cannot punch holes")
                raise
    finally:
        os.close(fd)
    return src


def _copy(src: Path, dst: Path, size: int) -> bytes:
    sfd = os.open(src, os.O_RDONLY)
    dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
    try:
        repair_apply._copier(OS_FILEOPS, sfd, size)(dfd)
    finally:
        os.close(dfd)
        os.close(sfd)
    return dst.read_bytes()


@pytest.mark.parametrize(
    ("cut", "holes"),
    [
        pytest.param(1 << 20, [(200_000, 1 << 20)], id="ends-in-a-hole"),
        pytest.param(300_123, [(200_000, 400_000)], id="cut-inside-a-hole"),
        pytest.param(1 << 20, [(10_001, 90_003), (500_000, 600_000)], id="unaligned-edges"),
        pytest.param(1 << 20, [(0, 1 << 20)], id="all-hole"),
        pytest.param(777_777, [], id="no-hole"),
    ],
)
def test_the_copy_reads_the_same_bytes_and_keeps_the_holes(
    tmp_path: Path, cut: int, holes: list[tuple[int, int]]
) -> None:
    src = _sparse_source(tmp_path, 1 << 20, holes)
    want = src.read_bytes()[:cut]
    assert _copy(src, tmp_path / "dst", cut) == want
    zeros = sum(min(end, cut) - start for start, end in holes if start < cut)
    # Blocks: the data's, the partial blocks at each hole's ends, and what the filesystem keeps.
    assert os.stat(tmp_path / "dst").st_blocks * 512 <= cut - zeros + 2 * BLOCK * (len(holes) + 1) + (
        16 << 10
    )


def test_short_reads_copy_the_same_bytes(tmp_path: Path) -> None:
    src = _sparse_source(tmp_path, 1 << 20, [(100_000, 700_000)])
    real = os.pread
    with mock.patch.object(os, "pread", lambda fd, n, off: real(fd, min(n, 777), off)):
        assert _copy(src, tmp_path / "dst", 1 << 20) == src.read_bytes()


def test_a_source_that_shrank_into_its_trailing_hole_is_an_error(tmp_path: Path) -> None:
    src = _sparse_source(tmp_path, 1 << 20, [(500_000, 1 << 20)])
    os.truncate(src, 600_000)  # damage while locked: its length was checked before the copy
    with pytest.raises(OSError, match="shrank"):
        _copy(src, tmp_path / "dst", 1 << 20)
