"""A crash can leave a sealed last segment writable: a kill between its seal's fdatasync and chmod,
or between the ledger punch's ``chmod u+w`` and its write, or a seal whose fdatasync failed.

The seal of a segment is told by its mode (0400: docs/journal-format.md, *Seal*), and the saved
ledger index is trusted only if each chain it covers reaches its position: "read to the end of
its sealed last segment" needs that segment's seal. The start's recovery of the tails seals
such a segment again before the saved index is checked, or every start replays the whole ledger
for nothing: the bytes that may not be durable (its seal, and the records its writer had not
fsynced) written again in place, fdatasync'd, read again, and only then the mode.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
from pathlib import Path
from typing import Any

import pytest
from hybridq.errors import JournalIOError
from hybridq.journal import JournalWriter, recovery
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.fileops import OS_FILEOPS, FileOps
from hybridq.journal.format import segment_name
from hybridq.journal.holes import Hole, punch_holes
from hybridq.journal.reader import JournalReader, list_chains
from hybridq.journal.recovery import recover
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import ledger_dir, open_ledger_writer

from tests.support.faulty import CallSpy
from tests.support.writers import closed_ledger
from tests.unit import test_ledger_replay
from tests.unit.test_saved_index import entries, save_now


def test_a_sealed_last_ledger_segment_left_writable_by_a_kill_keeps_the_saved_index(tmp_path: Path) -> None:
    """Failed on main: the segment read as unsealed, the saved index was refused (a whole replay)."""
    rng = random.Random(7)
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    chain = open_ledger_writer(journal)
    chain.max_segment_bytes = 2048
    chain.append_many(e.to_bytes() for e in entries(rng, writer, 120))
    chain.close()  # a run's clean stop: its last segment sealed
    ledger = ledger_dir(journal)
    ((ledger_writer, indices),) = list_chains(ledger).items()
    last = indices[-1]
    save_now(journal, Compacted())
    # An earlier pass punched the first record of the last segment (its map durable), then the
    # next pass's chmod u+w of it came, and the kill before the write and chmod back.
    first = next(JournalReader(ledger).segment_records(ledger_writer, last))
    punch_holes(ledger, ledger_writer, last, [Hole(first.offset, first.end, first.seq, first.seq + 1, 1)])
    path = Path(ledger) / segment_name(ledger_writer, last)
    path.chmod(0o600)

    recover(ledger, tails_only=True)  # the start's order (ForwarderState.load)
    _, _, resumed = saved_index.resume(journal, Compacted(), KeyTable.in_journal(journal))
    assert resumed == 1
    assert path.stat().st_mode & 0o777 == 0o400


def test_a_kill_between_the_seal_fdatasync_and_its_chmod_keeps_the_saved_index(tmp_path: Path) -> None:
    """Failed on main: the segment stayed writable, and every start replayed the whole ledger."""
    journal, path = closed_ledger(tmp_path)
    path.chmod(0o600)  # the seal's records written and fdatasync'd: the kill came before its chmod
    sealed = path.read_bytes()
    for _ in range(2):  # two starts: each saves what it read, as the forwarder does
        report = recover(ledger_dir(journal), tails_only=True)
        keys = KeyTable.in_journal(journal)
        index, read, resumed = saved_index.resume(journal, Compacted(), keys)
        assert resumed == 1
        saved_index.save(journal, index, read, {})
        keys.close()
    assert report.resealed == []  # the first start sealed it again: the second had nothing to do
    assert path.stat().st_mode & 0o777 == 0o400
    assert path.read_bytes() == sealed  # the same seal, written again


def _punched_and_left_writable(directory: Path) -> Path:
    """A chain's sealed last segment with a hole map, left 0600 as a kill inside the punch's chmod does."""
    with JournalWriter(directory) as writer:
        writer.append_many([b"job-%d" % i for i in range(5)])
    ((writer_id, (index,)),) = list_chains(str(directory)).items()
    first = next(JournalReader(directory).segment_records(writer_id, index))
    punch_holes(
        str(directory), writer_id, index, [Hole(first.offset, first.end, first.seq, first.seq + 1, 1)]
    )
    path = directory / segment_name(writer_id, index)
    path.chmod(0o600)
    return path


def test_a_segment_whose_lock_is_held_is_left_to_its_holder(tmp_path: Path) -> None:
    """A live writer holds its segment's flock until its own chmod: the start must not race it."""
    path = _punched_and_left_writable(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert recover(tmp_path, tails_only=True).resealed == []
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.close(fd)
    assert recover(tmp_path, tails_only=True).resealed == [str(path)]  # the lock gone: restored
    assert path.stat().st_mode & 0o777 == 0o400


def test_a_segment_changed_since_the_scan_is_not_made_read_only(tmp_path: Path) -> None:
    """Bytes appended after the scan: it is not the segment the scan read sealed, so left as it is,
    nothing written (the check under the lock, before any write: the read after the fdatasync
    alone would have refused the mode, but written first)."""
    path = _punched_and_left_writable(tmp_path)
    reader = JournalReader(tmp_path)
    reader.check(tails_only=True)
    (info,) = reader.chain_ends.values()
    assert info.sealed
    with path.open("ab") as f:
        f.write(b"\0" * 16)
    before, spy = path.read_bytes(), CallSpy()
    assert not recovery._seal_again(spy, info)
    assert path.read_bytes() == before
    assert not {"write", "fdatasync", "fchmod"} & set(spy.names)
    assert path.stat().st_mode & 0o777 == 0o600
    os.truncate(path, info.end_offset)
    assert recovery._seal_again(OS_FILEOPS, info)
    assert path.stat().st_mode & 0o777 == 0o400


def test_a_journal_chain_left_writable_is_sealed_again_for_its_compaction(tmp_path: Path) -> None:
    """The journal's own chains too (recover() is the forwarder's start for all three).

    Failed on main: a producer's last segment left writable by a kill before its seal's chmod
    had no seal by its mode, so its compaction (``sealed_data_count``) never took it.
    """
    with JournalWriter(tmp_path) as writer:
        writer.append_many([b"job-%d" % i for i in range(5)])
    ((writer_id, (index,)),) = list_chains(str(tmp_path)).items()
    (tmp_path / segment_name(writer_id, index)).chmod(0o600)
    assert sealed_data_count(str(tmp_path), writer_id, index) is None
    assert recover(tmp_path, tails_only=True).resealed == [str(tmp_path / segment_name(writer_id, index))]
    assert sealed_data_count(str(tmp_path), writer_id, index) == 5


def test_an_io_error_looking_at_the_mode_is_raised_not_taken_for_a_seal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before the fix: the stat's EIO escaped raw (not a JournalIOError naming the file).

    Whether the start seals a segment again, or leaves one its writer sealed meanwhile (a write
    open refused), goes by its mode: an error reading the mode is the start's failure.
    """
    path = _punched_and_left_writable(tmp_path)
    reader = JournalReader(tmp_path)
    reader.check(tails_only=True)
    (info,) = reader.chain_ends.values()
    real_stat = os.stat

    def stat(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(name) == str(path):
            raise OSError(errno.EIO, "I/O error")
        return real_stat(name, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(JournalIOError, match="stat"):
        recovery._seal_again(OS_FILEOPS, info)

    class Refused(FileOps):
        def open(self, name: str, flags: int, mode: int = 0o600) -> int:
            raise PermissionError(errno.EACCES, "Permission denied", name)

    # The open refused, then the mode unreadable.
    with pytest.raises(JournalIOError, match="stat"), recovery._locked(Refused(), str(path), os.O_RDWR):
        pass
