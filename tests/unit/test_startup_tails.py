"""Start-up reads only the journal's tails; the sealed segments are checked in the background.

Issue 29: the first job must not wait for a CRC check of the whole journal. ``recover(...,
tails_only=True)`` reads each chain's unsealed last segment (and the header of the one before,
for the salt link); the sealed segments go to :class:`BackgroundCheck`, and corruption there is
still found and raised, never skipped (docs/reliability.md rule 11).
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from pathlib import Path

import pytest
from hybridq.errors import JournalCorruption, JournalError
from hybridq.journal import JournalWriter
from hybridq.journal.background import BackgroundCheck, sealed_segments
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import FILE_HEADER_SIZE
from hybridq.journal.recovery import recover

from tests.support.writers import abandon_writer

PAYLOAD = b"x" * 200


class ReadSpy(FileOps):
    """Counts the bytes read per file."""

    def __init__(self) -> None:
        self.paths: dict[int, str] = {}
        self.read_bytes: Counter[str] = Counter()

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        self.paths[fd] = os.path.basename(path)
        return fd

    def read(self, fd: int, size: int) -> bytes:
        data = super().read(fd, size)
        self.read_bytes[self.paths.get(fd, "?")] += len(data)
        return data


def _journal(path: Path, *, records: int = 400, close: bool = False) -> list[Path]:
    """A chain of small segments; its last one left open and unsealed (a dead writer) unless ``close``."""
    writer = JournalWriter(path, max_segment_bytes=8192)
    for _ in range(records):
        writer.append(PAYLOAD)
    if close:
        writer.close()
    else:
        abandon_writer(writer)
    return sorted(path.glob("*.wal"))


def _flip(segment: Path, at: int) -> None:
    raw = bytearray(segment.read_bytes())
    raw[at] ^= 0x40
    mode = segment.stat().st_mode
    segment.chmod(0o600)
    segment.write_bytes(bytes(raw))
    segment.chmod(mode & 0o777)


def test_start_up_reads_only_the_unsealed_tail(tmp_path: Path) -> None:
    segments = _journal(tmp_path)
    assert len(segments) >= 8
    tail, before = segments[-1].name, segments[-2].name
    spy = ReadSpy()
    report = recover(tmp_path, fileops=spy, tails_only=True)
    assert report.sealed  # the dead chain's tail was checked and sealed
    read = dict(spy.read_bytes)
    assert set(read) <= {tail, before}, read
    assert read.get(before, 0) <= FILE_HEADER_SIZE  # only its header: the salt link
    assert read[tail] >= os.path.getsize(segments[-1]) - 200


def test_a_sealed_tail_is_not_read_at_start_at_all(tmp_path: Path) -> None:
    _journal(tmp_path, close=True)
    spy = ReadSpy()
    recover(tmp_path, fileops=spy, tails_only=True)
    assert sum(spy.read_bytes.values()) == 0
    assert len(sealed_segments(tmp_path)) == len(list(tmp_path.glob("*.wal")))


def test_bit_rot_in_a_sealed_segment_is_found_by_the_background_check(tmp_path: Path) -> None:
    segments = _journal(tmp_path)
    _flip(segments[2], FILE_HEADER_SIZE + 100)
    recover(tmp_path, tails_only=True)  # O(tail): does not see it ...
    check = BackgroundCheck(tmp_path, sealed_segments(tmp_path), bytes_per_s=0)
    check.run()  # ... the background check does, and keeps it for its owner to raise
    assert isinstance(check.failure, JournalCorruption)
    assert check.failure.path == str(segments[2])
    with pytest.raises(JournalCorruption):
        check.raise_if_failed()
    with pytest.raises(JournalCorruption):  # the full check agrees
        recover(tmp_path)


def test_the_background_check_reads_every_sealed_segment_once(tmp_path: Path) -> None:
    segments = _journal(tmp_path, close=True)
    spy = ReadSpy()
    check = BackgroundCheck(tmp_path, sealed_segments(tmp_path), fileops=spy, bytes_per_s=0)
    check.start()
    assert check.finished.wait(10)
    check.stop()
    assert check.failure is None
    assert check.checked == len(segments)
    assert check.records == 400
    for segment in segments:  # whole, plus at most the next one's header (its salt link)
        assert (
            os.path.getsize(segment)
            <= spy.read_bytes[segment.name]
            <= os.path.getsize(segment) + FILE_HEADER_SIZE
        )


def test_a_segment_compacted_meanwhile_is_skipped(tmp_path: Path) -> None:
    segments = _journal(tmp_path, close=True)
    todo = sealed_segments(tmp_path)
    segments[0].chmod(0o600)
    segments[0].unlink()  # compaction deleted it after start-up listed it
    check = BackgroundCheck(tmp_path, todo, bytes_per_s=0)
    check.run()
    assert check.failure is None
    assert check.checked == len(segments) - 1


class FailingReads(FileOps):
    """A disk whose reads fail (EIO): what a bad disk looks like."""

    def read(self, fd: int, size: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")


def test_a_read_error_in_the_background_check_stops_the_forwarder_as_corruption_does(tmp_path: Path) -> None:
    _journal(tmp_path, close=True)
    check = BackgroundCheck(tmp_path, sealed_segments(tmp_path), fileops=FailingReads(), bytes_per_s=0)
    check.start()
    assert check.finished.wait(10)
    check.stop()
    assert check.failure is not None  # before: the thread died, nothing raised, nothing logged
    with pytest.raises(JournalError):
        check.raise_if_failed()
