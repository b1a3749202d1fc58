"""hybridq.ops.trace: one job's steps and the reason for each redelivery, from the files alone."""

from __future__ import annotations

from pathlib import Path

import hybridq
import pytest
from hybridq.journal import ChainPosition
from hybridq.ledger.checkpoint import Checkpoint, Held, save_checkpoint
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import open_ledger_writer
from hybridq.ops.trace import job_trace
from hybridq.protocol import EntryKind


def _ledger(journal: Path, *entries: Entry) -> None:
    with open_ledger_writer(str(journal)) as writer:
        writer.append_many(e.to_bytes() for e in entries)


def _forwarded(
    journal: Path, job: hybridq.Job, *, generation: int = 0, held: bool = False, epochs=()
) -> None:
    rec = job.record
    position = ChainPosition(rec.segment, rec.offset + 1, rec.seq + 1)
    cp = Checkpoint(positions={rec.writer_id: position}, generation=generation, epochs=list(epochs))
    if held:
        cp.held.append(Held(9e9, job.id, rec.writer_id, rec.segment, rec.offset))
    save_checkpoint(str(journal), cp)


def _loc(job: hybridq.Job) -> tuple[str, int, int]:
    return (job.record.writer_id, job.record.segment, job.record.offset)


def test_every_redelivery_has_its_reason(journal_dir: Path) -> None:
    job = hybridq.Queue("q", journal_dir).enqueue("tests.tasks.add", 1, 2)
    loc, jid = _loc(job), job.id
    _forwarded(journal_dir, job, generation=1)
    _ledger(
        journal_dir,
        Entry(EntryKind.RETRY, jid, loc, attempt=1, error="ValueError: no", run_at=11.0, at=10.0, started=9.0,
              worker="h/1", queue="q"),
        Entry(EntryKind.RETRY, jid, loc, attempt=2, run_at=21.0, at=20.0, started=19.0, worker="h/2",
              later=1, later_since=20.0, queue="q"),
        Entry(EntryKind.LOST, jid, loc, attempt=3, at=30.0, queue="q"),
        Entry(EntryKind.DONE, jid, loc, outcome="succeeded", attempt=4, at=40.0, started=39.0, worker="h/3",
              gen=1, later=1, result=3, result_kept=True, queue="q"),
    )  # fmt: skip
    trace = job_trace(str(journal_dir), jid)
    assert trace is not None
    kinds = [s.kind for s in trace.steps]
    assert kinds == [
        "accepted",
        "forwarded",
        "claimed",
        "retry",
        "claimed",
        "later",
        "lost",
        "claimed",
        "done",
    ]
    steps = trace.steps
    assert steps[3].reason == "ValueError: no"
    assert steps[3].title == "attempt 1 failed: retried"
    assert steps[5].title.startswith("said RetryLater")
    assert steps[6].title.startswith("worker vanished")
    assert steps[7].reason is not None
    assert "epoch generation 0 -> 1" in steps[7].reason
    assert steps[7].title == "claimed by h/3"
    assert ("result", "3") in steps[8].details
    assert (trace.status, trace.attempts, trace.generation) == ("succeeded", 3, 1)
    assert dict(steps[0].details)["offset"] == str(loc[2])


def test_a_requeued_job_shows_both_acceptances(journal_dir: Path) -> None:
    job = hybridq.Queue("q", journal_dir).enqueue("tests.tasks.fail")
    loc, jid = _loc(job), job.id
    _ledger(
        journal_dir,
        Entry(EntryKind.DONE, jid, loc, outcome="failed", attempt=1, error="RuntimeError: x", at=10.0,
              worker="h/1", job=job.envelope.to_dict(), queue="q"),
    )  # fmt: skip
    (again,) = hybridq.requeue([jid], journal_dir)
    trace = job_trace(str(journal_dir), jid)
    assert trace is not None
    kinds = [s.kind for s in trace.steps]
    assert kinds == ["accepted", "waiting", "claimed", "done", "requeued", "accepted", "waiting"]
    assert trace.steps[5].title == "accepted again (requeue 1)"
    assert trace.steps[5].at == trace.steps[4].at  # when it was requeued, not its creation time
    assert trace.status == "pending"
    assert [a.loc for a in trace.acceptances] == [loc, _loc(again)]


def test_held_cancelled_and_unknown(journal_dir: Path) -> None:
    job = hybridq.Queue("q", journal_dir).enqueue("tests.tasks.add", 1, 2)
    _forwarded(journal_dir, job, held=True)
    _ledger(journal_dir, Entry(EntryKind.CANCEL, job.id, _loc(job), at=5.0))
    trace = job_trace(str(journal_dir), job.id)
    assert trace is not None
    assert [s.kind for s in trace.steps] == ["accepted", "held", "cancel"]
    assert job_trace(str(journal_dir), "no-such-job") is None


def test_an_epoch_change_while_the_job_was_unfinished_is_a_refill(journal_dir: Path) -> None:
    job = hybridq.Queue("q", journal_dir).enqueue("tests.tasks.add", 1, 2)
    accepted = job.envelope.created_at
    # Redis lost state after the job was accepted and before it ended (and once after it ended).
    _forwarded(journal_dir, job, generation=2, epochs=[(1, accepted + 5), (2, accepted + 50)])
    _ledger(
        journal_dir,
        Entry(EntryKind.DONE, job.id, _loc(job), outcome="succeeded", attempt=1, at=accepted + 10,
              started=accepted + 9, worker="h/1", gen=1, queue="q"),
    )  # fmt: skip
    trace = job_trace(str(journal_dir), job.id)
    assert trace is not None
    assert [s.kind for s in trace.steps] == ["accepted", "forwarded", "refill", "claimed", "done"]
    assert dict(trace.steps[2].details) == {"epoch generation": "1"}
    assert trace.steps[2].source == "checkpoint"


