"""A failure a later success outranked stays off the list after its journal segment is compacted.

A job failed for good (its lost worker given up on after ``max_lost``), then its worker reported
success after all: the success outranks the failure, so ``failed list`` drops it. Once the job's
journal segment was compacted, every reader that replays the ledger skipped the success
("counted there already") but kept the failure, listed again, and ``failed requeue`` ran a job
that had succeeded (found by the punch3 review). The success that outranks a failure carries
``"over":"failed"`` (docs/reliability.md, "A success outranks a failure"): the replay of a
compacted segment applies it as a mark, in any order, and ledger compaction keeps it while
another ledger segment still holds the failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import JobNotFailed
from hybridq.forwarder import dead_segments
from hybridq.forwarder.dead_segments import Compactor
from hybridq.forwarder.harvest import Harvester
from hybridq.forwarder.punch import Puncher
from hybridq.forwarder.state import ForwarderState
from hybridq.http.dashboard.ledger_view import LedgerView
from hybridq.journal import JournalReader, JournalWriter, Record
from hybridq.journal.holes import punch_supported
from hybridq.journal.reader import list_chains
from hybridq.journal.records import Loc
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import ledger_dir, load_index, open_ledger_writer, read_ledger
from hybridq.ops import failures, status
from hybridq.protocol import CompletionEvent

from tests.support.harvested import Events
from tests.support.started import open_state


def envelope(n: int) -> Envelope:
    return Envelope.from_bytes(
        b'{"v": 1, "id": "%032x", "func": "tests.tasks.add", "queue": "q", "key": "%032x", "created_at": 1}'
        % (n, n)
    )


def journal_of_jobs(path: Path, segments: int = 3, per: int = 40) -> list[Record]:
    """A journal of ``segments`` sealed-or-open segments of about ``per`` envelopes each."""
    size = len(envelope(0).to_bytes()) + 40
    with JournalWriter(path, max_segment_bytes=max(4096, per * size)) as writer:
        for n in range(segments * per):
            writer.append_many([envelope(n).to_bytes()])
    return list(JournalReader(path).records())


def loc_of(record: Record) -> Loc:
    return (record.writer_id, record.segment_index, record.offset)


def failure(record: Record, at: float = 1.0) -> Entry:
    env = Envelope.from_bytes(record.payload)
    return Entry("done", env.id, loc_of(record), outcome="failed", at=at, queue="q", job=env.to_dict())


def success(record: Record, at: float = 2.0) -> Entry:
    return Entry("done", Envelope.from_bytes(record.payload).id, loc_of(record), outcome="succeeded", at=at)


def listed_ids(journal: Path) -> list[str]:
    return [f.id for f in failures.failed_jobs(str(journal))]


def job_five(journal: Path) -> tuple[str, list[Record], Record]:
    """A journal of jobs: its writer, segment 0's records, and segment 0's job 5 (the one that fails)."""
    records = journal_of_jobs(journal)
    seg0 = [r for r in records if r.segment_index == 0]
    return records[0].writer_id, seg0, seg0[5]


def failed_beside_a_live_job(journal: Path) -> tuple[str, list[Record], Record]:
    """``job_five``, run 1 (closed: its index saved) having written x's failure and a live job's retry.

    The live job (in segment 2) keeps that ledger segment, so the failure outlives the ledger
    segment of the success that outranks it.
    """
    records = journal_of_jobs(journal)
    writer = records[0].writer_id
    seg0 = [r for r in records if r.segment_index == 0]
    live = next(r for r in records if r.segment_index == 2)
    x = seg0[5]
    first = open_state(journal, writer)
    first.append([failure(x), retry(live)])  # a live job's entry: this ledger segment stays
    first.close()  # saved: the failure listed
    return writer, seg0, x


def fail_and_compact(state: ForwarderState, seg0: list[Record], x: Record) -> None:
    """x fails for good, the rest of segment 0 succeeds, and the segment is compacted (x's success comes late)."""
    state.append([failure(x)])
    state.append([success(r) for r in seg0 if r is not x])
    compact(state)


def fail_then_succeed(journal: Path) -> tuple[ForwarderState, Record]:
    """Segment 0's job 5 fails for good, then succeeds; the rest of segment 0 succeeds."""
    writer, seg0, x = job_five(journal)
    state = open_state(journal, writer)
    state.append([failure(x)])
    assert listed_ids(journal) == [Envelope.from_bytes(x.payload).id]
    state.append([success(r) for r in seg0])  # x's late success among them
    assert loc_of(x) not in state.index.failed
    assert listed_ids(journal) == []
    return state, x


def compact(state: ForwarderState) -> None:
    c = Compactor(state)
    for _ in range(2):
        c.hurry()
        c.compact()


def test_a_succeeded_job_is_not_listed_again_once_its_segment_is_compacted(journal_dir: Path) -> None:
    state, x = fail_then_succeed(journal_dir)
    compact(state)
    assert load_compacted(str(journal_dir)).is_compacted((x.writer_id, 0))
    job_id = Envelope.from_bytes(x.payload).id
    assert listed_ids(journal_dir) == []  # failed before the fix
    with pytest.raises(JobNotFailed):
        failures.requeue([job_id], str(journal_dir))  # pushed a job that had succeeded
    assert status.collect_status(str(journal_dir))["failed_listed"] == 0
    index = load_index(str(journal_dir), load_compacted(str(journal_dir)))
    assert index.outcome_at(loc_of(x), lambda _loc: True) == "succeeded"
    state.close()


def test_a_forwarder_started_again_neither_lists_nor_re_appends_it(journal_dir: Path) -> None:
    """A start without a saved index replays it all; its compaction re-appended listed failures."""
    state, x = fail_then_succeed(journal_dir)
    compact(state)
    state.close(by_path=False)  # a crash: no saved index
    (journal_dir / "ledger-index.state").unlink(missing_ok=True)
    again = open_state(journal_dir, x.writer_id)
    assert loc_of(x) not in again.index.failed
    compact(again)  # the first run's ledger chain is sealed now: it can go
    again.close()
    assert listed_ids(journal_dir) == []
    last = open_state(journal_dir, x.writer_id)
    assert loc_of(x) not in last.index.failed
    last.close()


def test_the_success_is_marked_only_when_it_outranks_a_failure(journal_dir: Path) -> None:
    state, x = fail_then_succeed(journal_dir)
    marked = [e for e in _ledger(journal_dir) if e.over is not None]
    assert [(e.loc, e.over) for e in marked] == [(loc_of(x), "failed")]
    state.close()


def _ledger(journal: Path) -> list[Entry]:
    return [e for _, e in read_ledger(str(journal))]


@pytest.mark.parametrize("mark_first", [False, True])
def test_other_chains_read_in_either_order(tmp_path: Path, mark_first: bool) -> None:
    """The failure in one ledger chain, the success in another: the replay reads either first."""
    journal = tmp_path / "journal"
    records = journal_of_jobs(journal)
    x = records[5]
    marked = Entry("done", "x", loc_of(x), outcome="succeeded", at=2.0, over="failed")
    batches = ([marked], [failure(x)]) if mark_first else ([failure(x)], [marked])
    chains = sorted((open_ledger_writer(str(journal)) for _ in batches), key=lambda w: w.writer_id)
    for ledger, batch in zip(chains, batches, strict=True):  # each in a chain of its own, read in id order
        ledger.append_many(e.to_bytes() for e in batch)
        ledger.close()
    read = [e.outcome for e in _ledger(journal)]
    assert read == (["succeeded", "failed"] if mark_first else ["failed", "succeeded"])
    compacted = load_compacted(str(journal))
    compacted.through[x.writer_id] = 0
    index = load_index(str(journal), compacted)
    assert loc_of(x) not in index.failed
    assert len(index.failed) == 0
    assert index.outcome_at(loc_of(x), lambda _loc: True) == "succeeded"


def retry(record: Record) -> Entry:
    """An entry of a job still live: the ledger segment holding it cannot go yet."""
    return Entry(
        "retry", Envelope.from_bytes(record.payload).id, loc_of(record), attempt=1, run_at=9e9, at=1.0
    )


def test_the_mark_outlives_its_ledger_segment_while_the_failure_lives_in_another(journal_dir: Path) -> None:
    """Run 1 wrote the failure (and an entry of a live job), run 2 the success: run 3 compacts."""
    writer, seg0, x = failed_beside_a_live_job(journal_dir)
    second = open_state(journal_dir, writer)
    second.append([success(r) for r in seg0])
    marked_in = second.own_chain
    second.close()
    third = open_state(journal_dir, writer)
    compact(third)
    assert load_compacted(str(journal_dir)).is_compacted((writer, 0))
    chains = set(ledger_chains(str(journal_dir)))
    assert marked_in not in chains  # the success's ledger segment went ...
    assert first_chain_of(journal_dir, x) in chains  # ... the failure's stays (a live job's retry)
    marks = [e for e in _ledger(journal_dir) if e.over is not None]
    assert [e.loc for e in marks] == [loc_of(x)]  # ... so the mark was appended again
    third.close()
    assert listed_ids(journal_dir) == []
    index = load_index(str(journal_dir), load_compacted(str(journal_dir)))
    assert loc_of(x) not in index.failed
    again = open_state(journal_dir, writer)
    assert loc_of(x) not in again.index.failed
    again.close()


def ledger_chains(journal: str) -> list[str]:
    return list(list_chains(ledger_dir(journal)))


def first_chain_of(journal: Path, record: Record) -> str:
    return next(
        r.writer_id for r, e in read_ledger(str(journal)) if e.loc == loc_of(record) and e.outcome == "failed"
    )


@pytest.mark.parametrize("saved_after_mark", [False, True])
def test_a_saved_index_taken_before_or_after_the_mark(journal_dir: Path, saved_after_mark: bool) -> None:
    """A start resumes from the saved index and replays the rest, the journal segment gone since."""
    writer, seg0, x = failed_beside_a_live_job(journal_dir)
    second = open_state(journal_dir, writer)
    second.append([success(r) for r in seg0])
    if saved_after_mark:
        second.close()
        second = open_state(journal_dir, writer)
    compact(second)
    assert load_compacted(str(journal_dir)).is_compacted((writer, 0))
    second.close(by_path=False)  # a crash: the index saved is the one taken before (or after) the mark
    assert listed_ids(journal_dir) == []
    third = open_state(journal_dir, writer)
    assert loc_of(x) not in third.index.failed
    compact(third)
    third.close()
    assert listed_ids(journal_dir) == []
    last = open_state(journal_dir, writer)
    assert loc_of(x) not in last.index.failed
    assert len(last.index.failed) == 0
    last.close()


def test_a_crash_between_appending_the_mark_again_and_deleting_its_segment(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both copies of the mark read: the failure stays off the list (a mark is idempotent)."""
    writer, seg0, x = failed_beside_a_live_job(journal_dir)
    second = open_state(journal_dir, writer)
    second.append([success(r) for r in seg0])
    second.close()
    third = open_state(journal_dir, writer)
    real = dead_segments.remove_oldest_segment

    class Crash(Exception):
        pass

    def crash_on_ledger(path: str, writer_id: str, index: int) -> None:
        if path.endswith("ledger"):
            raise Crash
        real(path, writer_id, index)

    monkeypatch.setattr(dead_segments, "remove_oldest_segment", crash_on_ledger)
    with pytest.raises(Crash):
        compact(third)
    third.close(by_path=False)
    marks = [e for e in _ledger(journal_dir) if e.over is not None]
    assert len(marks) == 2  # the original and the copy
    assert listed_ids(journal_dir) == []
    monkeypatch.setattr(dead_segments, "remove_oldest_segment", real)
    again = open_state(journal_dir, writer)
    assert loc_of(x) not in again.index.failed
    compact(again)
    again.close()
    assert listed_ids(journal_dir) == []


def test_punched_its_record_is_not_listed_either(journal_dir: Path) -> None:
    """The punched case ranks as a live segment does: the job's record punched, still off the list."""
    writer, seg0, x = job_five(journal_dir)
    state = open_state(journal_dir, writer)
    state.append([failure(x)])
    state.append([success(r) for r in seg0[1:]])  # seg0[0] never finishes: the segment stays
    if not punch_supported(str(journal_dir)):
        state.close()
        pytest.skip("no hole punching on this filesystem")
    assert Puncher(state, min_bytes=300).step() > 0
    compact(state)
    assert not load_compacted(str(journal_dir)).is_compacted((writer, 0))
    state.close(by_path=False)
    assert listed_ids(journal_dir) == []
    again = open_state(journal_dir, writer)
    assert loc_of(x) not in again.index.failed
    again.close()


def test_the_dashboards_view_does_not_list_it_either(journal_dir: Path) -> None:
    """The failed page's view replays the ledger incrementally, compacted segments included."""
    state, _ = fail_then_succeed(journal_dir)
    view = LedgerView(str(journal_dir))
    assert view.failed() == []
    compact(state)
    assert view.failed() == []  # read again after the compaction
    assert LedgerView(str(journal_dir)).failed() == []
    state.close()


def test_a_success_reported_after_the_failed_jobs_segment_was_compacted(journal_dir: Path) -> None:
    """The late event is not counted (its segment is gone) but its failure leaves the list."""
    writer, seg0, x = job_five(journal_dir)
    state = open_state(journal_dir, writer)
    fail_and_compact(state, seg0, x)
    assert load_compacted(str(journal_dir)).is_compacted((writer, 0))
    job_id = Envelope.from_bytes(x.payload).id
    assert listed_ids(journal_dir) == [job_id]
    event = CompletionEvent(
        id=job_id, loc=loc_of(x), queue="q", outcome="succeeded", final=True, retry_delay=None,
        attempt=1, dup=False, error=None, at=3.0,
    )  # fmt: skip
    transport = Events([event.to_json()])
    harvester = Harvester(state, transport)  # type: ignore[arg-type]
    before = load_compacted(str(journal_dir))
    assert harvester.harvest() == 1
    assert transport.acked == ["1-0"]
    assert loc_of(x) not in state.index.failed
    assert listed_ids(journal_dir) == []  # listed, and requeued by a requeue, before the fix
    assert load_compacted(str(journal_dir)) == before  # counted failed once: not counted again
    state.close(by_path=False)
    again = open_state(journal_dir, writer)
    assert loc_of(x) not in again.index.failed
    again.close()
