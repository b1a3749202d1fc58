"""A refill's reads of its rows: each segment opened once, what is gone skipped, as read_held does."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hybridq import Queue
from hybridq.forwarder.decoded import Decoded
from hybridq.forwarder.records import MAX_OPEN_SEGMENTS, HeldReads, read_held
from hybridq.journal import reader
from hybridq.journal.reader import JournalReader, read_record_at
from hybridq.ledger.checkpoint import Held
from hybridq.producer.queue import shared_writer
from hybridq.producer.writers import _close_writers


def held_at(record: Any) -> Held:
    return Held(0.0, "job", record.writer_id, record.segment_index, record.offset)


def test_held_reads_give_what_read_held_gives_and_skip_a_segment_gone(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = Queue("default", str(journal_dir))
    ids = [q.enqueue("tests.tasks.add", 1, i).id for i in range(5)]
    shared_writer(q.journal, q.durability).close()
    records = list(JournalReader(str(journal_dir)).records())
    state: Any = SimpleNamespace(journal=str(journal_dir), decoded=Decoded())
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    with HeldReads(state) as reads:
        envs = [reads.read(held_at(r)) for r in reversed(records)]
        segments = [p for p in opened if not p.endswith(".holes.state")]
        assert len(segments) == 1  # one segment: opened once for five rows
        assert len(opened) - len(segments) <= 1  # and its hole map looked for once (a sealed one)
        gone = Held(0.0, "gone", records[0].writer_id, records[0].segment_index + 7, 0)
        assert reads.read(gone) is None  # moved aside by journal repair: logged, skipped
    monkeypatch.undo()
    assert [e.id for e in envs if e is not None] == ids[::-1]
    assert [read_held(state, held_at(r)) for r in records] == envs[::-1]


def test_held_reads_keep_a_few_segments_open_not_one_per_segment(journal_dir: Path) -> None:
    """Due delayed jobs of many producers' chains (one segment each) read in one pass: a file per
    segment held to the end ran out of descriptors (EMFILE stopped the forwarder at every start)."""
    q = Queue("default", str(journal_dir))
    for i in range(3 * MAX_OPEN_SEGMENTS):  # each producer process a chain of its own
        q.enqueue("tests.tasks.add", 1, i)
        _close_writers()  # the process exits: the next one starts a chain of its own
    records = list(JournalReader(str(journal_dir)).records())
    assert len({(r.writer_id, r.segment_index) for r in records}) == 3 * MAX_OPEN_SEGMENTS
    state: Any = SimpleNamespace(journal=str(journal_dir), decoded=Decoded())
    before = len(os.listdir("/proc/self/fd"))
    with HeldReads(state) as reads:
        for record in records:
            assert reads.read(held_at(record)) is not None
            assert len(os.listdir("/proc/self/fd")) <= before + MAX_OPEN_SEGMENTS
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_segment_whose_header_cannot_be_read_leaves_no_file_open(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = Queue("default", str(journal_dir))
    q.enqueue("tests.tasks.add", 1, 2)
    shared_writer(q.journal, q.durability).close()
    record = next(iter(JournalReader(str(journal_dir)).records()))
    real = os.pread

    def eio(fd: int, n: int, offset: int) -> bytes:
        if offset == 0:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, offset)

    monkeypatch.setattr(reader.os, "pread", eio)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(OSError):
            read_record_at(str(journal_dir), record.writer_id, record.segment_index, record.offset)
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_fair_refill_opens_each_segment_once_whatever_its_lanes_order(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fair pick cycles through its lanes: read in that order, 17 tenants' rows in 17 segments
    (more than the 16 a HeldReads keeps open) reopened a segment for every row."""
    from hybridq.forwarder import records

    from tests import tasks
    from tests.unit.test_window import WindowedTransport, forwarder

    q = Queue("default", str(journal_dir))
    tenant: dict[str, int] = {}
    for t in range(MAX_OPEN_SEGMENTS + 1):  # each tenant's producer process a chain of its own
        jobs = q.enqueue_many(q.prepare(tasks.add, [t, i], limit_key=f"tenant:{t:02d}") for i in range(3))
        tenant.update((j.id, t) for j in jobs)
        _close_writers()
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=1, window_max=1, fair_keys=("tenant:*",))
    f.step()  # one pushed, the rest wait in the run table
    f.close()
    opened: list[tuple[str, int]] = []
    real = records.SegmentFile

    def counting(journal: str, writer: str, segment: int) -> Any:
        opened.append((writer, segment))
        return real(journal, writer, segment)

    f = forwarder(journal_dir, transport, window_min=100, window_max=100, fair_keys=("tenant:*",))
    monkeypatch.setattr(records, "SegmentFile", counting)  # after the restart's reading: the refill's
    try:
        waiting = f.state.runs.waiting("default")
        f.step()
        assert f.state.runs.waiting("default") == 0
    finally:
        f.close()
    assert waiting == 3 * (MAX_OPEN_SEGMENTS + 1) - 1
    assert len(opened) == len(set(opened)) == MAX_OPEN_SEGMENTS + 1
    first_round = [tenant[i] for i in transport.pushed_ids[1 : MAX_OPEN_SEGMENTS + 2]]
    assert len(set(first_round)) == MAX_OPEN_SEGMENTS + 1  # still pushed in the pick's order
