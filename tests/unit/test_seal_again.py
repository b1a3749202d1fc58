"""The start seals again a sealed segment left writable: which bytes it writes again, and when not.

A seal whose fdatasync failed (EIO) leaves its records, and those its writer had not fsynced,
possibly only in the page cache; the start writes them again in place, fdatasyncs, reads the
segment again, and only then sets the mode (hybridq/journal/recovery.py, ``_seal_again``;
docs/journal-format.md, *Seal*).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq.errors import JournalCorruption, JournalIOError
from hybridq.journal import Durability, JournalReader, JournalWriter, Record
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import RECORD_HEADER_SIZE, SEAL_PAYLOAD_SIZE, SEAL_RECORDS, segment_name
from hybridq.journal.holes import Hole, punch_holes
from hybridq.journal.reader import list_chains
from hybridq.journal.recovery import recover

from tests.support.faulty import CallSpy
from tests.support.writers import abandon_writer

_SEAL_BYTES = SEAL_RECORDS * (RECORD_HEADER_SIZE + SEAL_PAYLOAD_SIZE)


class _SyncFails(FileOps):
    """fdatasync fails (EIO) once ``fail`` is set: what it was to make durable may be only in the page cache."""

    fail = False

    def fdatasync(self, fd: int) -> None:
        if self.fail:
            raise OSError(errno.EIO, "I/O error")
        super().fdatasync(fd)


def _abandoned_seal(directory: Path, durability: Durability, records: int = 5) -> tuple[Path, list[Record]]:
    """A segment whose seal's fdatasync failed (EIO): its records written (the last two in a batch
    of their own), the segment abandoned."""
    ops = _SyncFails()
    writer = JournalWriter(directory, fileops=ops, durability=durability)
    payloads = [b"job-%d" % i for i in range(records)]
    for batch in (payloads[:-2], payloads[-2:]):  # two batches (one if ``records`` <= 2)
        if batch:
            writer.append_many(batch)
    ops.fail = True
    with pytest.raises(JournalIOError):
        writer.close()
    ((writer_id, (index,)),) = list_chains(str(directory)).items()
    path = directory / segment_name(writer_id, index)
    assert path.stat().st_mode & 0o777 == 0o600
    return path, list(JournalReader(directory).records())


@pytest.mark.parametrize(
    ("durability", "records"), [(Durability.FSYNC, 5), (Durability.NO_FSYNC, 5), (Durability.NO_FSYNC, 1)]
)
def test_a_seal_whose_fsync_failed_is_written_again_before_its_mode(
    tmp_path: Path, durability: Durability, records: int
) -> None:
    """A sealed mode must never stand over bytes that may not be durable (docs/journal-format.md, *Seal*).

    The seal's fdatasync failed (EIO): its records, and those its writer had not fsynced (all
    of them with ``no-fsync``), may be only in the page cache, and a later fsync may report
    success without writing them. The start writes them again, the same bytes in place, and
    fdatasyncs them before the chmod; a chmod alone, or no seal at all (main), would not do.
    With ``fsync`` the writer's last data record states the batch before its own fsynced (its
    seal states all of them, as recovery's does): written again from that last batch.
    One unsynced record (``no-fsync``, 1): failed with the bound one record short
    (``>= next_seq - SEAL_RECORDS - 2``), which rewrote the seal only.
    """
    path, written = _abandoned_seal(tmp_path, durability, records)
    before = path.read_bytes()

    calls = CallSpy()
    report = recover(tmp_path, tails_only=True, fileops=calls)  # the next start
    assert report.resealed == [str(path)]
    assert report.sealed == report.repaired == []
    sealing = calls.names[calls.names.index("write") :]
    assert sealing[:2] == ["write", "fdatasync"]
    assert sealing[-3:] == ["fchmod", "fsync", "close"]  # after the segment was read again
    assert "read" in sealing[2:-3]
    assert "write" not in sealing[1:]
    start = (written[-2] if durability == Durability.FSYNC else written[0]).offset
    assert calls.spans == [(start, len(before))]
    assert path.stat().st_mode & 0o777 == 0o400
    assert path.read_bytes() == before
    assert list(JournalReader(tmp_path).records()) == written
    assert recover(tmp_path, tails_only=True).resealed == []


def test_pages_read_back_other_than_scanned_are_not_sealed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Failed before the fix: zeros read back (pages evicted after the failed write-back) were sealed 0400.

    The segment then read as a sealed one without its seal (corruption: the forwarder stops).
    Read again after the fdatasync, it no longer reads as scanned: it stays writable, and the
    next start repairs it as the torn tail it now is, every durable record kept.
    """
    path, written = _abandoned_seal(tmp_path, Durability.FSYNC)
    seal_at = path.stat().st_size - _SEAL_BYTES
    real = os.pread

    def evicted(fd: int, n: int, offset: int) -> bytes:
        """The seal's bytes as the disk holds them after their failed write-back: zeros."""
        data = real(fd, n, offset)
        kept = max(0, min(len(data), seal_at - offset))
        return data[:kept] + b"\0" * (len(data) - kept)

    monkeypatch.setattr(os, "pread", evicted)
    with caplog.at_level(logging.WARNING, "hybridq.journal"):
        report = recover(tmp_path, tails_only=True)
    monkeypatch.setattr(os, "pread", real)
    assert report.resealed == []
    assert path.stat().st_mode & 0o777 == 0o600
    assert [r.message for r in caplog.records if "no longer reads as it did" in r.message]
    nxt = recover(tmp_path, tails_only=True)
    assert [t.offset for t in nxt.repaired] == [seal_at]
    assert nxt.sealed == [str(path)]
    assert path.stat().st_mode & 0o777 == 0o400
    assert list(JournalReader(tmp_path).records()) == written


