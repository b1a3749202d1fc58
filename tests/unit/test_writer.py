"""The writer: ack after fsync, group commit, batches, rotation, permissions, fork safety."""

from __future__ import annotations

import gc
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from hybridq.errors import JournalClosed, JournalPathError
from hybridq.journal import Durability, FileOps, JournalReader, JournalWriter
from hybridq.journal.format import RecordType


class SpyOps(FileOps):
    """Records the order of writes and syncs; optionally makes fdatasync slow."""

    def __init__(self, sync_delay: float = 0.0) -> None:
        self.calls: list[str] = []
        self.sync_delay = sync_delay
        self.lock = threading.Lock()

    def _note(self, name: str) -> None:
        with self.lock:
            self.calls.append(name)

    def write(self, fd, data):
        self._note("write")
        return super().write(fd, data)

    def fdatasync(self, fd):
        if self.sync_delay:
            time.sleep(self.sync_delay)
        super().fdatasync(fd)
        self._note("fdatasync")

    def fsync_dir(self, path):
        self._note("fsync_dir")
        super().fsync_dir(path)


def test_append_returns_only_after_an_fdatasync_covering_the_record(journal_dir: Path) -> None:
    ops = SpyOps()
    with JournalWriter(journal_dir, fileops=ops) as writer:
        writer.append(b"one")
        # header write, header fsync is fsync (not spied), rename, dir fsync, record write, fdatasync
        assert ops.calls[-2:] == ["write", "fdatasync"]
        assert "fsync_dir" in ops.calls  # the new segment's name was made durable first
        before = len(ops.calls)
        writer.append(b"two")
        assert ops.calls[before:] == ["write", "fdatasync"]


def test_group_commit_covers_many_waiting_appenders_with_one_fsync(journal_dir: Path) -> None:
    ops = SpyOps(sync_delay=0.005)
    threads, per_thread = 16, 20
    with JournalWriter(journal_dir, fileops=ops) as writer:

        def work() -> None:
            for i in range(per_thread):
                writer.append(b"%d" % i)

        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        appends = threads * per_thread
        assert writer.fsync_count == ops.calls.count("fdatasync")
        # While one fsync runs (5 ms), the other 15 threads queue up behind it.
        assert writer.fsync_count <= appends // 4, writer.fsync_count
    assert len(list(JournalReader(journal_dir).records())) == appends


def test_append_many_uses_one_fsync_for_the_batch(journal_dir: Path) -> None:
    ops = SpyOps()
    with JournalWriter(journal_dir, fileops=ops) as writer:
        writer.append(b"warm-up")
        before = ops.calls.count("fdatasync")
        ids = writer.append_many([b"r%d" % i for i in range(1000)])
        assert ops.calls.count("fdatasync") == before + 1
        assert [i.seq for i in ids] == list(range(2, 1002))
    assert len(list(JournalReader(journal_dir).records())) == 1001


def test_no_fsync_mode_must_be_asked_for_and_never_syncs_appends(journal_dir: Path) -> None:
    ops = SpyOps()
    with JournalWriter(journal_dir, fileops=ops, durability=Durability.NO_FSYNC) as writer:
        writer.append_many([b"a", b"b"])
        writer.append(b"c")
        assert ops.calls.count("fdatasync") == 0
    assert JournalWriter.__init__.__kwdefaults__["durability"] is Durability.FSYNC
    assert [r.payload for r in JournalReader(journal_dir).records()] == [b"a", b"b", b"c"]


def test_rotation_seals_segments_in_order_and_keeps_sequence_contiguous(journal_dir: Path) -> None:
    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        for i in range(300):
            writer.append(b"record-%04d" % i + b"." * 40)
        segments = sorted(journal_dir.glob("*.wal"))
        assert len(segments) > 3
        for sealed in segments[:-1]:
            assert stat.S_IMODE(sealed.stat().st_mode) == 0o400
        assert stat.S_IMODE(segments[-1].stat().st_mode) == 0o600  # still being written
    assert stat.S_IMODE(segments[-1].stat().st_mode) == 0o400  # sealed by close()
    records = list(JournalReader(journal_dir).records())
    assert [r.payload[:11] for r in records] == [b"record-%04d" % i for i in range(300)]
    seqs = [r.seq for r in records]
    assert seqs == sorted(seqs)
    assert len({r.segment_index for r in records}) == len(segments)


