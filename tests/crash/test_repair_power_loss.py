"""``hybridq journal repair --accept-loss`` cut short at each of its file operations.

The repair backs up every file it changes or removes, moves a damaged chain's later segments
into the backup, trims the cut segment's hole map, then replaces the segment by a sealed copy of
its good prefix (hybridq/journal/repair_apply.py), each step durable before the next
(docs/reliability.md rules 5, 6 and 11). Here the machine stops before each of those operations
in turn: the process killed (every byte written stays), or the power cut
(tests/support/powerloss.py: what no fsync covered is dropped, torn or garbled, and directory
entries no directory fsync covered are undone). After each stop the journal must be either
still refused or repaired exactly; a second repair (or a start, once repaired) must then keep
every record before the damage and exactly the punched ranges before the cut, and some backup
must hold every file the repairs changed or removed, byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hybridq.errors import HybridqError, JournalCorruption
from hybridq.journal import JournalReader, JournalWriter, Record
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import segment_name
from hybridq.journal.holes import IDS_SUFFIX, Hole, add_holes, read_holes
from hybridq.journal.reader import list_chains
from hybridq.journal.recovery import recover, verify
from hybridq.journal.repair import BACKUP_PREFIX, REPORT_NAME
from hybridq.journal.statefile import STATE_SUFFIX
from hybridq.ledger.punched_ids import find_punched
from hybridq.ledger.store import ledger_dir
from hybridq.ops.journal_repair import FORWARDER_LOCK_NAME, repair

from tests.support.powerloss import MODES, PowerLossFileOps
from tests.unit.test_repair_punched_ledger import keys_lost, punched_ledger_damaged

SEGMENT = 64 << 10
#: Where the damage is, among segment 0's records; the punched ranges are on either side of it.
DAMAGED = 200
BEFORE = (1, 100)  # records 1-100 punched: kept by the repair
AFTER = (250, 270)  # records 250-270 punched: past the cut, trimmed from the map


@dataclass(frozen=True)
class Damaged:
    """A journal with damage in segment 0, and what a repair must leave of it."""

    template: Path
    writer_id: str
    kept: list[bytes]  # the payloads a repaired journal reads, in order
    holes: tuple[Hole, ...]  # segment 0's map after the repair
    files: dict[str, tuple[bytes, int]]  # every file of the damaged journal: bytes, mode


def _hole(records: list[Record], first: int, last: int) -> Hole:
    a, b = records[first], records[last]
    return Hole(a.offset, b.end, a.seq, b.seq + 1, last - first + 1)


def _files(journal: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.name: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
        for p in journal.iterdir()
        if p.is_file() and p.name != FORWARDER_LOCK_NAME
    }


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Damaged:
    """Four segments of one chain; segment 0 punched twice, then a bit flipped between the ranges."""
    template = tmp_path_factory.mktemp("repair") / "journal"
    template.mkdir(mode=0o700)
    with JournalWriter(template, max_segment_bytes=SEGMENT) as writer:
        for start in range(0, 1600, 10):  # one call is one append: it never spans segments
            writer.append_many([b"%06d" % i + b"x" * 100 for i in range(start, start + 10)])
    records = list(JournalReader(template).records())
    seg0 = [r for r in records if r.segment_index == 0]
    assert len(seg0) > AFTER[1] + 10
    assert max(r.segment_index for r in records) >= 2  # later segments for the repair to move
    writer_id = seg0[0].writer_id
    kept_holes = (_hole(seg0, *BEFORE),)
    add_holes(str(template), writer_id, 0, [*kept_holes, _hole(seg0, *AFTER)])
    path = template / segment_name(writer_id, 0)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(seg0[DAMAGED].offset + 20)
        f.write(b"\xff\xff")
    os.chmod(path, 0o400)
    kept = [seg0[0].payload] + [r.payload for r in seg0[BEFORE[1] + 1 : DAMAGED]]
    return Damaged(template, writer_id, kept, kept_holes, _files(template))


class _Killed(Exception):
    """The repair's process died here (SIGKILL): what it wrote stays, it does nothing more."""