def test_a_read_back_that_fails_or_comes_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed read is the start's failure, named ``read`` (it said ``write``); so is a read that
    returns nothing (the file shorter than scanned), which looped for ever. The mode is not set."""
    path, written = _abandoned_seal(tmp_path, Durability.FSYNC)

    def failing(fd: int, n: int, offset: int) -> bytes:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "pread", failing)
    with pytest.raises(JournalIOError) as failed:
        recover(tmp_path, tails_only=True)
    assert failed.value.op == "read"
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: b"")
    with pytest.raises(JournalIOError) as short:
        recover(tmp_path, tails_only=True)
    assert short.value.op == "read"
    assert path.stat().st_mode & 0o777 == 0o600
    monkeypatch.undo()
    assert recover(tmp_path, tails_only=True).resealed == [str(path)]
    assert list(JournalReader(tmp_path).records()) == written


@pytest.mark.parametrize("durability", list(Durability))
def test_after_recoverys_own_seal_failed_the_rewrite_starts_at_the_dead_writers_frontier(
    tmp_path: Path, durability: Durability
) -> None:
    """Failed before the first fix: recovery's seal states every record durable, so after
    its fdatasync failed the next start wrote the seal again only, 0400 over records never on disk.

    The dead writer's last data record states what it had fsynced when it was written (with
    ``fsync``, the batch before its own; with ``no-fsync``, none): the next start writes again
    from there, the smaller of that and what the seal states.
    """
    writer = JournalWriter(tmp_path, durability=durability)
    first = writer.append_many([b"job-%d" % i * 50 for i in range(25)])
    second = writer.append_many([b"job-%d" % i * 50 for i in range(25, 50)])
    abandon_writer(writer)  # killed
    fails = _SyncFails()
    fails.fail = True
    with pytest.raises(JournalIOError):
        recover(tmp_path, tails_only=True, fileops=fails)  # the start seals it; its fdatasync fails
    calls = CallSpy()
    report = recover(tmp_path, tails_only=True, fileops=calls)  # the next start
    assert len(report.resealed) == 1
    size = os.path.getsize(report.resealed[0])
    start = (first if durability == Durability.NO_FSYNC else second)[0].offset
    assert calls.spans == [(start, size)]


def test_a_punched_segment_gets_its_seal_only_written_again(tmp_path: Path) -> None:
    """Its records are not written again, even if its seal states them unsynced (``no-fsync``).

    A hole map is written only for a sealed segment whose seal's fdatasync succeeded (its mode
    0400), so they are durable; and writing them again would write its punched ranges back
    (zeros, on disk again). Failed with the ``info.punched`` shortcut dropped.
    """
    with JournalWriter(tmp_path, durability=Durability.NO_FSYNC) as writer:
        writer.append_many([b"job-%d" % i for i in range(5)])
    ((writer_id, (index,)),) = list_chains(str(tmp_path)).items()
    middle = list(JournalReader(tmp_path).segment_records(writer_id, index))[2]
    punch_holes(
        str(tmp_path), writer_id, index, [Hole(middle.offset, middle.end, middle.seq, middle.seq + 1, 1)]
    )
    path = tmp_path / segment_name(writer_id, index)
    path.chmod(0o600)  # a kill inside a later punch's chmod u+w
    size = path.stat().st_size
    calls = CallSpy()
    assert recover(tmp_path, tails_only=True, fileops=calls).resealed == [str(path)]
    assert calls.spans == [(size - _SEAL_BYTES, size)]
    assert path.stat().st_mode & 0o777 == 0o400


def test_an_acknowledged_record_under_recoverys_failed_seal_is_never_cut(tmp_path: Path) -> None:
    """Failed before the fix (the start cut it as a torn tail, "none was acknowledged"): as on main,
    damage in a record its writer acknowledged is refused.

    Recovery's seal stated the dead writer's frontier as its last record states it: before
    its last batch, which ``fsync`` acknowledged. A later start, the seal left writable (its
    fdatasync failed, or a kill before the chmod) and that record damaged, read the seal as a
    witness that the record was never durable. Recovery's seal states every record durable.
    """
    writer = JournalWriter(tmp_path, durability=Durability.FSYNC)
    writer.append_many([b"job-%d" % i * 10 for i in range(5)])  # acknowledged: fsynced first
    abandon_writer(writer)  # killed
    assert len(recover(tmp_path, tails_only=True).sealed) == 1  # the start seals its chain
    ((writer_id, (index,)),) = list_chains(str(tmp_path)).items()
    path = tmp_path / segment_name(writer_id, index)
    path.chmod(0o600)  # its seal's fdatasync failed, or a kill before its chmod
    last = list(JournalReader(tmp_path).records())[-1]
    damaged = bytearray(path.read_bytes())
    damaged[last.offset + 20] ^= 1
    path.write_bytes(damaged)
    with pytest.raises(JournalCorruption):
        recover(tmp_path, tails_only=True)
    assert path.read_bytes() == damaged


def test_finding_where_to_write_again_fails_or_reads_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Failed before the fix: an EIO there escaped as a raw OSError, damage as JournalCorruption.

    An error reading is the start's (:class:`JournalIOError`, op ``read``); damage read there
    is only "not as scanned": the segment is left writable, one warning, as when it is read
    again after its fdatasync.
    """
    path, written = _abandoned_seal(tmp_path, Durability.NO_FSYNC)
    real = JournalReader.segment_records

    def failing(self: JournalReader, *args: object, **kwargs: object) -> Iterator[Record]:
        raise OSError(errno.EIO, "I/O error")
        yield  # pragma: no cover

    def damaged(self: JournalReader, *args: object, **kwargs: object) -> Iterator[Record]:
        raise JournalCorruption(str(path), 0, "bad record")
        yield  # pragma: no cover

    monkeypatch.setattr(JournalReader, "segment_records", failing)
    with pytest.raises(JournalIOError) as failed:
        recover(tmp_path, tails_only=True)
    assert failed.value.op == "read"
    monkeypatch.setattr(JournalReader, "segment_records", damaged)
    calls = CallSpy()
    with caplog.at_level(logging.WARNING, "hybridq.journal"):
        assert recover(tmp_path, tails_only=True, fileops=calls).resealed == []
    assert "write" not in calls.names
    assert path.stat().st_mode & 0o777 == 0o600
    assert [r.message for r in caplog.records if "no longer reads as it did" in r.message]
    monkeypatch.setattr(JournalReader, "segment_records", real)
    assert recover(tmp_path, tails_only=True).resealed == [str(path)]
    assert list(JournalReader(tmp_path).records()) == written
