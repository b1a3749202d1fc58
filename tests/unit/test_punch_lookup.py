"""The lookup index over punched records: its marks inside a punched run, and a rebuild after a punch.

Punched records are skipped by every journal read (hybridq.journal.holes), so the index must
neither stall on a mark inside a run punched since it was saved (SQLite ``synchronous=OFF``:
a power loss may take it back), nor forget the finished jobs of a run when it is rebuilt.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import hybridq
import pytest
from hybridq import Queue
from hybridq.cancels import cancel
from hybridq.envelope.model import Envelope
from hybridq.forwarder import flow_steps
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.format import segment_name
from hybridq.journal.holes import holes_of
from hybridq.ops.failures import failed_jobs, requeue
from hybridq.producer import writers
from hybridq.transport import MemoryTransport


def _punched_journal(journal: Path) -> tuple[Queue, list[str], MemoryTransport]:
    """A pinning delayed job, then 1199 jobs run to the end: most of segment 0 is punched."""
    queue = Queue(journal=str(journal))
    ids: list[str] = []
    with JournalWriter(journal, max_segment_bytes=2 << 20) as writer:
        writer.append_many([queue.prepare("tests.tasks.add", ("a", "b"), delay=3600).to_bytes()])
        for start in range(1, 1200, 10):
            envs = [queue.prepare("tests.tasks.add", ("x" * 900, str(i))) for i in range(start, start + 10)]
            ids += [e.id for e in envs]
            writer.append_many(e.to_bytes() for e in envs)
    transport = MemoryTransport()
    _run(journal, transport, 30).close()
    assert [n for n in os.listdir(journal) if ".holes" in n]
    return queue, ids, transport


def _run(
    journal: Path,
    transport: MemoryTransport,
    steps: int,
    forwarder: Forwarder | None = None,
    task: Callable[[Envelope, int], None] | None = None,
) -> Forwarder:
    if forwarder is None:
        forwarder = Forwarder(str(journal), transport, reconcile_interval_s=0.0, lease_s=0.0)
        forwarder.open()
    for _ in range(steps):
        forwarder.step()
        transport.work(func=task)
        assert forwarder.completions is not None
        forwarder.completions.hurry()
        forwarder.completions.compactor.hurry()
        forwarder.step()
    return forwarder


def _answers_succeeded(
    job_id: str,
    queue: Queue,
    transport: MemoryTransport,
    forwarder: Forwarder,
    task: Callable[[Envelope, int], None] | None = None,
) -> None:
    """fetch_job says finished, cancel() succeeded, and a ``depends_on`` dependent runs."""
    journal = queue.journal
    job = hybridq.fetch_job(job_id, journal)
    assert job is not None
    assert job.status == "finished"
    assert [r.state for r in cancel([job_id], journal)] == ["succeeded"]
    dep = queue.enqueue("tests.tasks.add", "c", "d", depends_on=job_id)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _run(Path(journal), transport, 1, forwarder, task)
        status = getattr(hybridq.fetch_job(dep.id, journal), "status", None)
        if status in ("finished", "cancelled", "failed"):
            break
        time.sleep(0.2)
    assert status == "finished"


def test_lookup_marks_inside_a_punched_run_finish_the_build(journal_dir: Path) -> None:
    queue, _, transport = _punched_journal(journal_dir)
    ((writer, _),) = [(w, i) for w, i in hybridq.journal.reader.list_chains(str(journal_dir)).items()]
    hole = holes_of(os.path.join(journal_dir, segment_name(writer, 0)))[0]
    size = (hole.end - hole.start) // hole.count  # the records of the run are the same size
    mid = hole.count // 2
    with sqlite3.connect(journal_dir / "lookup" / "index.sqlite") as db:  # as a power loss may leave it
        db.execute(
            "UPDATE marks SET seg = 0, off = ?, seq = ? WHERE chain = ?",
            (hole.start + size * mid, hole.first_seq + mid, "j:" + writer),
        )
    db.close()
    new = queue.enqueue("tests.tasks.add", "c", "d")
    forwarder = _run(journal_dir, transport, 5)
    try:
        assert not forwarder.lookup.building
    finally:
        forwarder.close()
    job = hybridq.fetch_job(new.id, str(journal_dir))
    assert job is not None
    assert job.status == "finished"


def test_a_rebuilt_lookup_index_keeps_the_punched_jobs(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a compacted job: fetch_job, cancel and depends_on answer from the ledger's outcome."""
    monkeypatch.setattr(flow_steps, "UNKNOWN_DEP_S", 0.5)
    queue, ids, transport = _punched_journal(journal_dir)
    probe = ids[100]
    before = hybridq.fetch_job(probe, str(journal_dir))
    assert before is not None
    assert before.status == "finished"
    shutil.rmtree(journal_dir / "lookup")  # a cache, rebuilt from the rest (docs/journal-format.md)
    forwarder = _run(journal_dir, transport, 20)
    try:
        _answers_succeeded(probe, queue, transport, forwarder)
    finally:
        forwarder.close()


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_requeued_job_that_succeeded_answers_succeeded(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, rebuild: bool
) -> None:
    """Its first record stays (its failure keeps a requeue mark); its success must not read as that failure.

    The new record's bare row, after a rebuild, could not take over the first record's row, and
    cancel() found the first record: so a requeued record is never punched (review 2 of issue 29, M1).
    """
    monkeypatch.setattr(flow_steps, "UNKNOWN_DEP_S", 0.5)
    monkeypatch.setattr(writers, "DEFAULT_MAX_SEGMENT_BYTES", 2 << 20)
    queue = Queue(journal=str(journal_dir))
    queue.enqueue("tests.tasks.add", "a", "b", delay=3600, job_id="pin")  # keyed: pins segment 0
    x = queue.enqueue("tests.tasks.add", "x", "y")
    for i in range(20):
        queue.enqueue("tests.tasks.add", "x" * 8000, str(i))
    transport = MemoryTransport()
    forwarder = Forwarder(str(journal_dir), transport, reconcile_interval_s=0.0, lease_s=0.0)
    forwarder.open()

    def task(env: Envelope, attempt: int) -> None:
        if env.id == x.id and env.requeue == 0:
            raise RuntimeError("planned failure")

    deadline = time.monotonic() + 30
    while x.id not in {f.id for f in failed_jobs(str(journal_dir))}:
        assert time.monotonic() < deadline
        _run(journal_dir, transport, 1, forwarder, task)
    (again,) = requeue([x.id], str(journal_dir))
    for i in range(300):  # after the requeued record: segment 0 fills and is sealed
        queue.enqueue("tests.tasks.add", "y" * 8000, str(i))
    _run(journal_dir, transport, 30, forwarder, task)
    assert again.record is not None
    assert x.record is not None
    assert (again.record.writer_id, again.record.segment) == (x.record.writer_id, 0)
    # Its neighbours were punched.
    assert holes_of(os.path.join(journal_dir, segment_name(again.record.writer_id, 0)))
    try:
        if rebuild:
            forwarder.close()
            shutil.rmtree(journal_dir / "lookup")  # a cache, rebuilt from the rest (docs/journal-format.md)
            forwarder = _run(journal_dir, transport, 20, None, task)
        _answers_succeeded(x.id, queue, transport, forwarder, task)
    finally:
        forwarder.close()
