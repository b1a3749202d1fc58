"""Entries punched out of pinned ledger segments: every start builds the index it built before.

One waiting job pins its journal segment (chain A) and, through its entries, every later ledger
segment. Chain B's segments are compacted (its entries: ``gone``), chain A's finished records
punched (its entries: in punched ranges). The ledger puncher (``hybridq.forwarder.ledger_punch``)
then frees the entries no replay needs; the oracle is the index a start builds from the whole
ledger before the punch, against the index it builds after, with a saved index from after the
punch, from before it, or none.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from hybridq.forwarder.dead_segments import Compactor
from hybridq.forwarder.punch import Puncher
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import JournalReader, JournalWriter, Record
from hybridq.journal.holes import read_holes
from hybridq.journal.reader import list_chains
from hybridq.ledger import store
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.index import _inside as index_inside
from hybridq.ledger.punch_select import punchable
from hybridq.ledger.store import ledger_dir, read_keys, read_ledger

from tests.support.started import started_state
from tests.unit.test_punch_index import close_with_index

PER = 60


def _chain(path: Path, segments: int, tag: bytes) -> list[Record]:
    with JournalWriter(path, max_segment_bytes=PER * 230) as writer:
        for i in range(segments * PER // 10):
            writer.append_many([tag + b"%06d" % (10 * i + k) + b"x" * 200 for k in range(10)])
        wid = writer.writer_id
    return [r for r in JournalReader(path).records() if r.writer_id == wid]


def _loc(r: Record) -> tuple[str, int, int]:
    return (r.writer_id, r.segment_index, r.offset)


def _entries(records: list[Record], waiting: int | None, tag: str) -> list[Entry]:
    """Each job's history: some retried, lost or cancelled first, some keyed; a few cancelled, one failed."""
    out: list[Entry] = []
    for i, r in enumerate(records):
        job = f"{tag}{r.seq}"
        if i % 5 == 0:
            out.append(Entry("key", job, _loc(r), key=f"k-{job}", at=1.0))
        if i == waiting:
            out.append(Entry("retry", job, _loc(r), attempt=1, run_at=9e9, at=1.0))
            continue
        if i % 4 == 1:
            out.append(Entry("retry", job, _loc(r), attempt=1, run_at=2.0, at=1.0))
        if i % 9 == 2:
            out.append(Entry("lost", job, _loc(r), attempt=1, at=1.0))
        if i % 11 == 4:  # a cancel asked while it ran: kept, its success punched
            out.append(Entry("cancel", job, _loc(r), at=1.0))
        outcome = "failed" if i == 5 else "cancelled" if i % 7 == 3 else "succeeded"
        out.append(Entry("done", job, _loc(r), outcome=outcome, at=1.0, dup=i % 50 == 7))
    return out


class _TwoChains(NamedTuple):
    state: ForwarderState
    a: list[Record]
    b: list[Record]
    through: dict[str, int]
    of_a: list[Entry]
    of_b: list[Entry]


