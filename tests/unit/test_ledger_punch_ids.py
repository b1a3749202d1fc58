"""Successes punched out of a pinned ledger, their ids kept (``hybridq.ledger.punched_ids``).

A job whose journal record was punched is named only by its ledger ``done`` entry; the ledger
puncher punches that entry too once its id is in the segment's ids file. Every answer must stay
what it was before (docs/journal.md, "Entries punched out of pinned ledger segments"):
``cancel()``, ``fetch_job`` (also after a rebuild of the lookup index), a ``depends_on`` on it,
its idempotency key.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import StateFileCorrupt
from hybridq.forwarder import flow_steps, ledger_punch
from hybridq.journal import JournalWriter
from hybridq.journal.format import segment_name
from hybridq.ledger import store
from hybridq.ledger.punched_ids import PunchedId, decode, encode, find_punched, named_segments
from hybridq.ledger.segment_scan import scan_ledger_segment
from hybridq.ledger.store import ledger_dir, read_ledger
from hybridq.ops.trace import job_trace
from hybridq.transport import MemoryTransport

from tests.unit.test_punch_lookup import _answers_succeeded, _punched_journal, _run


def _ids_kept(journal: Path) -> dict[str, PunchedId]:
    return {p.job_id: p for _, p in find_punched(ledger_dir(str(journal)))}


def _done_entries(journal: Path) -> set[str]:
    return {e.job_id for _, e in read_ledger(str(journal)) if e.kind == "done"}


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_success_punched_out_of_the_ledger_answers_from_its_kept_id(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, rebuild: bool
) -> None:
    """cancel() says succeeded, fetch_job finished, a dependent runs: before and after a rebuild."""
    monkeypatch.setattr(flow_steps, "UNKNOWN_DEP_S", 0.5)
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)  # sealed ledger segments to punch
    queue, ids, transport = _punched_journal(journal_dir)
    forwarder = _run(journal_dir, transport, 20)  # the ledger puncher reads a segment a pass
    try:
        kept, left = _ids_kept(journal_dir), _done_entries(journal_dir)
        gone = [i for i in ids if i in kept and i not in left]
        assert len(gone) >= 100, (len(gone), len(ids))
        probe = gone[len(gone) // 2]
        assert kept[probe].queue == "default"
        assert kept[probe].result_kept
        if rebuild:
            forwarder.close()
            shutil.rmtree(journal_dir / "lookup")  # a cache, rebuilt from the rest (docs/journal-format.md)
            forwarder = _run(journal_dir, transport, 20)
        _answers_succeeded(probe, queue, transport, forwarder)
    finally:
        forwarder.close()


def test_a_keyed_job_punched_out_of_the_ledger_keeps_its_key(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its ``key`` entry stays while its journal segment does: the same key again is a duplicate."""
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    queue = Queue(journal=str(journal_dir))
    key_of: dict[str, str] = {}
    with JournalWriter(journal_dir, max_segment_bytes=2 << 20) as writer:
        writer.append_many([queue.prepare("tests.tasks.add", ("a", "b"), delay=3600).to_bytes()])
        for start in range(1, 1200, 10):
            envs = [
                queue.prepare("tests.tasks.add", ("x" * 900, str(i)), idempotency_key=f"key-{i}")
                for i in range(start, start + 10)
            ]
            key_of.update((e.id, f"key-{i}") for i, e in enumerate(envs, start))
            writer.append_many(e.to_bytes() for e in envs)
    transport = MemoryTransport()
    forwarder = _run(journal_dir, transport, 50)
    try:
        kept, left = _ids_kept(journal_dir), _done_entries(journal_dir)
        keyed = [e.job_id for _, e in read_ledger(str(journal_dir)) if e.kind == "key" and e.job_id in kept]
        owner = next(i for i in keyed if i not in left)  # its success punched, its key entry kept
        key = key_of[owner]
        runs = sum(transport.executions.values())
        again = queue.enqueue("tests.tasks.add", "k", "k", idempotency_key=key)
        _run(journal_dir, transport, 5, forwarder)
        assert sum(transport.executions.values()) == runs  # not run again
        assert again.id not in transport.executions
    finally:
        forwarder.close()


def test_the_ids_file_round_trips() -> None:
    ids = [
        PunchedId("0" * 31 + "a", ("w1", 3, 64), "default", result_kept=True, at=1_796_657_065),
        PunchedId("caller's id é", ("w1", 3, 1 << 40), None, result_kept=False, at=0),
        PunchedId(
            "ABCDEF" * 5 + "00", ("w2", 0, 128), "q2", result_kept=True, at=7
        ),  # upper case: not packed
    ]
    raw = encode(ids)
    assert decode(raw) == ids
    with pytest.raises(ValueError):
        decode(raw[:-3])
    with pytest.raises(ValueError):
        decode(b"X1")
    assert len(encode(ids[:1] * 1000)) < 1000 * 23  # ~22 bytes a job with a packed id


