"""The limits of the ledger index's spill files (``hybridq.ledger.spill_files``), issue 29's review.

Open descriptors (at most ``OPEN_MAX``, any number of spilled maps under a low
``RLIMIT_NOFILE``), a killed process's files (removed by the next start), a nearly full disk (the
margin, the backoff after a failed write, a partial file removed), checks over the cap (a spilled
map is not written again), reads that need none, copies refused; and the index's spill rule
through its public methods (down to three quarters of the cap, the next check after a
``forget_segment``, a punched map spilled again, the merge threshold after an append).
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from hybridq.errors import JournalIOError
from hybridq.ledger import outcome_disk, outcome_spill, outcomes, spill_files
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.outcome_spill import SpilledArrays
from hybridq.ledger.outcomes import SegmentOutcomes

from tests.unit.test_segment_outcomes import check_same, check_whole

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with writes allowed, and leaves no backoff to the next one."""
    monkeypatch.setattr(spill_files, "_resume_at", 0.0)
    monkeypatch.setattr(spill_files, "_warned", False)


def a_map(n: int, start: int = 4096) -> tuple[SegmentOutcomes, dict[int, str]]:
    model = {start + 300 * i: ("failed" if i % 7 == 0 else "succeeded") for i in range(n)}
    return SegmentOutcomes(model), dict(model)


def files_in(journal: Path) -> list[str]:
    where = journal / spill_files.SPILL_DIR
    return sorted(os.listdir(where)) if where.exists() else []


def index_of(sizes: dict[tuple[str, int], int]) -> LedgerIndex:
    index = LedgerIndex()
    for (writer, seg), n in sizes.items():
        for i in range(n):
            index.apply_succeeded((writer, seg, 4096 + 300 * i))
    return index


CHILD = textwrap.dedent(
    """
    import os, resource, sys
    from hybridq.ledger import outcome_spill, spill_files
    from hybridq.ledger.outcomes import SegmentOutcomes
    outcome_spill.SPILL_BLOCK = 4
    journal, maps = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    done = []
    for m in range(maps):
        one = SegmentOutcomes({4096 + 300 * i + m: "succeeded" for i in range(20)})
        assert one.spill(journal), m
        done.append(one)
    for m, one in enumerate(done):  # every map looked up again: its file opened again by name
        assert all(4096 + 300 * i + m in one for i in range(20)), m
        assert 4097 + 300 * 3 + m not in one
        assert one.count_below(4096 + 300 * 10 + m) == 10
    assert len(os.listdir("/proc/self/fd")) < 64
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(2)]  # the forwarder's next opens
    print(len(os.listdir(os.path.join(journal, spill_files.SPILL_DIR))), flush=True)
    os._exit(0)  # a kill: no map closed, its files left
    """
)


def test_more_spilled_maps_than_descriptors_answer_right_and_a_start_removes_a_kill_s_files(
    tmp_path: Path,
) -> None:
    """Fails before the fix: one descriptor a map, EMFILE past 64 (review of spill51, MEDIUM 1)."""
    ours, model = a_map(50)
    assert ours.spill(str(tmp_path))  # a file of this process's, live
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), "200"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == 201
    assert len(files_in(tmp_path)) == 201  # the killed process's 200 left
    LedgerIndex().spill_past(str(tmp_path), None)  # a start (no cap: removed all the same)
    assert len(files_in(tmp_path)) == 1
    check_whole(ours, model)  # this process's file kept
    ours.clear()
    assert files_in(tmp_path) == []


def test_at_most_open_max_descriptors_for_any_number_of_spilled_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outcome_spill, "SPILL_BLOCK", 4)
    monkeypatch.setattr(spill_files, "OPEN_MAX", 5)
    before = len(os.listdir("/proc/self/fd"))
    maps = [a_map(30, 4096 + m) for m in range(40)]
    for done, _ in maps:
        assert done.spill(str(tmp_path))
    assert len(os.listdir("/proc/self/fd")) <= before + 5
    for m, (done, model) in enumerate(maps):
        check_same(done, model, [*model, 4097 + m, 4096 + 300 * 30 + m])
        done[4096 + m] = "cancelled"  # a rank upgrade in place, in a file opened again
        model[4096 + m] = "cancelled"
    for done, model in maps:
        check_whole(done, model)
    assert len(files_in(tmp_path)) == 40
    assert len(os.listdir("/proc/self/fd")) <= before + 5
    del maps, done
    assert files_in(tmp_path) == []  # a map dropped: its file removed


