"""A failure recorded after the job's success is never listed, once compacted either.

The mirror of ``test_outranked_failure.py`` (x1's review, M1): a job succeeded, then a final
failure of it arrived (a second delivery's, in the same harvest batch or a later one: a refused
run, a stored result that expired, Redis losing state). The live index ranks the success higher
and ignores the failure, but once the job's journal segment was compacted every replay listed
the failure (with the envelope the harvest attached to it) and ``failed requeue`` ran the job
that had succeeded. The forwarder writes such a failure with ``"under":"succeeded"`` and no
envelope (docs/reliability.md, "A success outranks a failure"): no replay lists it. Also the
review's LOW findings: a duplicate success marks as it delists (L1), a requeue and an outranking
success read alike in any order (L2), one mark per job for repeated late successes (L3), and no
outcome lookup for successes of a segment with no failure (L5). The second review's: the
dashboard does not count a failure under a success (L1), nor does a live replay list it read
before its success (L3), and ``SegmentOutcomes.holds`` over random histories (L6).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import JobNotFailed
from hybridq.forwarder.harvest import Harvester
from hybridq.http.dashboard.ledger_view import LedgerView
from hybridq.journal import Record
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.outcomes import SegmentOutcomes
from hybridq.ledger.store import load_index, open_ledger_writer, read_ledger
from hybridq.ops import failures, status
from hybridq.protocol import CompletionEvent

from tests.support.harvested import Events
from tests.support.started import open_state
from tests.unit.test_outranked_failure import (
    compact,
    fail_and_compact,
    failure,
    job_five,
    journal_of_jobs,
    listed_ids,
    loc_of,
    success,
)


def outcome_event(record: Record, outcome: str, at: float, *, dup: bool = False) -> dict[str, object]:
    return CompletionEvent(
        id=Envelope.from_bytes(record.payload).id, loc=loc_of(record), queue="q", outcome=outcome,
        final=True, retry_delay=None, attempt=1, dup=dup, error=None if outcome == "succeeded" else "boom",
        at=at,
    ).to_json()  # fmt: skip


def job_id(record: Record) -> str:
    return Envelope.from_bytes(record.payload).id


def ledger(journal: Path) -> list[Entry]:
    return [e for _, e in read_ledger(str(journal))]


def assert_never_listed(journal: Path, x: Record) -> None:
    """Not listed by a reader, not requeueable, and not by a forwarder started without its saved index."""
    assert listed_ids(journal) == []
    with pytest.raises(JobNotFailed):
        failures.requeue([job_id(x)], str(journal))
    assert status.collect_status(str(journal))["failed_listed"] == 0
    (journal / "ledger-index.state").unlink(missing_ok=True)
    for _ in range(2):  # its compaction re-appended the failures it listed, for good
        again = open_state(journal, x.writer_id)
        assert loc_of(x) not in again.index.failed
        compact(again)
        again.close()
    assert listed_ids(journal) == []


def test_success_then_final_failure_in_one_harvest_batch(journal_dir: Path) -> None:
    writer, seg0, x = job_five(journal_dir)
    state = open_state(journal_dir, writer)
    transport = Events([outcome_event(x, "succeeded", 3.0), outcome_event(x, "failed", 3.1)])
    Harvester(state, transport).harvest()  # type: ignore[arg-type]
    assert transport.acked == ["1-0", "2-0"]
    (written,) = [e for e in ledger(journal_dir) if e.outcome == "failed"]
    assert (written.under, written.job) == ("succeeded", None)  # no envelope: nothing to requeue
    assert state.index.outcome(loc_of(x)) == "succeeded"
    state.append([success(r) for r in seg0 if r is not x])
    compact(state)
    assert load_compacted(str(journal_dir)).is_compacted((x.writer_id, 0))
    state.close()
    assert_never_listed(journal_dir, x)  # listed and requeued (run again) on main


def test_failure_recorded_in_a_later_batch(journal_dir: Path) -> None:
    writer, seg0, x = job_five(journal_dir)
    state = open_state(journal_dir, writer)
    state.append([success(r) for r in seg0])
    late = failure(x, at=3.0)  # with an envelope, as a caller might give it
    (unchanged,) = state.append([late])  # changed nothing: the job succeeded
    assert (unchanged.under, unchanged.job) == ("succeeded", None)
    assert listed_ids(journal_dir) == []
    compact(state)
    state.close(by_path=False)  # a crash: a start replays what the saved index lacks
    assert_never_listed(journal_dir, x)


def test_a_failure_before_the_success_is_still_listed_until_then(journal_dir: Path) -> None:
    """Only a failure after a success is marked: a failure of its own stays listed."""
    records = journal_of_jobs(journal_dir)
    x, y = records[5], records[6]
    state = open_state(journal_dir, x.writer_id)
    state.append([failure(x), failure(y), success(x)])
    assert [e.under for e in ledger(journal_dir)] == [None, None, None]
    assert listed_ids(journal_dir) == [job_id(y)]
    state.close()


ORDERS = [*itertools.permutations(range(3)), *itertools.permutations(range(1, 3))]


@pytest.mark.parametrize("order", ORDERS)
def test_chains_read_in_any_order(tmp_path: Path, order: tuple[int, ...]) -> None:
    """A failure, the success over it, a failure under it (or only the last two): one chain each."""
    journal = tmp_path / "journal"
    x = journal_of_jobs(journal)[5]
    entries = [
        failure(x),
        Entry(
            "done",
            job_id(x),
            loc_of(x),
            outcome="succeeded",
            at=2.0,
            over="failed" if len(order) == 3 else None,
        ),
        Entry("done", job_id(x), loc_of(x), outcome="failed", at=3.0, under="succeeded"),
    ]
    chains = sorted((open_ledger_writer(str(journal)) for _ in order), key=lambda w: w.writer_id)
    for chain, i in zip(chains, order, strict=True):
        chain.append_many([entries[i].to_bytes()])
        chain.close()
    for compacted_through in (None, 0):
        compacted = load_compacted(str(journal))
        if compacted_through is not None:
            compacted.through[x.writer_id] = compacted_through
        index = load_index(str(journal), compacted)
        assert len(index.failed) == 0
        assert index.outcome_at(loc_of(x), lambda _loc: True) == "succeeded"


def test_a_duplicate_success_delists_the_failure_once_compacted_too(journal_dir: Path) -> None:
    """L1: the live index lets a dup success outrank a failure; so does every replay."""
    writer, seg0, x = job_five(journal_dir)
    state = open_state(journal_dir, writer)
    state.append([failure(x)])
    state.append([Entry("done", job_id(x), loc_of(x), outcome="succeeded", at=2.0, dup=True)])
    assert listed_ids(journal_dir) == []
    state.append([success(r) for r in seg0 if r is not x])
    compact(state)
    assert load_compacted(str(journal_dir)).is_compacted((x.writer_id, 0))
    state.close()
    assert_never_listed(journal_dir, x)  # listed again on main


@pytest.mark.parametrize("requeue_first", [False, True])
def test_a_requeue_and_an_outranking_success_read_alike_in_either_order(
    tmp_path: Path, requeue_first: bool
) -> None:
    """L2: a requeue mark wins over an outranked mark, so a key owner's outcome does not depend on order."""
    journal = tmp_path / "journal"
    x = journal_of_jobs(journal)[5]
    marked = Entry("done", job_id(x), loc_of(x), outcome="succeeded", at=2.0, over="failed")
    requeued = Entry("requeued", job_id(x), loc_of(x), at=1.5)
    entries = [failure(x), requeued, marked] if requeue_first else [failure(x), marked, requeued]
    chains = sorted((open_ledger_writer(str(journal)) for _ in entries), key=lambda w: w.writer_id)
    for chain, entry in zip(chains, entries, strict=True):
        chain.append_many([entry.to_bytes()])
        chain.close()
    compacted = load_compacted(str(journal))
    compacted.through[x.writer_id] = 0
    index = load_index(str(journal), compacted)
    assert len(index.failed) == 0
    assert index.outcome_at(loc_of(x), lambda _loc: True) == "failed"  # as a requeued job reads


