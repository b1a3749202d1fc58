"""S4: the S3 power-loss harness must catch the bugs it claims to catch (docs/reliability.md).

Each deliberately broken build below is run through the *same* drivers S3 uses
(:func:`run_journal_rounds`, :func:`run_state_rounds`), with the same seeds; the harness must report
lost or damaged data for every one of them. If a refactoring of the harness ever stops checking
something (say, it reads the journal before the crash, or forgets to drop unsynced bytes), the
matching broken build goes undetected and this test fails.
"""

from __future__ import annotations

import os

from hybridq.journal.fileops import FileOps, write_all
from hybridq.journal.statefile import STATE_SUFFIX, encode_state
from hybridq.journal.writer import JournalWriter

from tests.crash.test_s3_power_loss import Outcome, run_journal_rounds, run_state_rounds
from tests.support.powerloss import PowerLossFileOps


class NoFsyncOps(PowerLossFileOps):
    """(a) The writer never calls fdatasync/fsync: the calls do nothing, nothing becomes durable."""

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync(self, fd: int) -> None:
        pass


class NoDirFsyncOps(PowerLossFileOps):
    """(b) The writer never fsyncs the directory: new segment names are not durable."""

    def fsync_dir(self, path: str) -> None:
        pass


class AckBeforeFsyncWriter(JournalWriter):
    """(c) Acknowledges at once and fsyncs only every 8th group commit, later (Redis ``everysec``).

    Its group-commit leader claims 7 of every 8 generations durable without an fdatasync.
    """

    def _lead(self, seg) -> None:
        self.commits = getattr(self, "commits", 0) + 1
        if self.commits % 8 == 0:
            super()._lead(seg)
            return
        seg.synced_seq = seg.written_seq
        seg.synced_gen = seg.open_gen
        seg.open_gen += 1
        self._wake(seg)


def ack_before_fsync_writer(path: str, ops: FileOps, max_segment_bytes: int) -> JournalWriter:
    return AckBeforeFsyncWriter(path, max_segment_bytes=max_segment_bytes, fileops=ops)


def in_place_write_state(directory: str, name: str, payload: bytes, *, fileops: FileOps) -> None:
    """(d) Rewrites the state file in place (O_TRUNC + write + fsync), no temp file, no rename."""
    fd = fileops.open(os.path.join(directory, name + STATE_SUFFIX), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        write_all(fileops, fd, encode_state(payload))
        fileops.fsync(fd)
    finally:
        fileops.close(fd)


def test_s4_harness_detects_every_broken_writer(tmp_path, figures):
    broken: dict[str, Outcome] = {
        "no_fsync": run_journal_rounds(tmp_path / "a", 2, ops_class=NoFsyncOps),
        "no_dir_fsync": run_journal_rounds(tmp_path / "b", 2, ops_class=NoDirFsyncOps),
        "ack_before_fsync": run_journal_rounds(tmp_path / "c", 2, make_writer=ack_before_fsync_writer),
        "in_place_state": run_state_rounds(tmp_path / "d", 2, write=in_place_write_state),
    }
    detected = {name: out for name, out in broken.items() if out.lost > 0 or out.corrupt > 0}
    figures(
        f"S4 harness-self-test broken_writers={len(broken)} detected={len(detected)} "
        + " ".join(f"{name}:lost={out.lost},corrupt={out.corrupt}" for name, out in broken.items())
    )
    for name, out in broken.items():
        assert out.acked > 0, f"{name}: nothing was acknowledged, so nothing could be lost"
    assert len(detected) == 4, {name: out for name, out in broken.items() if name not in detected}