def test_the_checkpoint_remembers_when_the_generation_went_up(tmp_path: Path) -> None:
    from hybridq.forwarder.config import ForwarderConfig
    from hybridq.forwarder.state import ForwarderState
    from hybridq.ledger.checkpoint import EPOCHS_KEPT, load_checkpoint

    journal = tmp_path / "journal"
    hybridq.Queue("q", journal).enqueue("tests.tasks.add", 1, 2)
    now = [100.0]
    state = ForwarderState(str(journal), ForwarderConfig(clock=lambda: now[0]))
    state.load()
    state.set_epoch("0:r:a", "r", 0)  # the first epoch: no change of generation
    state.set_epoch("1:r:b", "r", 1)
    now[0] = 200.0
    state.set_epoch("1:r:c", "r", 1)  # the same generation (an upgrade of the token)
    state.set_epoch("2:r:d", "r", 2)
    state.save(0)
    loaded = load_checkpoint(str(journal))
    assert loaded is not None
    assert loaded.epochs == [(1, 100.0), (2, 200.0)]
    for generation in range(3, 3 + EPOCHS_KEPT):
        state.set_epoch(f"{generation}:r:x", "r", generation)
    assert len(state.checkpoint.epochs) == EPOCHS_KEPT
    state.close()


def test_a_compacted_job_reads_its_outcome_from_the_lookup_index(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridq.lookup.reads import Row
    from hybridq.ops import trace as trace_module

    hybridq.Queue("q", journal_dir).enqueue("tests.tasks.add", 1, 2)  # the journal exists
    gone = ("0123456789abcdef", 7, 64)  # a segment compaction deleted, with its ledger entries
    row = Row("j1", *gone, 3, 0, 1.0, "tests.tasks.add", "q", "k", "done", "succeeded", 2, 5.0, 6.0,
              "3", 1, None, None, None)  # fmt: skip
    monkeypatch.setattr(trace_module, "find", lambda path, job_id: row if job_id == "j1" else None)
    monkeypatch.setattr(trace_module, "fetch_job", lambda job_id, path: None)
    trace = job_trace(str(journal_dir), "j1")
    assert trace is None  # no record and no entry: fetch_job is what finds it (below)

    class Found:  # what fetch_job finds of a compacted job: its row's task and result
        record = type("R", (), {"writer_id": gone[0], "segment": gone[1], "offset": gone[2]})()
        envelope = type("E", (), {"func": "tests.tasks.add", "queue": "q"})()
        result = 3

    monkeypatch.setattr(trace_module, "fetch_job", lambda job_id, path: Found())
    trace = job_trace(str(journal_dir), "j1")
    assert trace is not None
    assert [(s.kind, s.source) for s in trace.steps] == [("accepted", "journal"), ("done", "lookup index")]
    assert trace.steps[0].title == "accepted (its journal segment was compacted)"
    assert (trace.status, trace.attempts) == ("succeeded", 2)
    assert (trace.func, trace.queue, trace.args_known, trace.result) == ("tests.tasks.add", "q", False, 3)


def test_a_rolling_upgrade_is_not_a_redis_loss(journal_dir: Path) -> None:
    """Run 1 by an older worker (no ``w``, no ``g``), run 2 by a new one at generation 3."""
    job = hybridq.Queue("q", journal_dir).enqueue("tests.tasks.add", 1, 2)
    loc, jid = _loc(job), job.id
    _forwarded(journal_dir, job, generation=3)
    now = job.envelope.created_at
    _ledger(
        journal_dir,
        Entry(EntryKind.RETRY, jid, loc, attempt=1, error="E: x", run_at=now + 2, at=now + 1, queue="q"),
        Entry(EntryKind.DONE, jid, loc, outcome="succeeded", attempt=2, at=now + 4, started=now + 3,
              worker="h/2", gen=3, queue="q"),
    )  # fmt: skip
    trace = job_trace(str(journal_dir), jid)
    assert trace is not None
    assert [s.reason for s in trace.steps if s.kind == "claimed"] == [None]
    assert not any("lost or rolled back" in (s.reason or "") for s in trace.steps)
    assert (trace.status, trace.attempts) == ("succeeded", 2)


def test_retry_laters_then_a_vanished_worker_use_one_attempt(journal_dir: Path) -> None:
    job = hybridq.Queue("q", journal_dir).enqueue("tests.tasks.add", 1, 2)
    loc, jid = _loc(job), job.id
    _forwarded(journal_dir, job)
    now = job.envelope.created_at
    laters = [
        Entry(EntryKind.RETRY, jid, loc, attempt=k, run_at=now + k + 1, at=now + k, started=now + k - 0.5,
              worker="h/1", later=k, later_since=now + 1, queue="q")
        for k in range(1, 5)
    ]  # fmt: skip
    _ledger(journal_dir, *laters, Entry(EntryKind.LOST, jid, loc, attempt=5, at=now + 10, queue="q"))
    trace = job_trace(str(journal_dir), jid)
    assert trace is not None
    lost = next(s for s in trace.steps if s.kind == "lost")
    assert dict(lost.details)["attempt"] == "1"
    assert dict(lost.details)["run"] == "5"
    assert trace.attempts == 1
