"""The lookup index's read of the journal at start stops where the forwarder's reader starts.

Past the reader's position at the open, every record the forwarder reads is noted to the index
(a job, a record finished already, an invalid one): the index does not decode it a second time
(docs/benchmarks.md, "The push path, this stop"). These check that each record is still indexed,
with what the ledger says of it, whatever the index, the checkpoint and the ledger hold at start.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.records import ChainPosition
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import open_ledger_writer
from hybridq.lookup import index as index_module
from hybridq.lookup.index import LookupIndex
from hybridq.lookup.reads import find
from hybridq.protocol import EntryKind, Outcome
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder


def add(env: Envelope, _attempt: int) -> Any:
    return tasks.add(*env.args)


def count_index_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many records the index's own read of the journal decoded (one count per call)."""
    calls: list[int] = []
    real = index_module.job_row

    def counting(record: Any) -> Any:
        calls.append(1)
        return real(record)

    monkeypatch.setattr(index_module, "job_row", counting)
    return calls


def forward_and_finish(journal: Path, transport: MemoryTransport) -> None:
    """A forwarder's two steps: what the journal holds pushed, run, and its outcomes recorded."""
    forwarder = make_forwarder(journal, transport)
    forwarder.step()
    transport.work(func=add)
    forwarder.step()
    forwarder.close()


def states(journal: Path, ids: list[str]) -> list[tuple[str | None, str | None]]:
    rows = [find(str(journal), i) for i in ids]
    return [(None, None) if r is None else (r.state, r.outcome) for r in rows]


def test_a_backlog_read_at_start_is_decoded_once(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The burn-down's start (the journal filled before the forwarder): fails before (50 decodes)."""
    queue = Queue(journal=journal_dir)
    ids = [queue.enqueue(tasks.add, i, i).id for i in range(50)]
    decodes = count_index_decodes(monkeypatch)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert transport.work(func=add) == 50
    forwarder.step()
    forwarder.close()
    assert decodes == []  # the delivery's notes indexed every record
    assert states(journal_dir, ids) == [("done", "succeeded")] * 50


def test_a_rebuilt_index_reads_to_the_checkpoint_and_is_fed_past_it(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = Queue(journal=journal_dir)
    first = [queue.enqueue(tasks.add, i, i).id for i in range(5)]
    transport = MemoryTransport()
    forward_and_finish(journal_dir, transport)
    later = [queue.enqueue(tasks.add, i, i).id for i in range(5)]
    with JournalWriter(journal_dir) as writer:  # an invalid job (no func) past the checkpoint
        writer.append(json.dumps({"v": 1, "id": "bad-one", "queue": "default"}).encode())
    shutil.rmtree(journal_dir / "lookup")
    decodes = count_index_decodes(monkeypatch)
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert len(decodes) == 6  # the jobs before the checkpoint, and the invalid record (noted)
    transport.work(func=add)
    forwarder.step()
    forwarder.close()
    assert states(journal_dir, first + later) == [("done", "succeeded")] * 10
    bad = find(str(journal_dir), "bad-one")  # found by id, as a read of the whole journal finds it
    assert bad is not None
    assert (bad.queue, bad.func) == ("default", None)


def test_a_lost_checkpoint_indexes_the_records_the_ledger_finished(journal_dir: Path) -> None:
    """Records finished already are skipped by the delivery, and noted to the index all the same."""
    queue = Queue(journal=journal_dir)
    ids = [queue.enqueue(tasks.add, i, i).id for i in range(5)]
    transport = MemoryTransport()
    forward_and_finish(journal_dir, transport)
    shutil.rmtree(journal_dir / "lookup")
    for path in journal_dir.glob("checkpoint*"):
        path.unlink()  # the reader starts at the journal's start: nothing for the index to read
    forward_and_finish(journal_dir, MemoryTransport())
    assert states(journal_dir, ids) == [("done", "succeeded")] * 5


def test_a_job_cancelled_before_it_was_read_is_indexed_cancelled(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    ids = [queue.enqueue(tasks.add, i, i).id for i in range(3)]
    hybridq.cancel([ids[2]], journal=journal_dir)
    transport = MemoryTransport()
    forward_and_finish(journal_dir, transport)
    assert states(journal_dir, ids) == [("done", "succeeded")] * 2 + [("done", "cancelled")]


def positions_after(journal: Path, n: int) -> dict[str, ChainPosition]:
    """The reader's position after the first ``n`` records."""
    reader = JournalReader(journal)
    for i, _ in enumerate(reader.records(), 1):
        if i == n:
            break
    return reader.position


def test_a_ledger_ahead_of_the_reader_makes_the_index_read_the_journal_whole(journal_dir: Path) -> None:
    """The ledger names a record the reader has not reached (a checkpoint older than the ledger)."""
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(6)]
    recs = list(JournalReader(journal_dir).records())
    last = recs[-1]
    with open_ledger_writer(str(journal_dir)) as ledger:
        ledger.append(
            Entry(
                EntryKind.DONE,
                jobs[-1].id,
                (last.writer_id, last.segment_index, last.offset),
                outcome=Outcome.SUCCEEDED.value,
                at=1.0,
            ).to_bytes()
        )
    at_two = positions_after(journal_dir, 2)
    index = LookupIndex(str(journal_dir))
    checked = threading.Event()
    index.on_checked = checked.set
    index.open(read_from=at_two)
    assert checked.wait(10.0)  # the file's integrity check: not what keeps it building here
    index.catch_up(at_two)  # the ledger speaks of the sixth record: not concluded yet
    assert index.building
    index.catch_up(at_two)  # the journal read whole, then the ledger
    assert not index.building
    index.close()
    assert states(journal_dir, [j.id for j in jobs]) == [(None, None)] * 5 + [("done", "succeeded")]


def test_a_reader_until_a_position_reads_no_further(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(6):
        queue.enqueue(tasks.add, i, i)
    at_two, at_four = positions_after(journal_dir, 2), positions_after(journal_dir, 4)
    reader = JournalReader(journal_dir)
    read = list(reader.records(at_two, until=at_four))
    assert len(read) == 2
    assert reader.position == at_four
    assert list(reader.records(at_four, until=at_two)) == []
    assert reader.position == at_four  # never backwards
    assert list(JournalReader(journal_dir).records(until={})) == []  # no chain named: none read