def test_a_late_success_reported_twice_appends_one_mark(journal_dir: Path) -> None:
    """L3: two late successes of one compacted job in one batch: one mark."""
    writer, seg0, x = job_five(journal_dir)
    state = open_state(journal_dir, writer)
    fail_and_compact(state, seg0, x)
    transport = Events([outcome_event(x, "succeeded", 3.0), outcome_event(x, "succeeded", 3.5)])
    Harvester(state, transport).harvest()  # type: ignore[arg-type]
    assert transport.acked == ["1-0", "2-0"]
    assert [e.loc for e in ledger(journal_dir) if e.over is not None] == [loc_of(x)]
    assert all(not e.result_kept for e in ledger(journal_dir) if e.over is not None)
    state.close()
    assert listed_ids(journal_dir) == []


def test_no_outcome_lookup_for_a_segment_without_a_failure(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L5: a failure live in segment 1 costs segment 0's successes no lookup."""
    records = journal_of_jobs(journal_dir)
    seg0 = [r for r in records if r.segment_index == 0]
    seg1 = [r for r in records if r.segment_index == 1]
    index = LedgerIndex()
    index.apply(failure(seg1[0]))
    index.apply(success(seg0[0]))
    looked: list[int] = []
    real = SegmentOutcomes.get
    monkeypatch.setattr(
        SegmentOutcomes, "get", lambda self, off, *d: looked.append(off) or real(self, off, *d)
    )
    batch = [success(r) for r in seg0[1:]]
    assert index.outranking(batch) == batch
    assert looked == []
    (marked,) = index.outranking([success(seg1[0])])
    assert marked.over == "failed"
    assert looked == [loc_of(seg1[0])[2]]


def test_segment_outcomes_holds_as_a_dict_would() -> None:
    """L5's search of a segment's outcomes: merged, recent and odd ones, and punched ranges."""
    rng = random.Random(7)
    for _ in range(200):
        plain = {
            rng.randrange(10_000): rng.choice(["succeeded", "failed", "cancelled", "x"])
            for _ in range(rng.randrange(40))
        }
        done = SegmentOutcomes(plain)
        for name in ("succeeded", "failed", "cancelled", "invalid", "x"):
            assert done.holds(name) == (name in plain.values())
    punched = SegmentOutcomes({5: "failed"})
    punched.drop_ranges([(100, 200, 3)])
    assert punched.holds("succeeded")
    assert punched.holds("failed")
    assert not punched.holds("cancelled")


def test_a_segment_outcomes_history_holds_what_it_tallies() -> None:
    """Second review L6: inserts, rank upgrades, deletes, merges and punched ranges, at random."""
    rng = random.Random(1)
    names = ["succeeded", "failed", "cancelled", "invalid", "x"]
    for _ in range(300):
        done = SegmentOutcomes()
        for _ in range(rng.randrange(1, 120)):
            op, off = rng.random(), rng.randrange(400)
            try:
                if op < 0.6:
                    done.insert(off, rng.choice(names))
                elif op < 0.8 and len(done):
                    done[off] = rng.choice(names)
                elif op < 0.9:
                    del done[off]
                else:  # a punched range holds finished jobs only
                    start = rng.randrange(350)
                    end = start + rng.randrange(1, 50)
                    for k in range(start, end):
                        if done.get(k) is None:
                            done.insert(k, "succeeded")
                    done.drop_ranges([(start, end, end - start)])
            except (KeyError, ValueError):
                pass
            tally = done.tally()
            for name in names:
                assert done.holds(name) == (tally.get(name, 0) > 0)
            assert done.holds("failed") == any(done.get(k) == "failed" for k in range(450))


def test_a_failure_under_a_success_read_first_is_never_listed() -> None:
    """Second review L3: a live replay reading it before its success lists it no more than compacted."""
    loc = ("w", 0, 10)
    under = Entry("done", "j", loc, outcome="failed", at=3.0, queue="q", under="succeeded")
    index = LedgerIndex()
    index.apply(under)
    assert loc not in index.failed
    index.apply(Entry("done", "j", loc, outcome="succeeded", at=2.0))
    assert len(index.failed) == 0
    assert index.outcome(loc) == "succeeded"


def test_the_dashboard_does_not_count_a_failure_under_a_success(journal_dir: Path) -> None:
    """Second review L1: failed / min counts what status counts (docs/dashboard.md)."""
    x = [r for r in journal_of_jobs(journal_dir) if r.segment_index == 0][5]
    state = open_state(journal_dir, x.writer_id)
    now = 1000.0
    state.append([dataclasses.replace(success(x, at=now), queue="q")])
    (written,) = state.append([failure(x, at=now + 1)])
    assert written.under == "succeeded"
    state.close()
    recent = LedgerView(str(journal_dir), window_s=300.0).recent(now=now + 2)
    assert recent["q"]["succeeded"] == 1
    assert recent["q"]["failed"] == 0
    assert status.collect_status(str(journal_dir))["failed_listed"] == 0