def fake_statvfs(free: int, size: int) -> object:
    return SimpleNamespace(f_bavail=free // 4096, f_frsize=4096, f_blocks=size // 4096)


def test_the_margin_is_256_mib_or_5_percent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "statvfs", lambda path: fake_statvfs(1 << 30, 1 << 30))
    assert spill_files.margin(str(tmp_path)) == (1 << 30, 256 << 20)
    monkeypatch.setattr(os, "statvfs", lambda path: fake_statvfs(1 << 40, 1 << 42))
    assert spill_files.margin(str(tmp_path)) == (1 << 40, int((1 << 42) * 0.05))


def test_a_nearly_full_disk_is_not_written_and_is_asked_again_after_the_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails before the fix: every check wrote each map until ENOSPC (MEDIUM 2)."""
    now = [1000.0]
    monkeypatch.setattr(spill_files, "_clock", lambda: now[0])
    monkeypatch.setattr(outcome_disk, "SPILL_CHECK_MIN", 1)
    low = fake_statvfs((256 << 20) + 4096, 100 << 30)  # 256 MiB and a block free of 100 GiB: 5 % wanted
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: low)
    writes: list[int] = []
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: writes.append(1) or pwrite(*a))
    sizes = {("w", s): 200 for s in range(8)}
    index, plain = index_of(sizes), index_of(sizes)
    with caplog.at_level(logging.DEBUG, logger="hybridq.ledger"):
        index.spill_past(str(tmp_path), 300)
        index.spill_past(str(tmp_path), 300)
    assert not any(done.spilled for done in index.terminal.values())
    assert writes == []
    assert files_in(tmp_path) == []
    assert [r.levelno for r in caplog.records if "spill file" in r.getMessage()] == [logging.WARNING]
    monkeypatch.setattr(os, "statvfs", statvfs)  # room again, but within the backoff
    now[0] += spill_files.BACKOFF_S - 1
    index.spill_past(str(tmp_path), 300)
    assert writes == []
    now[0] += 2
    index.spill_past(str(tmp_path), 300)
    assert sum(done.spilled for done in index.terminal.values()) == 6  # all but the front
    assert index.terminal == plain.terminal


def test_a_failed_write_removes_its_file_and_holds_writes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: the next map was written at once, and every check again (MEDIUM 2)."""
    now = [1000.0]
    monkeypatch.setattr(spill_files, "_clock", lambda: now[0])
    monkeypatch.setattr(outcome_spill, "SPILL_BLOCK", 4)
    monkeypatch.setattr(outcome_spill, "_CHUNK_BLOCKS", 2)  # several writes a file
    calls: list[int] = []
    pwrite = os.pwrite

    def half_full(fd: int, data: bytes, at: int) -> int:
        calls.append(at)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, at)

    monkeypatch.setattr(os, "pwrite", half_full)
    sizes = {("w", s): 100 for s in range(6)}
    index, plain = index_of(sizes), index_of(sizes)
    index.spill_past(str(tmp_path), 100)
    assert len(calls) == 4  # one file's first three writes, then its fourth failed
    assert files_in(tmp_path) == []  # the partial file removed
    assert not any(done.spilled for done in index.terminal.values())
    for _ in range(3):
        index.spill_past(str(tmp_path), 100)
    assert len(calls) == 4  # no write within the backoff
    assert index.terminal == plain.terminal
    monkeypatch.setattr(os, "pwrite", pwrite)
    now[0] += spill_files.BACKOFF_S
    index.spill_past(str(tmp_path), 100)
    assert sum(done.spilled for done in index.terminal.values()) == 4
    assert index.terminal == plain.terminal


