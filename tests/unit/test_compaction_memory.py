"""Compaction decodes only failures, requeue marks and the one ledger segment it may delete.

Issue 29: after a long drain the ledger holds a million successes, and each compaction read
every entry of it into memory (the forwarder's RSS peaked at 698 MB over a 1,000,000-job
drain). Counted here: the entries decoded by a compaction pass, not its time.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq.forwarder.dead_segments import Compactor
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.journal import JournalReader, Record
from hybridq.journal.format import segment_name
from hybridq.journal.reader import list_chains, seal_offset
from hybridq.journal.records import ChainPosition
from hybridq.ledger import store
from hybridq.ledger.entries import Entry
from hybridq.ledger.segment_scan import scan_ledger_segment
from hybridq.ledger.store import open_ledger_writer, read_ledger_failures, read_ledger_segment

from tests.unit import test_ledger_replay

JOBS = 3_000


def _ledger(journal: Path) -> None:
    writer = open_ledger_writer(str(journal))
    outcomes = ["succeeded"] * (JOBS - 2) + ["failed"]
    entries = [Entry("done", f"j{i}", ("w", 0, 64 + i), outcome=o, at=1.0) for i, o in enumerate(outcomes)]
    entries.append(Entry("requeued", "j1", ("w", 0, 65), at=2.0))
    writer.append_many(e.to_bytes() for e in entries)
    writer.close()


def test_the_failures_pass_decodes_only_failures_and_requeues(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ledger(journal_dir)
    decoded: list[bytes] = []
    real = Entry.from_bytes

    def counting(raw: bytes) -> Entry:
        decoded.append(raw)
        return real(raw)

    monkeypatch.setattr(store.Entry, "from_bytes", staticmethod(counting))
    found = [e for _, e in read_ledger_failures(str(journal_dir))]
    assert sorted(e.kind for e in found) == ["done", "requeued"]
    assert found[0].outcome == "failed" or found[1].outcome == "failed"
    assert len(decoded) == 2  # not the 2,998 successes


def test_a_segment_is_read_alone(journal_dir: Path) -> None:
    _ledger(journal_dir)
    chains = list_chains(store.ledger_dir(str(journal_dir)))
    ((writer, indices),) = chains.items()
    total = sum(len(read_ledger_segment(str(journal_dir), writer, i)) for i in indices)
    assert total == JOBS


def _two_ledger_segments(journal: str, writer: str, n: int) -> tuple[str, list[Entry]]:
    """A sealed ledger chain: segment 0 names journal segment 0 only, segment 1 journal segment 1.

    Segment 0 holds ``n`` successes and one of each entry compaction keeps; returns the chain's
    writer id and those kept entries.
    """
    keep = [
        Entry("done", "f", (writer, 0, 40), outcome="failed", error="boom", job={"id": "f"}, at=1.0),
        Entry("requeued", "r", (writer, 0, 41), at=2.0),
        Entry("key", "k", (writer, 0, 42), key="h" * 16, at=3.0),
    ]
    ledger = open_ledger_writer(journal)
    ok = [Entry("done", f"j{i}", (writer, 0, 64 + i), outcome="succeeded", at=1.0) for i in range(n)]
    ledger.append_many(e.to_bytes() for e in [*ok[: n // 2], *keep, *ok[n // 2 :]])
    ledger.max_segment_bytes = 4096  # the next batch starts segment 1
    ledger.append_many(
        Entry("done", f"k{i}", (writer, 1, 64 + i), outcome="succeeded", at=1.0).to_bytes() for i in range(n)
    )
    ledger.close()  # seals segment 1: another process's chain, which compaction may delete
    return ledger.writer_id, keep


def _state(journal: str, writer: str) -> ForwarderState:
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    state.compacted.through[writer] = 0  # journal segment 0 is compacted, segment 1 is not
    return state


def _counting_decodes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    decoded: list[bytes] = []
    real = Entry.from_bytes

    def counting(raw: bytes) -> Entry:
        decoded.append(raw)
        return real(raw)

    monkeypatch.setattr(Entry, "from_bytes", staticmethod(counting))
    return decoded


def test_a_compaction_pass_decodes_only_the_entries_it_may_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: every entry of the segment deleted, and of the next one, was decoded whole."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    chain, keep = _two_ledger_segments(journal, writer, 2_000)
    state = _state(journal, writer)
    try:
        decoded = _counting_decodes(monkeypatch)
        assert Compactor(state)._compact_ledger() == 1
        assert [i for w, i in _segments(journal) if w == chain] == [1]
        assert len(decoded) <= 2 * len(keep)  # the failures pass, then segment 0's scan; not 4,000
        kept = [e for _, e in read_ledger_failures(journal) if e.kind == "done"]
        assert kept == [keep[0]]  # the failure still listed was appended again before the delete
        assert keep[2].key in state.index.keys  # the key moved to the key store
    finally:
        state.close()


def test_a_ledger_segment_that_cannot_go_yet_is_read_once_while_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: the first segment compaction could not delete was read again at every pass."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    chain, _ = _two_ledger_segments(journal, writer, 200)
    state = _state(journal, writer)
    reads = _counting_reads(monkeypatch)
    try:
        compactor = Compactor(state)
        assert compactor._compact_ledger() == 1
        assert reads.count((chain, 1)) == 1
        for _ in range(3):
            assert compactor._compact_ledger() == 0
        assert reads.count((chain, 1)) == 1  # sealed, so what it said holds
        # Only which journal segments it names is kept meanwhile, never its entries (a segment
        # of failures holds megabytes of envelopes).
        assert all(isinstance(n, int) for _, reach in compactor._scans.values() for n in reach.values())
        # Trusted only while it is the same file (inode and size): the same bytes in another
        # file are read again.
        path = Path(store.ledger_dir(journal)) / segment_name(chain, 1)
        shutil.copy2(path, path.with_suffix(".copy"))
        os.replace(path.with_suffix(".copy"), path)
        assert compactor._compact_ledger() == 0
        assert reads.count((chain, 1)) == 2
        state.compacted.through[writer] = 1  # its journal segment goes: now it goes too
        assert compactor._compact_ledger() == 1
        assert reads.count((chain, 1)) == 3  # read again as it goes, for the entries it keeps
        assert chain not in dict(_segments(journal))
    finally:
        state.close()


def test_a_ledger_segment_naming_a_live_journal_segment_never_goes(tmp_path: Path) -> None:
    """A segment goes only once every journal segment its entries name is gone, whatever their kind.

    One ledger segment names journal segments 0, 1 (a success, decoded only at its front, in the
    middle) and 2 (a retry, at its end), and a chain compacted away: it goes only with segment 2.
    """
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    ok = [Entry("done", f"j{i}", (writer, 0, 64 + i), outcome="succeeded", at=1.0) for i in range(500)]
    live = Entry("done", "live", (writer, 1, 64), outcome="succeeded", at=1.0)
    gone_writer = Entry("lost", "g", ("gone-writer", 7, 64), attempt=2)
    later = Entry("retry", "r", (writer, 2, 64), attempt=1, run_at=9.0)
    ledger = open_ledger_writer(journal)
    ledger.append_many(e.to_bytes() for e in [*ok[:250], live, gone_writer, *ok[250:], later])
    ledger.close()
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        compactor = Compactor(state)
        for through, deleted in ((0, 0), (1, 0), (2, 1)):
            state.compacted.through[writer] = through
            assert compactor._compact_ledger() == deleted, through
        assert ledger.writer_id not in dict(_segments(journal))
    finally:
        state.close()


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every (chain, index) of a segment read from now on."""
    reads: list[tuple[str, int]] = []
    real = JournalReader.segment_records

    def counting(self: JournalReader, writer_id: str, index: int) -> Iterator[Record]:
        reads.append((writer_id, index))
        return real(self, writer_id, index)

    monkeypatch.setattr(JournalReader, "segment_records", counting)
    return reads


