"""A refill's reads of its rows: each segment opened once, what is gone skipped, as read_held does."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hybridq import Queue
from hybridq.forwarder.records import HeldReads, read_held
from hybridq.journal.reader import JournalReader
from hybridq.ledger.checkpoint import Held
from hybridq.producer.queue import shared_writer


def held_at(record: Any) -> Held:
    return Held(0.0, "job", record.writer_id, record.segment_index, record.offset)


def test_held_reads_give_what_read_held_gives_and_skip_a_segment_gone(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = Queue("default", str(journal_dir))
    ids = [q.enqueue("tests.tasks.add", 1, i).id for i in range(5)]
    shared_writer(q.journal, q.durability).close()
    records = list(JournalReader(str(journal_dir)).records())
    state: Any = SimpleNamespace(journal=str(journal_dir))
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    with HeldReads(state) as reads:
        envs = [reads.read(held_at(r)) for r in reversed(records)]
        assert len(opened) == 1  # one segment: opened once for five rows
        gone = Held(0.0, "gone", records[0].writer_id, records[0].segment_index + 7, 0)
        assert reads.read(gone) is None  # moved aside by journal repair: logged, skipped
    monkeypatch.undo()
    assert [e.id for e in envs if e is not None] == ids[::-1]
    assert [read_held(state, held_at(r)) for r in records] == envs[::-1]