def test_directory_is_created_0700_and_files_0600(tmp_path: Path) -> None:
    journal = tmp_path / "deep" / "journal"
    with JournalWriter(journal) as writer:
        writer.append(b"x")
        assert stat.S_IMODE(journal.stat().st_mode) == 0o700
        (segment,) = journal.glob("*.wal")
        assert stat.S_IMODE(segment.stat().st_mode) == 0o600


def test_a_symlinked_journal_path_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(JournalPathError, match="symlink"):
        JournalWriter(link)
    assert list(real.iterdir()) == []


def test_a_journal_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a journal")
    with pytest.raises(JournalPathError, match="not a directory"):
        JournalWriter(path)


def test_nothing_is_created_before_the_first_append(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir)
    writer.close()
    assert list(journal_dir.iterdir()) == []


def test_append_after_close_raises_and_close_is_idempotent(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir)
    writer.append(b"x")
    writer.close()
    writer.close()
    with pytest.raises(JournalClosed):
        writer.append(b"y")


def test_record_types_outside_the_data_range_are_refused(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        for bad in (0, RecordType.SEAL, 128):
            with pytest.raises(ValueError, match="record type"):
                writer.append(b"x", bad)
        writer.append(b"x", 7)
    assert [r.rtype for r in JournalReader(journal_dir).records()] == [7]


def test_an_unclosed_writer_warns_when_collected(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir)
    writer.append(b"x")
    fd = writer._segment.fd  # type: ignore[union-attr]
    with pytest.warns(ResourceWarning, match="not closed"):
        del writer
        gc.collect()
    os.close(fd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_writes_through_its_parents_segment(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        parent_id = writer.append(b"parent-1").writer_id
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                child = writer.append(b"child-1")
                code = 0 if child.writer_id != parent_id else 3
                writer.close()
            except BaseException:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        writer.append(b"parent-2")
    records = list(JournalReader(journal_dir).records())
    by_writer: dict[str, list[bytes]] = {}
    for r in records:
        by_writer.setdefault(r.writer_id, []).append(r.payload)
    assert by_writer[parent_id] == [b"parent-1", b"parent-2"]
    assert sorted(by_writer.values()) == [[b"child-1"], [b"parent-1", b"parent-2"]]


def test_many_writers_share_one_directory(journal_dir: Path) -> None:
    writers = [JournalWriter(journal_dir, max_segment_bytes=4096) for _ in range(4)]
    for i in range(200):
        writers[i % 4].append(b"%d" % i)
    for w in writers:
        w.close()
    got = sorted(int(r.payload) for r in JournalReader(journal_dir).records())
    assert got == list(range(200))


def test_a_world_writable_journal_directory_is_refused(tmp_path: Path) -> None:
    from hybridq.errors import JournalPathError
    from hybridq.journal.paths import ensure_journal_dir, existing_journal_dir

    path = tmp_path / "journal"
    path.mkdir()
    path.chmod(0o777)
    with pytest.raises(JournalPathError, match="writable by every user"):
        ensure_journal_dir(path)
    with pytest.raises(JournalPathError, match="writable by every user"):
        existing_journal_dir(path)
    assert list(path.iterdir()) == []  # nothing written


def test_a_journal_directory_owned_by_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq.errors import JournalPathError
    from hybridq.journal.paths import existing_journal_dir

    path = tmp_path / "journal"
    path.mkdir(mode=0o700)
    owner = path.stat().st_uid
    monkeypatch.setattr("os.geteuid", lambda: owner + 1000)  # as another, unprivileged user
    with pytest.raises(JournalPathError, match=f"owned by uid {owner}"):
        existing_journal_dir(path)
    monkeypatch.setattr("os.geteuid", lambda: 0)  # root may look at any user's journal
    assert existing_journal_dir(path) == str(path)