def _segments(journal: str) -> list[tuple[str, int]]:
    return [(w, i) for w, indices in list_chains(store.ledger_dir(journal)).items() for i in indices]


def _every_kind(writer: str) -> list[bytes]:
    """Entries of every kind and shape, with look-alikes of a failure among the successes."""
    other = ("0123456789abcdef", 7, 64)
    entries = [
        Entry(
            "done", "s", (writer, 0, 64), outcome="succeeded", at=1.0, queue="q", event_id="1-0", worker="h/1"
        ),
        Entry("done", "s2", (writer, 2, 64), outcome="succeeded", result={"o": "failed"}, result_kept=True),
        Entry("done", "s3", (writer, 1, 64), outcome="succeeded", error='"o":"failed"', started=0.5, gen=2),
        Entry("done", 'j\u00f6b "q" \\ \u2603 "loc":["x",9,1],', other, outcome="succeeded", at=1.0),
        Entry(
            "done", "f", (writer, 0, 80), outcome="failed", attempt=3, error="boom", job={"id": "f", "a": [1]}
        ),
        Entry("done", "f2", (writer, 1, 80), outcome="failed", dup_of="owner", at=2.0),
        Entry("done", "i", (writer, 0, 96), outcome="invalid", error="not a job"),
        Entry("done", "c", (writer, 0, 112), outcome="cancelled"),
        Entry("done", "d", (writer, 0, 128), outcome="succeeded", dup=True, event_id="2-0"),
        Entry("retry", "r", (writer, 3, 64), attempt=1, run_at=9.0, later=2, later_since=1.0, worker="h/2"),
        Entry("lost", "l", (writer, 0, 144), attempt=2),
        Entry("requeued", "f", (writer, 0, 80), at=3.0),
        Entry("key", "k", (writer, 0, 160), key="h" * 16, at=4.0),
        Entry("key", "k2", (writer, 0, 176), key="g" * 16, outcome="succeeded", until=99.0),
        Entry("duplicate", "u", (writer, 0, 192), key="h" * 16, dup_of="k"),
        Entry("cancel", "x", ("ffffffffffffffff", 4, 64), at=5.0),
    ]
    garbled = [b"[1, 2]", b'"text"', b'{"t": "done", "o": "failed"}', b'{"t":"done","id":"z","loc":["w",1]}']
    spaced = [
        b'{"t": "done", "id": "sp", "loc": ["' + writer.encode() + b'", 5, 64], "o": "failed", "at": 1.0}'
    ]
    return [e.to_bytes() for e in entries] + garbled + spaced