def test_checks_over_the_cap_leave_spilled_maps_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: every check rewrote each spilled map with a late finish (MEDIUM 3)."""
    monkeypatch.setattr(outcome_disk, "SPILL_CHECK_MIN", 1)
    sizes = {(f"w{w}", s): (400 if s >= 10 else 100) for w in range(3) for s in range(12)}
    index, plain = index_of(sizes), index_of(sizes)
    index.spill_past(str(tmp_path), 1000)  # the fronts alone hold 2,400: over the cap at every check
    spilled = [seg for seg, done in index.terminal.items() if done.spilled]
    assert len(spilled) == 30
    written: list[str] = []
    write, append = SpilledArrays.write, SpilledArrays.append
    monkeypatch.setattr(SpilledArrays, "write", classmethod(lambda cls, *a: written.append("w") or write(*a)))
    monkeypatch.setattr(SpilledArrays, "append", lambda self, *a: written.append("a") or append(self, *a))
    for late in range(5):
        for index_ in (index, plain):
            for writer, seg in spilled:
                index_.apply_succeeded(
                    (writer, seg, 4096 + 300 * (late * 10 + 1) + 1)
                )  # inside its file's range
        index.spill_past(str(tmp_path), 1000)
    assert written == []
    assert index.terminal == plain.terminal
    assert all(len(index.terminal[seg].recent) == 5 for seg in spilled)


def test_below_past_the_last_offset_reads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outcome_spill, "SPILL_BLOCK", 4)
    done, model = a_map(50)
    assert done.spill(str(tmp_path))
    outcome_spill._kept = (0, -1, outcome_spill._kept[2])  # no block kept
    reads: list[int] = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda *a: reads.append(1) or pread(*a))
    assert done.count_below(max(model) + 1) == 50
    assert done.count_below(2**64) == 50
    assert reads == []
    assert done.count_below(max(model)) == 49
    assert reads == [1]


def test_a_spilled_map_refuses_a_copy(tmp_path: Path) -> None:
    done, model = a_map(20)
    assert done.spill(str(tmp_path))
    spill = done._spill
    for make in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied"):
            make(spill)
    for make in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError):
            make(done)
    check_whole(done, model)


def test_a_punched_spilled_map_is_spilled_again(tmp_path: Path) -> None:
    done, model = a_map(100)
    assert done.spill(str(tmp_path))
    first = files_in(tmp_path)
    done.drop_ranges([(4096 + 300, 4096 + 300 * 4, 3)])  # three that succeeded
    assert done.spilled
    assert done.resident() == 0
    assert len(files_in(tmp_path)) == 1
    assert files_in(tmp_path) != first
    check_same(done, model, [*model, 4096 + 300 * 100])


def test_a_spilled_map_appends_less_often_as_it_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done, model = a_map(640)
    assert done.spill(str(tmp_path))
    appends: list[int] = []
    append = SpilledArrays.append
    monkeypatch.setattr(SpilledArrays, "append", lambda self, *a: appends.append(1) or append(self, *a))
    for i in range(640, 20_000):
        done.insert(4096 + 300 * i, "succeeded")
        model[4096 + 300 * i] = "succeeded"
        assert done.resident() <= max(outcomes.MERGE_FLOOR, len(done) // outcomes.MERGE_FRACTION) + 1
    assert 100 < len(appends) < 400  # a merge at each 64th more (about 64 x ln(20,000 / 640) = 220)
    check_same(done, model, [4096, 4097, 4096 + 300 * 19_999])


def test_the_index_spills_down_to_three_quarters_of_its_cap(tmp_path: Path) -> None:
    index = index_of({("w", s): 300 for s in range(6)})  # 1,800; the front holds 600
    index.spill_past(str(tmp_path), 1500)
    assert sum(done.resident() for done in index.terminal.values()) <= 1500 * 0.75
    assert sum(done.spilled for done in index.terminal.values()) == 3


def test_a_forgotten_segment_brings_the_next_check_closer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outcome_disk, "SPILL_CHECK_MIN", 1)
    index = index_of({("w", 0): 2000, ("w", 8): 1, ("w", 9): 1})
    index.spill_past(str(tmp_path), 1000)  # (w, 0) spilled: 2,002 jobs, the next check 125 on
    assert index.terminal[("w", 0)].spilled
    index.forget_segment(("w", 0))  # 2,000 jobs fewer: the next check 2,000 sooner too
    for i in range(1100):
        index.apply_succeeded(("w", 1, 4096 + 300 * i))
    index.check_spill()
    assert index.terminal[("w", 1)].spilled
    assert files_in(tmp_path) != []
    index.forget_segment(("w", 1))
    assert files_in(tmp_path) == []


def test_a_file_opened_again_gives_the_descriptors_back_or_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE at a reopen: the files kept open are closed first; a file gone: the I/O error."""
    monkeypatch.setattr(outcome_spill, "SPILL_BLOCK", 4)
    monkeypatch.setattr(spill_files, "OPEN_MAX", 2)
    maps = [a_map(30, 4096 + m) for m in range(3)]
    for done, _ in maps:
        assert done.spill(str(tmp_path))
    real, failed = os.open, []

    def full_table(path: str, flags: int, *mode: int) -> int:
        if not failed:
            failed.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real(path, flags, *mode)

    monkeypatch.setattr(os, "open", full_table)
    first, model = maps[0]  # closed: the least recently used
    check_same(first, model, list(model))
    assert len(failed) == 1
    assert len(spill_files._open) == 1
    monkeypatch.setattr(os, "open", real)
    gone, model = maps[1]
    spill = gone._spill
    assert spill is not None
    assert spill._serial not in spill_files._open  # closed: opened again by name, gone
    os.unlink(spill.path)
    with pytest.raises(JournalIOError, match="spill file"):
        4096 + 1 + 300 * 5 in gone  # noqa: B015
