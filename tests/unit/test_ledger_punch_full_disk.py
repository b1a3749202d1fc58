"""The ledger punch's hold on a full disk, with a real failing write of the ids file or the saved index.

docs/journal.md, "Entries punched out of pinned ledger segments": an ids file or a saved index
that cannot be written (ENOSPC, EDQUOT) holds its segment for ``IDS_RETRY_S``, then the segment
is read again and punched.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder import ledger_punch
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import segment_name
from hybridq.journal.holes import HOLES_SUFFIX
from hybridq.journal.reader import list_chains
from hybridq.journal.statefile import STATE_SUFFIX
from hybridq.ledger import punched_ids, saved_index, store
from hybridq.ledger.store import ledger_dir
from hybridq.transport import MemoryTransport

from tests.unit.test_punch_lookup import _run


class _FullFsync(FileOps):
    """Every fsync fails as on a full disk: what replace_durably wraps in JournalIOError."""

    def fsync(self, fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def _pinned_segments(
    journal_dir: Path,
    writer: JournalWriter,
    queue: Queue,
    transport: MemoryTransport,
    forwarder: Forwarder,
    rounds: int,
) -> None:
    """A job held an hour (it pins the ledger), then ``rounds`` batches of 40 jobs, each run to its end.

    Each batch fills about one small ledger segment behind the pin.
    """
    writer.append_many([queue.prepare("tests.tasks.add", ("a", "b"), delay=3600).to_bytes()])
    for r in range(rounds):
        envs = [queue.prepare("tests.tasks.add", ("x" * 900, f"{r}.{i}")) for i in range(40)]
        writer.append_many(e.to_bytes() for e in envs)
        _run(journal_dir, transport, 2, forwarder)


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
            _pinned_segments(journal_dir, writer, queue, transport, forwarder, 40)  # with ids to keep
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


def test_a_full_disk_on_the_index_save_before_a_punch_holds_its_segment_then_punches_it(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from the saved index's real write (before the map) holds that segment, as the ids file's does.

    Failed on main: the failed save popped the segment's read, so every pass read the segment
    again (about 0.3 s of CPU for 4 MiB) and tried the save again.
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    real = saved_index.write_state_pieces
    full = [True]
    saves: list[bool] = []  # each save's try: whether the disk was full

    def write_state_pieces(directory: str, name: str, pieces: Iterable[bytes], **kw: object) -> int:
        saves.append(full[0])
        if full[0]:
            kw["fileops"] = _FullFsync()
        return real(directory, name, pieces, **kw)  # type: ignore[arg-type]

    tried: list[tuple[str, int]] = []  # the segments whose punch met a failed index save
    punch = ledger_punch.LedgerPuncher._punch

    def recording(self: ledger_punch.LedgerPuncher, path: str, seg: tuple[str, int], *a: object) -> int:
        before = saves.count(True)
        freed = punch(self, path, seg, *a)  # type: ignore[arg-type]
        if saves.count(True) > before:
            tried.append(seg)
        return freed

    monkeypatch.setattr(saved_index, "write_state_pieces", write_state_pieces)
    monkeypatch.setattr(ledger_punch.LedgerPuncher, "_punch", recording)
    queue, transport = Queue(journal=str(journal_dir)), MemoryTransport()
    forwarder = _run(journal_dir, transport, 0)
    try:
        with JournalWriter(journal_dir, max_segment_bytes=256 << 10) as writer:
            _pinned_segments(journal_dir, writer, queue, transport, forwarder, 40)  # with entries to punch
            assert any(saves), "no index save met the full disk"
            assert tried, "no punch met the full disk"
            assert len(tried) == len(set(tried)), tried  # each held, not read again every pass
            assert forwarder.completions is not None
            puncher = forwarder.completions.compactor.ledger_puncher
            assert puncher._held, "no segment was held"
            assert puncher.punched == 0
            held = set(puncher._held)
            full[0] = False
            puncher._held = dict.fromkeys(puncher._held, 0.0)  # the hold is over, the disk has room
            _run(journal_dir, transport, 2 * len(held) + 2, forwarder)
            assert puncher.punched > 0, "the held segments were not punched after their hold"
        ledger = Path(ledger_dir(str(journal_dir)))
        first = min(held)
        assert (ledger / (segment_name(*first) + HOLES_SUFFIX + STATE_SUFFIX)).exists()
    finally:
        forwarder.close()


def test_an_index_save_that_cannot_succeed_this_run_reads_no_segment(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken saver (an append not folded in) or a poisoned key table: the puncher waits for a restart.

    Failed before this fix: each pass read one pinned segment (about 0.3 s of CPU for 4 MiB), met
    the refused save, held it and logged a warning, cycling through every pinned segment.
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    tried: list[tuple[str, int]] = []
    punch = ledger_punch.LedgerPuncher._punch

    def recording(self: ledger_punch.LedgerPuncher, path: str, seg: tuple[str, int], *a: object) -> int:
        tried.append(seg)
        return punch(self, path, seg, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger_punch.LedgerPuncher, "_punch", recording)
    queue, transport = Queue(journal=str(journal_dir)), MemoryTransport()
    forwarder = _run(journal_dir, transport, 0)
    try:
        assert forwarder.completions is not None
        puncher = forwarder.completions.compactor.ledger_puncher
        puncher.state._saver.begin()  # an append begun and never folded in: no save this run
        with JournalWriter(journal_dir, max_segment_bytes=256 << 10) as writer:
            _pinned_segments(journal_dir, writer, queue, transport, forwarder, 12)  # with entries to punch
        segments = list_chains(ledger_dir(str(journal_dir)))
        assert sum(len(indices) for indices in segments.values()) > 2, segments  # some to punch
        assert tried == []
        assert not puncher._held
        assert "held" not in caplog.text
    finally:
        forwarder.close()