class KillAt(FileOps):
    """The process dies when operation ``at`` + 1 starts: its fds close (its flocks go), and
    every later call fails too; what it wrote stays, as SIGKILL leaves the page cache."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.op_count = 0
        self.fds: set[int] = set()

    def _op(self, name: str) -> None:
        if self.op_count >= self.at:
            for fd in self.fds:
                os.close(fd)
            self.fds.clear()
            self.at = -1  # dead: every later call fails at once
            raise _Killed(name)
        self.op_count += 1

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._op("open")
        fd = super().open(path, flags, mode)
        self.fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        self._op("close")
        self.fds.discard(fd)
        super().close(fd)

    def __getattribute__(self, name: str) -> object:
        attr = super().__getattribute__(name)
        if name.startswith("_") or name in ("open", "close") or not callable(attr):
            return attr

        def op(*args: object, **kwargs: object) -> object:
            self._op(name)
            return attr(*args, **kwargs)

        return op


#: The calls that change what the disk holds; a stop before any other call leaves the disk as a
#: stop before the next of these does, so the sweeps stop only before these (after the last
#: one, the repair is whole: :func:`_stops` checks that run).
_WRITES = ("write", "fdatasync", "fsync", "ftruncate", "fchmod", "replace", "unlink", "mkdir", "fsync_dir")


class Recording(PowerLossFileOps):
    """A power-loss seam that never crashes, and lists which of its calls may change the disk."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[int] = []  # the numbers of the calls, from 0
        self.names: list[str] = []  # and their names

    def __getattribute__(self, name: str) -> object:
        attr = super().__getattribute__(name)
        if name not in (*_WRITES, "open"):
            return attr

        def op(*args: Any, **kwargs: Any) -> Any:
            if name != "open" or args[1] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                self.writes.append(self.op_count)
                self.names.append(name)
            return attr(*args, **kwargs)

        return op

    def stops(self) -> list[int]:
        """Where to stop a run like this one: before each call that may change the disk."""
        return list(self.writes)

    def directory_stops(self) -> list[int]:
        """A few stops: the first and last, and before the first and the last directory call
        (``replace``, ``unlink``, ``mkdir``, ``fsync_dir``) of each pair of it and the next one;
        the repair repeats its steps per file, and this takes the first and last of each."""
        kinds = ("replace", "unlink", "mkdir", "fsync_dir")
        calls = [(at, name) for at, name in zip(self.writes, self.names, strict=True) if name in kinds]
        pairs: dict[tuple[str, str], list[int]] = {}
        for (at, name), (_, after) in zip(calls, [*calls[1:], (-1, "")], strict=True):
            pairs.setdefault((name, after), []).append(at)
        stops = {self.writes[0], self.writes[-1]}
        for at in pairs.values():
            stops.update((at[0], at[-1]))
        return sorted(stops)


def _journal(tmp_path: Path, damaged: Damaged) -> Path:
    journal = tmp_path / "journal"
    shutil.copytree(damaged.template, journal)
    return journal


def _repaired_exactly(journal: Path, damaged: Damaged) -> None:
    verify(journal)
    assert [r.payload for r in JournalReader(journal).records()] == damaged.kept
    assert read_holes(str(journal), damaged.writer_id, 0) == damaged.holes


def _backed_up(journal: Path, damaged: Damaged) -> None:
    """Every file changed or removed is in a backup as it was; a backup with files has its report."""
    now = _files(journal)
    backups = [p for p in journal.iterdir() if p.is_dir() and p.name.startswith(BACKUP_PREFIX)]
    for backup in backups:
        if any(p.name != REPORT_NAME for p in backup.iterdir()):
            assert (backup / REPORT_NAME).is_file(), backup
    for name, (data, mode) in damaged.files.items():
        if now.get(name, (None, None))[0] == data:
            continue
        copies = [_files(b).get(name) for b in backups]
        assert (data, mode) in copies, f"{name}: changed or removed, and in no backup"


def _stops(tmp_path: Path, damaged: Damaged) -> tuple[list[int], int]:
    """Where to stop a repair (:meth:`Recording.stops`), and how many calls a whole one makes
    (after checking that it repairs as expected)."""
    journal = _journal(tmp_path / "count", damaged)
    ops = Recording()
    report = repair(journal, accept_loss=True, fileops=ops)
    assert report.applied
    _repaired_exactly(journal, damaged)
    _backed_up(journal, damaged)
    return ops.stops(), ops.op_count


def _after_the_stop(journal: Path, damaged: Damaged) -> None:
    """Refused or repaired exactly; then a second repair and a start leave it repaired exactly."""
    try:
        verify(journal)
    except JournalCorruption:
        pass  # still refused: the forwarder will not start on it
    else:
        _repaired_exactly(journal, damaged)
    again = repair(journal, accept_loss=True)
    assert again.applied or again.healthy
    _repaired_exactly(journal, damaged)
    recover(journal)  # the forwarder's start
    _repaired_exactly(journal, damaged)
    _backed_up(journal, damaged)


#: ``drop`` in the default run; ``tear`` and ``garble`` in the ``repair_sweep`` tier (the repair
#: writes whole files by temp file, fsync and rename: only bytes past the durable size differ).
SWEEP_MODES = [
    mode if mode == "drop" else pytest.param(mode, marks=pytest.mark.repair_sweep) for mode in MODES
]


@pytest.mark.parametrize("mode", SWEEP_MODES)
def test_a_power_cut_at_each_step_of_a_repair_loses_nothing_it_kept(
    tmp_path: Path, damaged: Damaged, mode: str
) -> None:
    rng = random.Random(f"repair-{mode}")
    stops, total = _stops(tmp_path, damaged)
    for at in stops:
        journal = _journal(tmp_path / f"{at}", damaged)
        ops = PowerLossFileOps(crash_at=at, crash_mode=mode, rng=rng)
        # The machine is off: EIO from whichever call comes next (none past the last closes,
        # whose errors the repair ignores).
        with contextlib.suppress(OSError, HybridqError):
            repair(journal, accept_loss=True, fileops=ops)
        assert ops.crashed, at
        ops.release()
        try:
            _after_the_stop(journal, damaged)
        except AssertionError as exc:
            raise AssertionError(f"power cut before operation {at + 1} of {total} ({mode}): {exc}") from exc
        shutil.rmtree(journal.parent)