def _two_chains(
    journal: Path,
    monkeypatch: pytest.MonkeyPatch,
    entries: Callable[[list[Record], int | None, str], list[Entry]] = _entries,
) -> _TwoChains:
    """Chains A (its reader at segment 2, a[0] waiting) and B (read through) and their entries, interleaved.

    The setup the ledger punch's other test modules share: small ledger segments, so the punch has
    sealed ones to map.
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 8 << 10)
    a = _chain(journal, 3, b"a")
    b = _chain(journal, 3, b"b")
    wa, wb = a[0].writer_id, b[0].writer_id
    through = {wa: 2, wb: 3}
    state = started_state(journal, through)
    of_a, of_b = entries(a, 0, "a"), entries(b, None, "b")
    for i in range(0, max(len(of_a), len(of_b)), 10):  # a writer rotates between appends
        state.append(of_b[i : i + 10])  # interleaved: A's entries pin every ledger segment
        state.append(of_a[i : i + 10])
    return _TwoChains(state, a, b, through, of_a, of_b)


def _two_chains_journal_punched(journal: Path, monkeypatch: pytest.MonkeyPatch) -> _TwoChains:
    """``_two_chains``, B's journal segments compacted and A's punched, then a fresh start (returned)."""
    c = _two_chains(journal, monkeypatch)
    Compactor(c.state).compact()
    while Puncher(c.state, min_bytes=1000).step():
        pass
    c.state.close()
    return c._replace(state=started_state(journal, c.through))


def _view(index: LedgerIndex, records: list[Record], keys: list[str]) -> object:
    owners = {k: (e.loc, e.job_id) if (e := index.keys.get(k)) is not None else None for k in keys}
    return (
        [index.outcome(_loc(r)) for r in records],
        index.terminal_count,
        dict(index.totals),
        sorted(index.failed),
        dict(index.retries),
        dict(index.lost),
        dict(index.later),
        sorted(index.cancels),
        owners,
    )


@pytest.mark.parametrize("done_in_ranges", [False, True])
@pytest.mark.parametrize("saved", ["after the punch", "before the punch", "none"])
def test_a_start_after_the_ledger_punch_builds_the_same_index(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, saved: str, done_in_ranges: bool
) -> None:
    state, a, b, through, _, _ = _two_chains(journal_dir, monkeypatch)
    wa = a[0].writer_id
    waiting = 0
    compactor = Compactor(state)
    compactor.compact()
    assert sorted(list_chains(str(journal_dir))) == [wa]  # B compacted: its entries "gone"
    while Puncher(state, min_bytes=1000).step():
        pass
    assert read_holes(str(journal_dir), wa, 0)
    state.close()
    records = a + b
    keys = [e.key for e in _entries(a, waiting, "a") + _entries(b, None, "b") if e.key is not None]
    state = started_state(journal_dir, through)
    before = _view(state.index, records, keys)
    ((_, ledger_segments),) = list_chains(ledger_dir(str(journal_dir))).items()
    assert len(ledger_segments) > 2
    state.close()
    index_file = journal_dir / "ledger-index.state"
    shutil.copy(index_file, journal_dir / "before.state")

    state = started_state(journal_dir, through)
    compactor = Compactor(state)
    compactor.ledger_puncher.min_bytes = 500
    compactor.ledger_puncher.done_in_ranges = done_in_ranges
    freed = sum(compactor.ledger_puncher.step(1) for _ in range(10))  # a segment a pass
    assert freed > 0
    assert compactor.ledger_puncher.punched == freed
    left = sum(1 for _ in read_ledger(str(journal_dir)))
    ledger = _entries(a, waiting, "a") + _entries(b, None, "b")
    # Chain B's entries go either way (its segments compacted), chain A's successes only if
    # asked; A's keys stay (remembered while A's journal segments are on disk).
    assert left <= len(ledger) * (0.4 if done_in_ranges else 0.6), (left, len(ledger))
    assert _view(state.index, records, keys) == before  # the live index does not change
    assert sum(1 for _ in read_keys(str(journal_dir)))  # the keys punched moved to the key store first
    close_with_index(state, journal_dir, saved)
    state = started_state(journal_dir, through)
    assert _view(state.index, records, keys) == before
    state.close()


def test_what_is_kept() -> None:
    loc = ("w", 3, 64)
    gone = lambda seg: seg[1] < 3  # noqa: E731
    punched = lambda loc: loc[2] == 64  # noqa: E731
    assert not punchable(Entry("done", "j", loc, outcome="succeeded"), gone, punched)
    assert punchable(Entry("done", "j", loc, outcome="succeeded"), gone, punched, done_in_ranges=True)
    punched_too = {"done_in_ranges": True}
    assert not punchable(Entry("done", "j", loc, outcome="failed"), gone, punched, **punched_too)
    assert not punchable(Entry("done", "j", loc, outcome="cancelled"), gone, punched, **punched_too)
    assert not punchable(Entry("done", "j", loc, outcome="succeeded", dup=True), gone, punched, **punched_too)
    assert not punchable(
        Entry("done", "j", loc, outcome="succeeded", dup_of="o"), gone, punched, **punched_too
    )
    assert punchable(Entry("retry", "j", loc), gone, punched)
    assert punchable(Entry("lost", "j", loc), gone, punched)
    assert not punchable(Entry("key", "j", loc, key="k"), gone, punched)  # remembered while on disk
    assert not punchable(Entry("cancel", "j", loc), gone, punched)
    assert not punchable(Entry("duplicate", "j", loc, key="k"), gone, punched)
    assert not punchable(Entry("requeued", "j", loc), gone, punched)
    assert not punchable(Entry("outranked", "j", loc), gone, punched)  # a kind not known here
    old = ("w", 2, 64)
    for kind in ("retry", "lost", "cancel", "duplicate", "key"):
        assert punchable(Entry(kind, "j", old), gone, punched)
    for outcome in ("succeeded", "cancelled", "invalid"):
        assert punchable(Entry("done", "j", old, outcome=outcome, dup=True), gone, punched)
    assert not punchable(Entry("done", "j", old, outcome="failed"), gone, punched)
    assert not punchable(Entry("requeued", "j", old), gone, punched)

    # A success over a failure (``over``): a mark that keeps the failure off the list, kept.
    assert not punchable(Entry("done", "j", old, outcome="succeeded", over="failed"), gone, punched)
    # A failure after the job's success (``under``): kept as every failure is (never listed).
    assert not punchable(Entry("done", "j", old, outcome="failed", under="succeeded"), gone, punched)
    live = ("w", 3, 128)  # live, not punched
    for kind in ("retry", "lost", "key", "cancel", "duplicate"):
        assert not punchable(Entry(kind, "j", live), gone, punched)
    assert not punchable(Entry("done", "j", live, outcome="succeeded"), gone, punched)


def test_a_ledger_segment_is_read_again_only_once_a_journal_segment_it_names_has_gone(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another chain compacted every pass does not make the puncher read a pinned segment again.

    Under a steady load a journal segment is compacted about every pass: reading the first
    pinned ledger segment again each time stalled the forward step for nothing (review M1).
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 8 << 10)
    a = _chain(journal_dir, 3, b"a")
    wa = a[0].writer_id
    state = started_state(journal_dir, {wa: 3})
    done = [Entry("done", f"a{r.seq}", _loc(r), outcome="succeeded", at=1.0) for r in a[1:]]
    for i in range(0, len(done), 10):  # a[0] waits: every journal segment of A stays
        state.append(done[i : i + 10])
    assert len(list_chains(ledger_dir(str(journal_dir)))[state.own_chain]) > 2
    puncher = Compactor(state).ledger_puncher
    for _ in range(10):
        puncher.step(1)
    read = puncher.looked
    assert read > 0
    for n in range(3):  # another chain's journal segment compacted before each pass
        state.compacted.through["another-chain"] = n + 1
        assert puncher.step(1) == 0
    assert puncher.looked == read
    state.compacted.through[wa] = 1  # A's segment 0, which the first ledger segments name, goes
    puncher.step(1)
    assert puncher.looked > read
    state.close()


def test_entries_in_punched_journal_ranges_wait_for_a_read_a_compaction_makes(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal punch alone reads no ledger segment again for its ``retry`` entries (review L3).

    The ``retry`` entries of jobs whose journal record was punched after their ledger segment's
    last read stay until a journal segment that segment names is compacted (docs/journal.md).
    Without the ids kept (``keep_ids`` off): with them, the successes of the punched records
    make it read again (``test_ledger_punch_ids.py``).
    """
    monkeypatch.setattr(store, "LEDGER_SEGMENT_BYTES", 8 << 10)
    a = _chain(journal_dir, 3, b"a")
    b = _chain(journal_dir, 3, b"b")
    wa, wb = a[0].writer_id, b[0].writer_id
    state = started_state(journal_dir, {wa: 3, wb: 3})
    entries = [Entry("retry", "a0", _loc(a[0]), attempt=1, run_at=9e9, at=1.0)]  # a[0] waits
    for ra, rb in zip(a[1:], b[1:], strict=False):  # interleaved: B's entries in every segment
        for r in (ra, rb):
            entries.append(Entry("retry", f"{r.writer_id}{r.seq}", _loc(r), attempt=1, run_at=2.0, at=1.0))
            entries.append(Entry("done", f"{r.writer_id}{r.seq}", _loc(r), outcome="succeeded", at=1.0))
    entries.append(Entry("done", f"{wb}0", _loc(b[0]), outcome="succeeded", at=1.0))
    for i in range(0, len(entries), 10):
        state.append(entries[i : i + 10])
    compactor = Compactor(state)
    puncher = compactor.ledger_puncher
    puncher.min_bytes = 1
    puncher.keep_ids = False

    def retries_of_segment_0() -> int:
        return sum(1 for _, e in read_ledger(str(journal_dir)) if e.kind == "retry" and e.loc[:2] == (wa, 0))

    looked = -1
    while puncher.looked != looked:  # every sealed segment read: nothing gone, nothing punched yet
        looked = puncher.looked
        puncher.step(0)
    assert puncher.punched == 0
    read, waiting = puncher.looked, retries_of_segment_0()
    journal = Puncher(state, min_bytes=1000)
    while journal.step():
        pass
    assert journal.punched
    assert read_holes(str(journal_dir), wa, 0)
    for _ in range(3):
        assert puncher.step(journal.punched) == 0
    assert (puncher.looked, retries_of_segment_0()) == (read, waiting)
    compactor.hurry()
    compactor.compact()  # B's segments go: the ledger segments naming them are read again
    assert list(list_chains(str(journal_dir))) == [wa]
    for _ in range(10):
        puncher.step(journal.punched)
    assert retries_of_segment_0() < waiting
    state.close()


def test_inside_is_the_linear_test() -> None:
    spans = [(64, 300, 2), (400, 420, 1), (900, 1000, 3)]
    for offset in range(0, 1100, 7):
        assert index_inside(offset, spans) == any(s <= offset < e for s, e, _ in spans)
    assert not index_inside(5, [])
