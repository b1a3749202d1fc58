"""The forwarder punches runs of finished records of sealed, fully read segments, nothing else."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder.dead_segments import Compactor
from hybridq.forwarder.punch import Puncher
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import JournalReader, JournalWriter, Record
from hybridq.journal.format import segment_name
from hybridq.journal.holes import read_holes
from hybridq.ledger.entries import Entry

from tests.support.started import open_state


def _journal(path: Path, segments: int = 3, per: int = 60) -> list[Record]:
    with JournalWriter(path, max_segment_bytes=per * 230) as writer:
        for i in range(segments * per // 10):
            writer.append_many([b"%06d" % (10 * i + k) + b"x" * 200 for k in range(10)])
    return list(JournalReader(path).records())


def _finish(state: ForwarderState, records: list[Record], outcome: str = "succeeded") -> None:
    for r in records:
        loc = (r.writer_id, r.segment_index, r.offset)
        state.index.apply(Entry("done", f"j{r.seq}", loc, outcome=outcome, at=1.0))


def test_the_runs_around_an_unfinished_job_are_punched(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    seg0 = [r for r in records if r.segment_index == 0]
    state = open_state(journal_dir, records[0].writer_id, read_through=2)
    waiting = len(seg0) // 3
    _finish(state, [r for r in seg0 if r is not seg0[waiting]])
    puncher = Puncher(state, min_bytes=1000)
    assert puncher.step() > 0
    holes = read_holes(str(journal_dir), seg0[0].writer_id, 0)
    assert [(h.start, h.end) for h in holes] == [
        (seg0[0].offset, seg0[waiting - 1].end),
        (seg0[waiting + 1].offset, seg0[-1].end),
    ]
    # The waiting job's record still reads; every other of the segment is skipped.
    got = [r.payload for r in JournalReader(journal_dir).records() if r.segment_index == 0]
    assert got == [seg0[waiting].payload]
    assert puncher.step() == 0  # nothing new finished: not read again


def test_unread_unsealed_failed_or_short_runs_are_not_punched(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    writer = records[0].writer_id
    seg0 = [r for r in records if r.segment_index == 0]
    seg1 = [r for r in records if r.segment_index == 1]
    state = open_state(journal_dir, records[0].writer_id, read_through=1)  # segment 1 not fully read
    _finish(state, seg0[1::2])  # every other job: no run longer than one record
    _finish(state, seg1)
    assert Puncher(state, min_bytes=1000).step() == 0
    assert read_holes(str(journal_dir), writer, 1) == ()
    # A failure still listed keeps its record (trace, the dashboard show it).
    state2 = open_state(journal_dir, records[0].writer_id, read_through=2)
    _finish(state2, seg0[: len(seg0) // 2], outcome="failed")
    assert all((writer, 0, r.offset) in state2.index.failed for r in seg0[: len(seg0) // 2])
    assert Puncher(state2, min_bytes=1).step() == 0
    state2.close()
    state.close()


def test_a_punched_segment_is_still_deleted_once_its_last_job_finishes(journal_dir: Path) -> None:
    records = _journal(journal_dir)
    writer = records[0].writer_id
    seg0 = [r for r in records if r.segment_index == 0]
    state = open_state(journal_dir, records[0].writer_id, read_through=2)
    _finish(state, seg0[1:])
    compactor = Compactor(state)
    compactor.puncher.min_bytes = 1000
    compactor.compact()
    assert read_holes(str(journal_dir), writer, 0)
    _finish(state, seg0[:1])
    compactor.hurry()
    compactor.compact()
    assert not os.path.exists(os.path.join(journal_dir, segment_name(writer, 0)))
    assert read_holes(str(journal_dir), writer, 0) == ()
    state.close()


def test_a_finished_segment_behind_a_pinned_one_is_punched_whole(journal_dir: Path) -> None:
    """Found by bench/delayed_chain.py --pin: only partly finished segments were punched."""
    records = _journal(journal_dir)
    writer = records[0].writer_id
    seg0 = [r for r in records if r.segment_index == 0]
    seg1 = [r for r in records if r.segment_index == 1]
    state = open_state(journal_dir, records[0].writer_id, read_through=2)
    _finish(state, seg0[1:])
    _finish(state, seg1)
    puncher = Puncher(state, min_bytes=1000)
    assert puncher.step() > 0
    assert puncher.step() > 0
    ((hole,),) = (read_holes(str(journal_dir), writer, 1),)
    assert (hole.start, hole.end, hole.count) == (seg1[0].offset, seg1[-1].end, len(seg1))
    assert puncher.step() == 0
    state.close()


def test_an_idle_pass_reads_no_segment_and_a_restart_does_not_read_a_punched_one_again(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each pass looks at every segment: what it needs of a sealed one is read once (review L2)."""
    records = _journal(journal_dir, segments=20, per=20)
    seg0 = [r for r in records if r.segment_index == 0]
    state = open_state(journal_dir, records[0].writer_id, read_through=20)
    _finish(state, [r for r in seg0 if r is not seg0[5]])
    puncher = Puncher(state, min_bytes=1000)
    assert puncher.step() > 0
    assert puncher.step() == 0  # the first idle pass reads each sealed segment's seal once
    opened: list[str] = []
    real_open = os.open

    def counting(path: str, *args: object, **kwargs: object) -> int:
        opened.append(os.path.basename(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", counting)
    assert puncher.step() == 0
    assert opened == []  # no segment, no seal, no map read again
    again = Puncher(state, min_bytes=1000)  # after a restart: the map says what was punched
    reads: list[tuple[str, int]] = []
    real_records = JournalReader.segment_records

    def segment_records(self: JournalReader, writer_id: str, index: int) -> object:
        reads.append((writer_id, index))
        return real_records(self, writer_id, index)

    monkeypatch.setattr(JournalReader, "segment_records", segment_records)
    assert again.step() == 0
    assert reads == []


def test_a_requeued_jobs_record_is_not_punched(journal_dir: Path) -> None:
    """Its success answers from its record only (review 2 of issue 29, M1): the bytes decide, then the envelope."""
    queue = Queue(journal=str(journal_dir))
    plain, named, requeued = (
        queue.prepare("tests.tasks.add", (), {"requeue": 1}),  # an argument named so: punched
        queue.prepare("tests.tasks.add", ("a", "b")),
        dataclasses.replace(queue.prepare("tests.tasks.add", ("c", "d")), requeue=2),
    )
    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        for i in range(40):
            env = requeued if i == 8 else plain if i % 2 else named
            writer.append_many([env.to_bytes()])
    records = list(JournalReader(journal_dir).records())
    seg0 = [r for r in records if r.segment_index == 0]
    assert len(seg0) > 10
    assert b'"requeue":2' in seg0[8].payload
    state = open_state(journal_dir, records[0].writer_id, read_through=1)
    _finish(state, seg0[:-1])  # the last one waits: the segment is not deleted instead
    assert Puncher(state, min_bytes=1).step() > 0
    holes = read_holes(str(journal_dir), seg0[0].writer_id, 0)
    assert [(h.start, h.end) for h in holes] == [
        (seg0[0].offset, seg0[7].end),
        (seg0[9].offset, seg0[-2].end),
    ]
    state.close()
