"""A start that seals again a segment a crash left sealed and writable, stopped at each step.

The start's recovery writes the bytes that may not be durable again in place (the same bytes),
fdatasyncs, reads the segment again, chmods 0400 and fsyncs (hybridq/journal/recovery.py,
``_seal_again``; docs/journal-format.md, *Seal*). Three such segments: a ledger's, whose last
batch began in an earlier segment, and a ``no-fsync`` journal's, none of whose records states
any record fsynced (both written again from the first record); and one recovery sealed for a
killed ``fsync`` writer (its seal states every record durable, its last data record the batch
before its own: written again from the middle record that batch starts at). Here the start stops
before each of its file operations in turn: the process killed (every byte written stays, its
flock goes; ``write`` also cut in half), or the power cut (tests/support/powerloss.py: what no
fsync covered is dropped, torn or garbled, a mode no fsync covered kept or reverted). After each
stop the next start must leave the segment sealed and read-only with every record in it (for
the ledger: accept the saved ledger index, no replay of the whole ledger), and a start after it
must find nothing to do.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from hybridq.errors import HybridqError
from hybridq.journal import Durability, JournalReader, JournalWriter
from hybridq.journal.format import parse_segment_name, segment_name
from hybridq.journal.reader import list_chains
from hybridq.journal.recovery import recover
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import ledger_dir

from tests.crash.test_repair_power_loss import KillAt, _Killed
from tests.support.faulty import CallSpy
from tests.support.powerloss import MODES, PowerLossFileOps
from tests.support.writers import abandon_writer, closed_ledger


@dataclass(frozen=True)
class _Template:
    """A journal (``root``) with a sealed segment left 0600 (``segment``, under it); its records."""

    root: Path
    directory: str  # the journal directory recovered, relative to ``root``
    segment: Path
    records: list[bytes]
    ledger: bool  # the ledger's: the saved index must be accepted after the stop
    rewrite_from: int  # the offset the start writes again from


@pytest.fixture(scope="module", params=["ledger", "no-fsync", "recovered"])
def template(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> _Template:
    """Killed between the seal's fdatasync and its chmod: a closed ledger, a ``no-fsync`` journal,
    or the seal the start's recovery wrote for a killed ``fsync`` writer of two batches."""
    base = tmp_path_factory.mktemp("seal-again")
    if request.param == "ledger":
        journal, segment = closed_ledger(base)
        directory = ledger_dir(journal)
    else:
        directory = journal = str(base / "journal")
        durability = Durability.NO_FSYNC if request.param == "no-fsync" else Durability.FSYNC
        writer = JournalWriter(directory, durability=durability)
        writer.append_many([b"job-%d" % i * 20 for i in range(20)])
        writer.append_many([b"job-%d" % i * 20 for i in range(20, 40)])
        if request.param == "recovered":
            abandon_writer(writer)  # killed
            assert recover(directory, tails_only=True).sealed
        else:
            writer.close()
        ((writer_id, (index,)),) = list_chains(directory).items()
        segment = Path(directory) / segment_name(writer_id, index)
    segment.chmod(0o600)
    records = [r.payload for r in JournalReader(directory).records()]
    named = parse_segment_name(segment.name)
    assert named is not None
    in_segment = list(JournalReader(directory).segment_records(*named))
    rewrite_from = in_segment[20 if request.param == "recovered" else 0].offset
    root = Path(journal)
    return _Template(
        root,
        os.path.relpath(directory, root),
        segment.relative_to(root),
        records,
        request.param == "ledger",
        rewrite_from,
    )


def _copy(template: _Template, to: Path) -> tuple[str, Path]:
    """A copy of the template's journal: the directory to recover, and the segment."""
    shutil.copytree(template.root, to / "journal")
    return os.path.normpath(to / "journal" / template.directory), to / "journal" / template.segment


def _seal_steps(template: _Template, tmp_path: Path) -> range:
    """The operation numbers of the start's recovery from its ``write`` on (the sealing again)."""
    ops = CallSpy()
    directory, segment = _copy(template, tmp_path / "names")
    assert recover(directory, tails_only=True, fileops=ops).resealed
    assert ops.spans == [(template.rewrite_from, segment.stat().st_size)]
    first = ops.names.index("write")
    assert ops.names[first : first + 2] == ["write", "fdatasync"]
    assert ops.names[-3:] == ["fchmod", "fsync", "close"]
    return range(first, len(ops.names))


def _after_the_stop(template: _Template, directory: str, segment: Path) -> None:
    """The next start: the segment sealed, read-only, whole; the saved index accepted; then nothing to do."""
    recover(directory, tails_only=True)
    assert segment.stat().st_mode & 0o777 == 0o400
    assert [r.payload for r in JournalReader(directory).records()] == template.records
    if template.ledger:
        journal = str(Path(directory).parent)
        keys = KeyTable.in_journal(journal)
        try:
            assert saved_index.resume(journal, Compacted(), keys)[2] == 1
        finally:
            keys.close()
    again = recover(directory, tails_only=True)
    assert again.resealed == again.sealed == again.repaired == []


class _HalfWrite(KillAt):
    """Killed in the middle of its ``write``: three quarters of the bytes written."""

    def write(self, fd: int, data: bytes | memoryview) -> int:
        os.write(fd, bytes(data[: len(data) * 3 // 4]))
        raise _Killed("write")


def test_a_kill_at_each_step_of_sealing_again(tmp_path: Path, template: _Template) -> None:
    for at in _seal_steps(template, tmp_path):
        directory, segment = _copy(template, tmp_path / str(at))
        with contextlib.suppress(_Killed):
            recover(directory, tails_only=True, fileops=KillAt(at))
        try:
            _after_the_stop(template, directory, segment)
        except AssertionError as exc:
            raise AssertionError(f"killed before operation {at + 1}: {exc}") from exc
    directory, segment = _copy(template, tmp_path / "half")
    with pytest.raises(_Killed):
        recover(directory, tails_only=True, fileops=_HalfWrite(10**6))
    assert segment.read_bytes() == (template.root / template.segment).read_bytes()  # the same bytes
    assert segment.stat().st_mode & 0o777 == 0o600
    _after_the_stop(template, directory, segment)


@pytest.mark.parametrize("mode", MODES)
def test_a_power_cut_at_each_step_of_sealing_again(tmp_path: Path, template: _Template, mode: str) -> None:
    for at in _seal_steps(template, tmp_path):
        directory, segment = _copy(template, tmp_path / str(at))
        ops = PowerLossFileOps(crash_at=at, crash_mode=mode, rng=random.Random(at))
        with contextlib.suppress(OSError, HybridqError):
            recover(directory, tails_only=True, fileops=ops)
        assert ops.crashed, at
        ops.release()
        try:
            _after_the_stop(template, directory, segment)
        except AssertionError as exc:
            raise AssertionError(f"power cut before operation {at + 1} ({mode}): {exc}") from exc
