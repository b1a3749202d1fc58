"""A start that seals again a ledger segment a crash left sealed and writable, stopped at each step.

The start's recovery writes the seal records again in place (the same bytes), fdatasyncs, reads
the segment again, chmods 0400 and fsyncs (hybridq/journal/recovery.py, ``_seal_again``; docs/journal-format.md, *Seal*).
Here it stops before each of its file operations in turn: the process killed (every byte written
stays, its flock goes; ``write`` also cut in half), or the power cut (tests/support/powerloss.py:
what no fsync covered is dropped, torn or garbled, a mode no fsync covered kept or reverted). After each stop the next start must leave the
segment sealed and read-only with every record in it, accept the saved ledger index (no
replay of the whole ledger), and a start after it must find nothing to do.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from pathlib import Path

import pytest
from hybridq.errors import HybridqError
from hybridq.journal import JournalReader
from hybridq.journal.recovery import recover
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import ledger_dir

from tests.crash.test_repair_power_loss import KillAt, _Killed
from tests.support.faulty import CallSpy
from tests.support.powerloss import MODES, PowerLossFileOps
from tests.support.writers import closed_ledger


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[bytes]]:
    """A journal whose ledger's last segment is sealed and left 0600; that segment; its records."""
    base = tmp_path_factory.mktemp("seal-again")
    journal, segment = closed_ledger(base)
    segment.chmod(0o600)  # killed between the seal's fdatasync and its chmod
    records = [r.payload for r in JournalReader(ledger_dir(journal)).records()]
    return Path(journal), segment.relative_to(journal), records


def _copy(template: tuple[Path, Path, list[bytes]], to: Path) -> tuple[str, Path]:
    journal, segment, _ = template
    shutil.copytree(journal, to / "journal")
    return str(to / "journal"), to / "journal" / segment


def _seal_steps(template: tuple[Path, Path, list[bytes]], tmp_path: Path) -> range:
    """The operation numbers of the start's recovery from its ``write`` on (the sealing again)."""
    ops = CallSpy()
    journal, _ = _copy(template, tmp_path / "names")
    assert recover(ledger_dir(journal), tails_only=True, fileops=ops).resealed
    first = ops.names.index("write")
    assert ops.names[first : first + 2] == ["write", "fdatasync"]
    assert ops.names[-3:] == ["fchmod", "fsync", "close"]  # the segment read again in between
    return range(first, len(ops.names))


def _after_the_stop(journal: str, segment: Path, records: list[bytes]) -> None:
    """The next start: the segment sealed, read-only, whole; the saved index accepted; then nothing to do."""
    ledger = ledger_dir(journal)
    recover(ledger, tails_only=True)
    assert segment.stat().st_mode & 0o777 == 0o400
    assert [r.payload for r in JournalReader(ledger).records()] == records
    keys = KeyTable.in_journal(journal)
    try:
        assert saved_index.resume(journal, Compacted(), keys)[2] == 1
    finally:
        keys.close()
    again = recover(ledger, tails_only=True)
    assert again.resealed == again.sealed == again.repaired == []


class _HalfWrite(KillAt):
    """Killed in the middle of its ``write``: three quarters of the bytes written."""

    def write(self, fd: int, data: bytes | memoryview) -> int:
        os.write(fd, bytes(data[: len(data) * 3 // 4]))
        raise _Killed("write")


def test_a_kill_at_each_step_of_sealing_again(
    tmp_path: Path, template: tuple[Path, Path, list[bytes]]
) -> None:
    for at in _seal_steps(template, tmp_path):
        journal, segment = _copy(template, tmp_path / str(at))
        with contextlib.suppress(_Killed):
            recover(ledger_dir(journal), tails_only=True, fileops=KillAt(at))
        try:
            _after_the_stop(journal, segment, template[2])
        except AssertionError as exc:
            raise AssertionError(f"killed before operation {at + 1}: {exc}") from exc
    journal, segment = _copy(template, tmp_path / "half")
    with pytest.raises(_Killed):
        recover(ledger_dir(journal), tails_only=True, fileops=_HalfWrite(10**6))
    assert segment.read_bytes() == (template[0] / template[1]).read_bytes()  # the same bytes
    assert segment.stat().st_mode & 0o777 == 0o600
    _after_the_stop(journal, segment, template[2])


@pytest.mark.parametrize("mode", MODES)
def test_a_power_cut_at_each_step_of_sealing_again(
    tmp_path: Path, template: tuple[Path, Path, list[bytes]], mode: str
) -> None:
    for at in _seal_steps(template, tmp_path):
        journal, segment = _copy(template, tmp_path / str(at))
        ops = PowerLossFileOps(crash_at=at, crash_mode=mode, rng=random.Random(at))
        with contextlib.suppress(OSError, HybridqError):
            recover(ledger_dir(journal), tails_only=True, fileops=ops)
        assert ops.crashed, at
        ops.release()
        try:
            _after_the_stop(journal, segment, template[2])
        except AssertionError as exc:
            raise AssertionError(f"power cut before operation {at + 1} ({mode}): {exc}") from exc