def test_a_kill_at_each_step_of_a_repair_loses_nothing_it_kept(tmp_path: Path, damaged: Damaged) -> None:
    stops, total = _stops(tmp_path, damaged)
    for at in stops:
        journal = _journal(tmp_path / f"{at}", damaged)
        with contextlib.suppress(_Killed):  # none past the last closes, which the repair ignores
            repair(journal, accept_loss=True, fileops=KillAt(at))
        try:
            _after_the_stop(journal, damaged)
        except AssertionError as exc:
            raise AssertionError(f"killed before operation {at + 1} of {total}: {exc}") from exc
        shutil.rmtree(journal.parent)


@pytest.mark.parametrize(
    "every", [False, pytest.param(True, marks=pytest.mark.repair_sweep)], ids=["dirs", "all"]
)
def test_a_power_cut_at_each_step_of_a_ledger_repair_keeps_every_punched_keys_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: bool
) -> None:
    """The ledger's repair forgets the saved index first (hybridq/ops/journal_repair.py), then
    repairs a segment the ledger punch punched: whatever step the power goes at, a second repair
    keeps the map's ranges before the cut, a start finds every key the punch moved, and every
    ids file (the only record of the successes punched out of its segment) is beside its
    segment or, with a segment moved aside, in a backup, byte for byte. The default run stops at
    a few of its calls (:meth:`Recording.directory_stops`: 16 of the 150 that may change the
    disk); the ``repair_sweep`` tier before each of the 150."""
    template = tmp_path / "template" / "journal"
    template.mkdir(parents=True, mode=0o700)
    damaged = punched_ledger_damaged(template, monkeypatch)
    suffix = IDS_SUFFIX + STATE_SUFFIX
    ids = {p.name: p.read_bytes() for p in Path(damaged.ldir).iterdir() if p.name.endswith(suffix)}
    chain = list_chains(damaged.ldir)[damaged.chain]
    assert any(int(n.split("-")[1].split(".")[0]) > damaged.seg for n in ids), (ids, chain)  # some go

    def copy(name: str) -> tuple[Path, str]:
        journal = tmp_path / name / "journal"
        shutil.copytree(template, journal)
        return journal, ledger_dir(str(journal))

    journal, ldir = copy("count")
    counted = Recording()
    assert repair(ldir, accept_loss=True, fileops=counted).applied
    total = counted.op_count
    _ids_kept(ldir, ids)
    left = [n for n in os.listdir(ldir) if n.endswith(suffix)]
    assert all(os.path.exists(os.path.join(ldir, n.removesuffix(suffix))) for n in left), left
    rng = random.Random("ledger")
    for at in counted.stops() if every else counted.directory_stops():
        journal, ldir = copy(f"{at}")
        ops = PowerLossFileOps(crash_at=at, crash_mode=rng.choice(MODES), rng=rng)
        with contextlib.suppress(OSError, HybridqError):
            repair(ldir, accept_loss=True, fileops=ops)
        assert ops.crashed, at
        ops.release()
        repair(ldir, accept_loss=True)
        where = f"power cut before operation {at + 1} of {total} ({ops.crash_mode})"
        assert read_holes(ldir, damaged.chain, damaged.seg) == damaged.holes, where
        assert not keys_lost(journal, damaged), where
        try:
            _ids_kept(ldir, ids)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        shutil.rmtree(journal.parent)


def _ids_kept(ldir: str, ids: dict[str, bytes]) -> None:
    """Each ids file of ``ids`` beside its segment as it was, or in a backup beside it; all read.

    One whose segment is gone may also stay in the directory after a cut before its unlink (the
    next punch pass removes it: hybridq/ledger/punched_ids.py), as it was.
    """
    suffix = IDS_SUFFIX + STATE_SUFFIX
    backups = [p for p in Path(ldir).iterdir() if p.is_dir() and p.name.startswith(BACKUP_PREFIX)]
    for name, data in ids.items():
        here = Path(ldir) / name
        if (Path(ldir) / name.removesuffix(suffix)).exists():
            assert here.read_bytes() == data, f"{name}: changed beside its segment"
            continue
        assert not here.exists() or here.read_bytes() == data, f"{name}: changed without its segment"
        assert any(
            (b / name).is_file()
            and (b / name).read_bytes() == data
            and (b / name.removesuffix(suffix)).is_file()
            for b in backups
        ), f"{name}: its segment moved aside, and it is in no backup beside it"
    list(find_punched(ldir))  # every ids file left reads (a damaged one raises)