def test_a_damaged_ids_file_raises_never_reads_as_no_ids(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One flipped byte: readers raise StateFileCorrupt, and the segment's reach never becomes "none".

    Failed on main before this fix: find_punched skipped the file (its jobs answered unknown) and
    named_segments returned [] (the ledger segment could be deleted early, docs/reliability.md rule 12).
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    _queue, _ids, transport = _punched_journal(journal_dir)
    _run(journal_dir, transport, 20).close()
    ledger = ledger_dir(str(journal_dir))
    (seg, _kept), *_ = list(find_punched(ledger))
    path = Path(ledger) / (segment_name(*seg) + ".ids.state")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(StateFileCorrupt, match="restore it with its ledger segment"):
        list(find_punched(ledger))
    with pytest.raises(StateFileCorrupt):
        named_segments(ledger, *seg)
    with pytest.raises(StateFileCorrupt):
        scan_ledger_segment(str(journal_dir), *seg)
    assert path.exists()


def _faulty_read_ids(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> list[tuple[str, int]]:
    """read_ids of the first ledger segment to keep ids raises ``exc``; returns the segments asked."""
    asked: list[tuple[str, int]] = []
    real = ledger_punch.read_ids

    def read_ids(path: str, writer_id: str, index: int) -> list[PunchedId]:
        asked.append((writer_id, index))
        if (writer_id, index) == asked[0]:
            raise exc
        return real(path, writer_id, index)

    monkeypatch.setattr(ledger_punch, "read_ids", read_ids)
    return asked


def test_a_full_disk_holds_one_segment_and_the_later_ones_still_go(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError on the ids file holds that segment (not re-read every pass); the next ones punch.

    Failed before this fix: the segment was re-read and failed again every pass, nothing after it punched.
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    queue, transport = Queue(journal=str(journal_dir)), MemoryTransport()
    asked = _faulty_read_ids(monkeypatch, OSError(28, "No space left on device"))
    forwarder = _run(journal_dir, transport, 0)
    try:
        with JournalWriter(journal_dir, max_segment_bytes=256 << 10) as writer:
            pin = queue.prepare("tests.tasks.add", ("a", "b"), delay=3600)
            writer.append_many([pin.to_bytes()])
            for r in range(40):  # ledger segments behind the pin, each with ids to keep
                envs = [queue.prepare("tests.tasks.add", ("x" * 900, f"{r}.{i}")) for i in range(40)]
                writer.append_many(e.to_bytes() for e in envs)
                _run(journal_dir, transport, 2, forwarder)
        assert asked, "no ids file was written"
        assert asked.count(asked[0]) == 1, asked
        assert len(set(asked)) > 1, asked  # the later segments went on
    finally:
        forwarder.close()


def test_a_damaged_ids_file_stops_the_ledger_punch(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StateFileCorrupt from the ids file goes out of the punch (rule 12), not skipped every pass."""
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    _queue, _ids, transport = _punched_journal(journal_dir)
    asked = _faulty_read_ids(monkeypatch, StateFileCorrupt("x.ids.state", "checksum mismatch"))
    forwarder = _run(journal_dir, transport, 0)
    try:
        with pytest.raises(StateFileCorrupt):
            _run(journal_dir, transport, 20, forwarder)
    finally:
        forwarder.close()
    assert len(asked) == 1, asked


def test_trace_of_a_punched_job_says_succeeded_punched(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hybridq trace` reads the ids files: punched, not compacted; still so once the lookup row is gone.

    Failed before this fix: "succeeded (... compacted)" from the lookup index, then unknown without it.
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 32 << 10)
    _queue, ids, transport = _punched_journal(journal_dir)
    _run(journal_dir, transport, 20).close()
    kept, left = _ids_kept(journal_dir), _done_entries(journal_dir)
    probe = next(i for i in ids if i in kept and i not in left)
    for _ in range(2):
        trace = job_trace(str(journal_dir), probe)
        assert trace is not None
        assert trace.status == "succeeded"
        assert [s.source for s in trace.steps if s.kind == "done"] == ["ledger ids file"], trace.steps
        shutil.rmtree(journal_dir / "lookup", ignore_errors=True)  # as a pruned row (RETENTION_S)
