"""The power-loss model's directory entries (tests/support/powerloss.py): a ``mkdir`` and each
side of a rename across directories are undone unless their own directory was fsync'd.

Without this the repair's power-loss sweep (tests/crash/test_repair_power_loss.py) cannot see a
missing directory fsync after the backup's ``mkdir`` or after a move into the backup.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from tests.support.powerloss import PowerLossFileOps


def _file(ops: PowerLossFileOps, path: Path, data: bytes) -> None:
    fd = ops.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    ops.write(fd, data)
    ops.fsync(fd)
    ops.close(fd)
    ops.fsync_dir(str(path.parent))


def test_a_directory_whose_parent_was_not_fsynced_is_gone_after_a_crash_and_its_siblings_not(
    tmp_path: Path,
) -> None:
    ops = PowerLossFileOps()
    ops.mkdir(str(tmp_path / "kept"))
    ops.fsync_dir(str(tmp_path))
    ops.mkdir(str(tmp_path / "lost"))
    _file(ops, tmp_path / "lost" / "f", b"x")  # synced in a directory that is not
    fd = ops.open(str(tmp_path / "later"), os.O_WRONLY | os.O_CREAT)  # the parent's next entry
    ops.close(fd)
    ops.crash("drop", random.Random(0))
    # The worst order: the parent's later entry reached the disk, the new directory did not.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "later"]


def test_a_rename_across_directories_is_undone_side_by_side(tmp_path: Path) -> None:
    """Source synced, destination not: in neither; destination synced, source not: in both."""
    for synced, left in (("src", []), ("dst", ["src/f", "dst/f"]), ("both", ["dst/f"]), ("none", ["src/f"])):
        root = tmp_path / synced
        root.mkdir()
        (root / "src").mkdir()
        (root / "dst").mkdir()
        ops = PowerLossFileOps()
        _file(ops, root / "src" / "f", b"data")
        ops.replace(str(root / "src" / "f"), str(root / "dst" / "f"))
        for name in ("src", "dst"):
            if synced in (name, "both"):
                ops.fsync_dir(str(root / name))
        ops.crash("drop", random.Random(0))
        assert sorted(str(p.relative_to(root)) for p in root.glob("*/f")) == sorted(left), synced
        assert all((root / name).read_bytes() == b"data" for name in left), synced
