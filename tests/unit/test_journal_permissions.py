"""The journal's files are private whatever the umask, and a planted symlink is never followed."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalReader
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport

from tests import tasks


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)  # the most permissive: every mode must come from hybridq itself
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)) or ".": stat.S_IMODE(p.stat().st_mode)
        for p in [root, *root.rglob("*")]
        if not p.is_symlink()
    }


def test_every_journal_file_is_private_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    journal = tmp_path / "journal"
    queue = Queue(journal=journal)
    for i in range(3):
        queue.enqueue(tasks.add, i, 1)
    transport = MemoryTransport()
    forwarder = Forwarder(journal, transport)
    forwarder.open()
    try:
        forwarder.step()
        transport.work()
        forwarder.step()  # harvest: the ledger and the checkpoint are written
        live = _modes(journal)  # segments still open for appends: 0600
    finally:
        forwarder.close()
        _close_writers()
    closed = _modes(journal)  # segments sealed: 0400
    assert any(name.startswith("ledger/") for name in live), live
    assert "forwarder.state" in live, live
    for modes in (live, closed):
        for name, mode in modes.items():
            if (journal / name).is_dir():
                assert mode == 0o700, (name, oct(mode))
            else:
                assert mode & 0o077 == 0, (name, oct(mode))


def test_a_segment_planted_as_a_symlink_is_not_followed(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    Queue(journal=journal).enqueue(tasks.add, 1, 1)
    _close_writers()
    (segment,) = journal.glob("*.wal")
    elsewhere = tmp_path / "elsewhere.wal"
    segment.rename(elsewhere)
    segment.symlink_to(elsewhere)  # whoever can write the directory points it at any file
    with pytest.raises(OSError) as refused:
        list(JournalReader(str(journal)).records())
    assert refused.value.errno == errno.ELOOP  # O_NOFOLLOW: refused, not read
