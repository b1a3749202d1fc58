"""The ledger punch's hold on a full disk, with a real failing write of the ids file.

docs/journal.md, "Entries punched out of pinned ledger segments": an ids file that cannot be
written (ENOSPC, EDQUOT) holds its segment for ``IDS_RETRY_S``, then the segment is read again
and punched.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.journal import JournalWriter
from hybridq.journal.fileops import FileOps
from hybridq.journal.holes import HOLES_SUFFIX
from hybridq.journal.statefile import STATE_SUFFIX
from hybridq.ledger import punched_ids, store
from hybridq.ledger.store import ledger_dir
from hybridq.transport import MemoryTransport

from tests.unit.test_punch_lookup import _run


class _FullFsync(FileOps):
    """Every fsync fails as on a full disk: what replace_durably wraps in JournalIOError."""

    def fsync(self, fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_on_the_ids_file_holds_its_segment_then_punches_it(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from the ids file's real write holds that segment; after the hold it is punched.

    Failed before this fix: write_state raises JournalIOError, no OSError, so it went out of
    step() with the segment marked read: never held, never retried until a restart.
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    real = punched_ids.write_state
    full: list[str] = []  # the one ids file whose first write meets the full disk
    calls: list[str] = []

    def write_state(directory: str, name: str, payload: bytes, **kw: object) -> None:
        calls.append(name)
        if not full:
            full.append(name)
            real(directory, name, payload, fileops=_FullFsync())
        real(directory, name, payload)

    monkeypatch.setattr(punched_ids, "write_state", write_state)
    queue, transport = Queue(journal=str(journal_dir)), MemoryTransport()
    forwarder = _run(journal_dir, transport, 0)
    try:
        with JournalWriter(journal_dir, max_segment_bytes=256 << 10) as writer:
            writer.append_many([queue.prepare("tests.tasks.add", ("a", "b"), delay=3600).to_bytes()])
            for r in range(40):  # ledger segments behind the pin, each with ids to keep
                envs = [queue.prepare("tests.tasks.add", ("x" * 900, f"{r}.{i}")) for i in range(40)]
                writer.append_many(e.to_bytes() for e in envs)
                _run(journal_dir, transport, 2, forwarder)
            assert full, "no ids file was written"
            assert calls.count(full[0]) == 1, calls  # held, not tried again every pass
            assert len(set(calls)) > 1, calls  # the later segments went on
            assert forwarder.completions is not None
            puncher = forwarder.completions.compactor.ledger_puncher
            assert puncher._held, "the segment was not held"
            puncher._held = dict.fromkeys(puncher._held, 0.0)  # the hold is over
            _run(journal_dir, transport, 2, forwarder)
        assert calls.count(full[0]) == 2, calls
        ledger = ledger_dir(str(journal_dir))
        assert (Path(ledger) / (full[0] + STATE_SUFFIX)).exists()
        holes = full[0].removesuffix(punched_ids.IDS_SUFFIX) + HOLES_SUFFIX
        assert (Path(ledger) / (holes + STATE_SUFFIX)).exists(), (
            "the held segment was not punched after its hold"
        )
    finally:
        forwarder.close()
