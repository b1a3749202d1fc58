"""The start seals again a sealed segment left writable: which bytes it writes again, and when not.

A seal whose fdatasync failed (EIO) leaves its records, and those its writer had not fsynced,
possibly only in the page cache; the start writes them again in place, fdatasyncs, and only
then sets the mode (hybridq/journal/recovery.py, ``_seal_again``;
docs/journal-format.md, *Seal*).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from hybridq.errors import JournalIOError
from hybridq.journal import Durability, JournalReader, JournalWriter, Record
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import RECORD_HEADER_SIZE, SEAL_PAYLOAD_SIZE, SEAL_RECORDS, segment_name
from hybridq.journal.reader import list_chains
from hybridq.journal.recovery import recover

from tests.support.faulty import CallSpy

_SEAL_BYTES = SEAL_RECORDS * (RECORD_HEADER_SIZE + SEAL_PAYLOAD_SIZE)


class _SyncFails(FileOps):
    """fdatasync fails (EIO) once ``fail`` is set: what it was to make durable may be only in the page cache."""

    fail = False

    def fdatasync(self, fd: int) -> None:
        if self.fail:
            raise OSError(errno.EIO, "I/O error")
        super().fdatasync(fd)


def _abandoned_seal(directory: Path, durability: Durability, records: int = 5) -> tuple[Path, list[Record]]:
    """A segment whose seal's fdatasync failed (EIO): its records written, the segment abandoned."""
    ops = _SyncFails()
    writer = JournalWriter(directory, fileops=ops, durability=durability)
    writer.append_many([b"job-%d" % i for i in range(records)])
    ops.fail = True
    with pytest.raises(JournalIOError):
        writer.close()
    ((writer_id, (index,)),) = list_chains(str(directory)).items()
    path = directory / segment_name(writer_id, index)
    assert path.stat().st_mode & 0o777 == 0o600
    return path, list(JournalReader(directory).records())


@pytest.mark.parametrize("durability", list(Durability))
def test_a_seal_whose_fsync_failed_is_written_again_before_its_mode(
    tmp_path: Path, durability: Durability
) -> None:
    """A sealed mode must never stand over bytes that may not be durable (docs/journal-format.md, *Seal*).

    The seal's fdatasync failed (EIO): its records, and those its writer had not fsynced (all
    of them with ``no-fsync``), may be only in the page cache, and a later fsync may report
    success without writing them. The start writes them again, the same bytes in place, and
    fdatasyncs them before the chmod; a chmod alone, or no seal at all (main), would not do.
    """
    path, written = _abandoned_seal(tmp_path, durability)
    before = path.read_bytes()

    calls = CallSpy()
    report = recover(tmp_path, tails_only=True, fileops=calls)  # the next start
    assert report.resealed == [str(path)]
    assert report.sealed == report.repaired == []
    assert calls.names[calls.names.index("write") :] == ["write", "fdatasync", "fchmod", "fsync", "close"]
    start = len(before) - _SEAL_BYTES if durability == Durability.FSYNC else written[0].offset
    assert calls.spans == [(start, len(before))]
    assert path.stat().st_mode & 0o777 == 0o400
    assert path.read_bytes() == before
    assert list(JournalReader(tmp_path).records()) == written
    assert recover(tmp_path, tails_only=True).resealed == []
