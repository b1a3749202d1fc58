"""A punched segment's finished jobs leave the forwarder's index, and every start answers the same.

The forwarder keeps a segment's punched ranges instead of its succeeded jobs' offsets once the
hole map is durable (``hybridq.ledger.punched``), and again at start from the maps on disk after
the saved index and the ledger replay, whichever saved index the start finds: one written after
the punch (it keeps the ranges), one written before it, or none.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hybridq.forwarder.punch import Puncher
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import JournalReader, JournalWriter, Record
from hybridq.journal.holes import read_holes
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex

from tests.support.started import open_state


def _journal(path: Path, segments: int = 3, per: int = 60) -> list[Record]:
    with JournalWriter(path, max_segment_bytes=per * 230) as writer:
        for i in range(segments * per // 10):
            writer.append_many([b"%06d" % (10 * i + k) + b"x" * 200 for k in range(10)])
    return list(JournalReader(path).records())


def close_with_index(state: ForwarderState, journal_dir: Path, saved: str) -> None:
    """Close ``state`` leaving the saved index ``saved`` says: its own, the one from before, none.

    ``before the punch``: ``before.state`` beside the journal, a copy of the saved index then.
    """
    index_file = journal_dir / "ledger-index.state"
    if saved == "after the punch":
        state.close()
        return
    state.close(by_path=False)  # a crash: no save
    if saved == "before the punch":
        shutil.copy(journal_dir / "before.state", index_file)
    else:
        index_file.unlink()


def _done(r: Record, outcome: str = "succeeded", *, dup: bool = False) -> Entry:
    return Entry(
        "done", f"j{r.seq}", (r.writer_id, r.segment_index, r.offset), outcome=outcome, at=1.0, dup=dup
    )


def _answers(index: LedgerIndex, records: list[Record]) -> list[str | None]:
    return [index.outcome((r.writer_id, r.segment_index, r.offset)) for r in records]


@pytest.mark.parametrize("saved", ["after the punch", "before the punch", "none"])
def test_a_start_collapses_the_index_as_the_punch_did(journal_dir: Path, saved: str) -> None:
    records = _journal(journal_dir)
    writer = records[0].writer_id
    seg0 = [r for r in records if r.segment_index == 0]
    state = open_state(journal_dir, writer)
    waiting = len(seg0) // 3
    outcomes = ["cancelled" if i % 7 == 3 else "succeeded" for i in range(len(seg0))]
    first = [_done(r, o) for i, (r, o) in enumerate(zip(seg0, outcomes, strict=True)) if i < waiting // 2]
    state.append(first)
    state.close()
    index_file = journal_dir / "ledger-index.state"
    shutil.copy(index_file, journal_dir / "before.state")  # a saved index older than the punch
    state = open_state(journal_dir, writer)
    state.append(
        [
            _done(r, o)
            for i, (r, o) in enumerate(zip(seg0, outcomes, strict=True))
            if i >= waiting // 2 and i != waiting
        ]
    )
    done = state.index.terminal[(writer, 0)]
    before = (_answers(state.index, records), state.index.terminal_count, dict(state.index.totals))
    listed = len(list(done))
    assert Puncher(state, min_bytes=1000).step() > 0
    assert read_holes(str(journal_dir), writer, 0)
    # Only the cancelled jobs stay listed; every answer is the same.
    assert len(list(done)) < listed // 4
    assert len(list(done)) == sum(1 for i, o in enumerate(outcomes) if o == "cancelled" and i != waiting)
    assert (_answers(state.index, records), state.index.terminal_count, dict(state.index.totals)) == before
    assert not state.index.is_terminal((writer, 0, seg0[waiting].offset))
    punched = done.punched()
    close_with_index(state, journal_dir, saved)
    state = open_state(journal_dir, writer)
    assert (_answers(state.index, records), state.index.terminal_count, dict(state.index.totals)) == before
    assert state.index.terminal[(writer, 0)].punched() == punched
    assert len(list(state.index.terminal[(writer, 0)])) == len(list(done))
    state.close()


def test_a_duplicate_report_replayed_after_a_saved_collapse_changes_nothing(journal_dir: Path) -> None:
    """Why the saved index keeps the ranges: the replay must know the punched job finished.

    A duplicate delivery's ``failed`` after the save, taken for the job's first outcome, would
    list it as a failure (a requeue would run it again) and count it twice.
    """
    records = _journal(journal_dir)
    writer = records[0].writer_id
    seg0 = [r for r in records if r.segment_index == 0]
    state = open_state(journal_dir, writer)
    state.append([_done(r) for r in seg0[1:]])
    assert Puncher(state, min_bytes=1000).step() > 0
    before = (_answers(state.index, records), state.index.terminal_count, dict(state.index.totals))
    state.close()  # saved: the collapsed index
    state = open_state(journal_dir, writer)
    late = seg0[len(seg0) // 2]
    state.append([_done(late, "failed", dup=True)])
    state.close(by_path=False)  # a crash before the next save: the entry is replayed
    state = open_state(journal_dir, writer)
    answers, count, totals = (
        _answers(state.index, records),
        state.index.terminal_count,
        dict(state.index.totals),
    )
    assert (answers, count) == before[:2]
    assert {k: v for k, v in totals.items() if k != "dups"} == {
        k: v for k, v in before[2].items() if k != "dups"
    }
    assert (writer, 0, late.offset) not in state.index.failed
    state.close()


def test_a_collapse_refused_after_a_punch_is_logged_and_the_offsets_kept(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As at start (``collapse_punched``): the map is durable, the index keeps listing its jobs.

    A refusal escaping the puncher would stop the forwarder, and again after each restart, since
    the start skips that map and the next punch of the segment is refused the same way.
    """
    records = _journal(journal_dir)
    writer = records[0].writer_id
    seg0 = [r for r in records if r.segment_index == 0]
    state = open_state(journal_dir, writer)
    state.append([_done(r) for r in seg0[1:]])
    before = (_answers(state.index, records), state.index.terminal_count, dict(state.index.totals))

    def refuse(seg: tuple[str, int], spans: object) -> None:
        raise ValueError("punched ranges of 3 jobs list 4")

    monkeypatch.setattr(state.index, "collapse", refuse)
    assert Puncher(state, min_bytes=1000).step() > 0
    assert read_holes(str(journal_dir), writer, 0)
    assert (_answers(state.index, records), state.index.terminal_count, dict(state.index.totals)) == before
    assert state.index.terminal[(writer, 0)].punched() == []
    assert "stay listed: punched ranges of 3 jobs list 4" in caplog.text
    state.close()