def test_a_segment_scan_answers_as_the_full_decode_does(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = str(journal_dir)
    ledger = open_ledger_writer(journal)
    ledger.append_many(_every_kind("aaaaaaaaaaaaaaaa"))
    ledger.close()
    full = read_ledger_segment(journal, ledger.writer_id, 0)
    decoded = _counting_decodes(monkeypatch)
    scan = scan_ledger_segment(journal, ledger.writer_id, 0)
    reach: dict[str, int] = {}
    for e in full:
        reach[e.loc[0]] = max(reach.get(e.loc[0], -1), e.loc[1])
    assert scan.reach == reach
    assert scan.kept == [
        e for e in full if e.kind in ("requeued", "key") or (e.kind, e.outcome) == ("done", "failed")
    ]
    # The failures, requeue mark and keys; the look-alike success (its result says "o":"failed");
    # the garbled and the spaced records, whose front is not the usual one.
    assert scan.decoded == len(decoded) == 5 + 1 + 5


@pytest.mark.parametrize("finished", ["past the seal", "the record"])
def test_only_outcomes_below_the_seal_let_a_journal_segment_go(tmp_path: Path, finished: str) -> None:
    """An outcome at or past the seal (of a record cut off by recovery) does not stand in for the
    segment's one record, not finished yet: the segment stays (it would go, and its job with it,
    if every outcome of the segment counted)."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    [record] = [r for r in JournalReader(journal).records() if r.segment_index == 0]
    seal_at = seal_offset(journal, writer, 0)
    assert seal_at is not None
    assert record.offset < seal_at
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        state.checkpoint.positions[writer] = ChainPosition(1, 32, 2)  # segment 0 read
        offset = seal_at if finished == "past the seal" else record.offset
        state.index.apply(Entry("done", "j", (writer, 0, offset), outcome="succeeded", at=1.0))
        Compactor(state).compact()
        assert ((writer, 0) in _chain_segments(journal)) == (finished == "past the seal")
    finally:
        state.close()


def _chain_segments(journal: str) -> list[tuple[str, int]]:
    return [(w, i) for w, indices in list_chains(journal).items() for i in indices]
