"""The ledger punch over the marks of a success over a failure and a failure under a success, then compaction of everything.

Chain B's journal segments are compacted, chain A's pinned (a[0] waits) and punched. Pairs of
outcomes of one job (F then S: S 'over'; S then F: F 'under'), a requeue mark from another
ledger chain, and a late success after compaction (the harvest's mark) in both chains. Checks the
failed list and failed_at through the forwarder's start (saved index after / before the punch /
none) and through a reader's load_index, before and after the ledger punch, and after the
waiting job finishes and every segment is compacted (marks re-appended by compaction).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from hybridq.forwarder.dead_segments import Compactor
from hybridq.forwarder.punch import Puncher
from hybridq.journal.reader import list_chains
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import load_index, open_ledger_writer

from tests.support.started import started_state
from tests.unit.test_ledger_punch import _entries, _loc, _two_chains
from tests.unit.test_punch_index import close_with_index

SPECIAL = {15: "FS", 25: "SF", 35: "FR", 45: "F-late"}


def _base(records, waiting, tag):
    skip = {f"{tag}{records[i].seq}" for i in SPECIAL}
    return [e for e in _entries(records, waiting, tag) if not (e.kind == "done" and e.job_id in skip)]


def _fail(r, tag):
    return Entry("done", f"{tag}{r.seq}", _loc(r), outcome="failed", at=2.0, job={"q": 1})


def _ok(r, tag):
    return Entry("done", f"{tag}{r.seq}", _loc(r), outcome="succeeded", at=3.0)


def _listing(journal_dir: Path, state, locs):
    idx = load_index(str(journal_dir), state.compacted, keys=False)
    return (sorted(idx.failed), {loc: idx.failed.failed_at(loc) for loc in locs})


def _fwd(state, locs):
    return (sorted(state.index.failed), {loc: state.index.failed.failed_at(loc) for loc in locs})


@pytest.mark.parametrize("saved", ["after the punch", "before the punch", "none"])
def test_marks_survive_the_ledger_punch_and_compaction(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, saved: str
) -> None:
    state, a, b, through, _, _ = _two_chains(journal_dir, monkeypatch, _base)
    wa = a[0].writer_id
    # The pairs, each outcome in its own append (a later harvest).
    for recs, tag in ((a, "a"), (b, "b")):
        state.append([_fail(recs[15], tag), _ok(recs[25], tag), _fail(recs[35], tag), _fail(recs[45], tag)])
    for recs, tag in ((a, "a"), (b, "b")):
        state.append([_ok(recs[15], tag), _fail(recs[25], tag)])
    # A requeue of the FR jobs, from another process's ledger chain (hybridq failed requeue).
    with open_ledger_writer(str(journal_dir)) as w:
        w.append_many(
            [
                Entry("requeued", f"{t}{r[35].seq}", _loc(r[35]), at=4.0).to_bytes()
                for r, t in ((a, "a"), (b, "b"))
            ]
        )
    state.close()
    state = started_state(journal_dir, through)  # the requeues read
    compactor = Compactor(state)
    compactor.compact()
    assert sorted(list_chains(str(journal_dir))) == [wa]  # B compacted
    # The late success of b[45] (its segment compacted): the harvest's mark.
    late = dataclasses.replace(_ok(b[45], "b"), over="failed").as_mark()
    state.append([late], apply=False)
    state.index.failed.outrank(late.loc)
    # A's F-late job: its success arrives live (a plain harvest) -> over.
    state.append([_ok(a[45], "a")])
    while Puncher(state, min_bytes=1000).step():
        pass
    state.close()
    locs = [_loc(r[i]) for r in (a, b) for i in SPECIAL] + [_loc(a[5]), _loc(b[5])]
    expected_listed = sorted([_loc(a[5]), _loc(b[5])])
    state = started_state(journal_dir, through)
    before = _fwd(state, locs)
    assert before[0] == expected_listed
    reader_before = _listing(journal_dir, state, locs)
    assert reader_before[0] == expected_listed
    state.close()
    shutil.copy(journal_dir / "ledger-index.state", journal_dir / "before.state")

    state = started_state(journal_dir, through)
    compactor = Compactor(state)
    compactor.ledger_puncher.min_bytes = 500
    freed = sum(compactor.ledger_puncher.step(1) for _ in range(10))
    assert freed > 0
    assert _fwd(state, locs) == before
    assert _listing(journal_dir, state, locs) == reader_before
    close_with_index(state, journal_dir, saved)
    state = started_state(journal_dir, through)
    assert _fwd(state, locs) == before, saved
    assert _listing(journal_dir, state, locs) == reader_before

    # The waiting job finishes; every journal segment of A is read and compacted; the ledger follows.
    state.append([_ok(a[0], "a")])
    state.checkpoint.positions[wa] = type(state.checkpoint.positions[wa])(3, 64, 1)
    for _ in range(4):
        compactor = Compactor(state)
        compactor.compact()
        compactor.ledger_puncher.min_bytes = 500
        for _ in range(10):
            compactor.ledger_puncher.step(1)
    after = _fwd(state, locs)
    assert after[0] == expected_listed
    state.close()
    for mode in ("saved", "none"):
        if mode == "none":
            (journal_dir / "ledger-index.state").unlink(missing_ok=True)
            (journal_dir / "ledger-keys.sqlite").unlink(missing_ok=True)
        state = started_state(journal_dir, through)
        got = _fwd(state, locs)
        rd = _listing(journal_dir, state, locs)
        assert got[0] == expected_listed, mode
        assert rd[0] == expected_listed, mode
        # (a requeue mark goes with the last failure it cancels: main behaviour, not checked)
        assert not rd[1][_loc(b[45])]
        assert not rd[1][_loc(a[15])]
        state.close()
