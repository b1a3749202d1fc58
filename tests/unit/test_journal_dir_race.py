"""The journal directory cannot be swapped through a parent another user can write (issue 13.6)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import JournalPathError
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.paths import existing_journal_dir
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport

from tests import tasks

NOBODY = 65534


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory of ours (0755) that another local user can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="hybridq-race-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_other_user(action: Callable[[], None]) -> None:
    """Run ``action`` as another local user (uid 65534) when we can switch to one, else as us."""
    if os.geteuid() != 0:
        action()
        return
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's swap failed"


def planted_journal(tmp_path: Path) -> tuple[Path, str]:
    """A journal holding one job nobody acknowledged to us (made in a safe place)."""
    prep = tmp_path / "prep"
    prep.mkdir(mode=0o700)
    job = Queue(journal=prep / "planted").enqueue(tasks.add, 666, 0)
    _close_writers()
    return prep / "planted", job.id


def test_missing_parents_are_created_0755_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    Queue(journal=tmp_path / "a" / "b" / "journal")
    modes = {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("a", "a/b", "a/b/journal")}
    assert modes == {"a": 0o755, "a/b": 0o755, "a/b/journal": 0o700}  # a, a/b were 0777 before


def test_a_journal_swapped_through_a_writable_parent_is_never_forwarded(public_tmp: Path) -> None:
    tmp_path = public_tmp
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a directory every local user may write (not sticky)
    journal = shared / "journal"
    planted, planted_id = planted_journal(tmp_path)
    planted.rename(shared / "planted")
    if os.geteuid() == 0:
        for p in [shared / "planted", *(shared / "planted").rglob("*")]:
            os.chown(p, NOBODY, NOBODY, follow_symlinks=False)

    def swap() -> None:
        os.rename(journal, shared / "journal.old")
        os.rename(shared / "planted", journal)

    transport = MemoryTransport()
    refused: JournalPathError | None = None
    try:
        legit = Queue(journal=journal).enqueue(tasks.add, 1, 1)
        _close_writers()
        forwarder = Forwarder(journal, transport)
        forwarder.open()
        try:
            forwarder.step()
            assert legit.id in transport.jobs
            as_other_user(swap)
            forwarder.step()
        finally:
            forwarder.close()
    except JournalPathError as exc:
        refused = exc
    assert planted_id not in transport.jobs  # before the fix: the planted job was forwarded
    assert refused is not None
    assert f"its parent {shared} is writable by other users (mode 777)" in str(refused)
    assert "\n" not in str(refused)


def test_a_sticky_parent_like_tmp_is_accepted(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    Queue(journal=sticky / "journal").enqueue(tasks.add, 1, 1)


def test_a_symlink_leading_through_a_writable_directory_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    (open_dir / "real").mkdir(parents=True)
    open_dir.chmod(0o777)
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o755)
    (safe / "link").symlink_to(open_dir / "real")
    with pytest.raises(JournalPathError, match="writable by other users"):
        Queue(journal=safe / "link" / "journal")
    assert not (open_dir / "real" / "journal").exists()  # nothing created under it


def test_a_parent_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(JournalPathError, match=f"owned by uid {NOBODY}"):
        Queue(journal=theirs / "journal")


def test_the_forwarder_stops_when_its_journal_directory_is_replaced(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    planted, planted_id = planted_journal(tmp_path)
    legit = Queue(journal=journal).enqueue(tasks.add, 1, 1)
    _close_writers()
    transport = MemoryTransport()
    with Forwarder(journal, transport) as forwarder:
        forwarder.step()
        assert legit.id in transport.jobs
        journal.rename(tmp_path / "journal.old")  # only root (or we) can do this here
        shutil.move(planted, journal)
        with pytest.raises(JournalPathError, match="was replaced"):
            forwarder.step()
    assert planted_id not in transport.jobs


def test_root_may_still_read_a_journal_in_its_owners_directory(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    journal = home / "journal"
    Queue(journal=journal).enqueue(tasks.add, 1, 1)
    _close_writers()
    for p in [home, *home.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    assert existing_journal_dir(journal) == str(journal)  # its owner controls it anyway


def test_a_writer_never_creates_a_segment_in_a_directory_swapped_in_at_its_path(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    writer = JournalWriter(journal)
    try:
        journal.rename(tmp_path / "journal.old")
        journal.mkdir(mode=0o700)  # someone else's directory at the path now
        with pytest.raises(JournalPathError, match="was replaced"):
            writer.append(b"job")
        assert list(journal.iterdir()) == []  # nothing of ours went there
    finally:
        writer.close()
