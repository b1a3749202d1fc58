"""A map of finished jobs whose arrays moved to disk (``hybridq.ledger.outcome_spill``) against a ``dict``.

A lookup that missed a finished job would let it run again (docs/reliability.md), so the checks
of ``test_segment_outcomes`` and ``test_punched_outcomes`` run here on spilled maps: blocks of a
few jobs (many blocks, a partial last one), merges after the spill (appends and merges of jobs
that finished out of order), rank upgrades in the file, deletes, odd names, punched ranges and
offsets past ``2**32``; then the index past a small cap, the saved index of spilled maps, and
what a failed write or read of the file does (a read never answers "not finished").
"""

from __future__ import annotations

import errno
import logging
import os
import random
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import JournalIOError
from hybridq.journal import JournalWriter
from hybridq.ledger import outcome_disk, outcome_spill, outcomes, saved_index, spill_files
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.outcomes import SegmentOutcomes
from hybridq.ops.status import collect_status
from hybridq.testing.memory import MemoryTransport

from tests import tasks
from tests.unit.test_completions import make_forwarder, settle
from tests.unit.test_punched_outcomes import check, punch_step, records
from tests.unit.test_segment_outcomes import NAMES, a_name, an_offset, check_same, check_whole, one_step


@pytest.fixture(params=[1, 4, 512], ids=["block1", "block4", "block512"])
def block(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Jobs per block of the file (small ones: many blocks, a partial last one, in a short run)."""
    monkeypatch.setattr(outcome_spill, "SPILL_BLOCK", request.param)
    monkeypatch.setattr(outcomes, "MERGE_FLOOR", 4)
    monkeypatch.setattr(outcomes, "MERGE_FRACTION", 8)
    return int(request.param)


@pytest.mark.parametrize("seed", range(8))
def test_a_spilled_map_answers_as_a_dict_does(seed: int, block: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    done, model = SegmentOutcomes(), {}
    pool: list[int] = []
    for step in range(rng.randrange(200, 2000)):
        offset, name, op = an_offset(rng, pool), a_name(rng), rng.random()
        one_step(done, model, offset, name, op)  # a code rewritten in the file (an odd name: read back)
        if step % 23 == 0 or rng.random() < 0.02:
            done.spill(str(tmp_path))  # a spilled map's recent: merged into its file
        check_same(done, model, [offset, offset + 1, offset - 1, *rng.sample(pool, min(len(pool), 3))])
        if step % 97 == 0:
            check_whole(done, model)
    assert done.spilled
    check_whole(done, model)
    check_same(done, model, [*model, *pool])
    assert len(os.listdir(tmp_path / spill_files.SPILL_DIR)) == 1  # its file; each one before removed


@pytest.mark.parametrize("order", ["increasing", "shuffled", "late"])
def test_every_finished_job_is_found_in_a_spilled_map_after_each_merge(
    order: str, block: int, tmp_path: Path
) -> None:
    offsets = [4096 + 300 * i for i in range(3000)]
    if order == "shuffled":
        random.Random(29).shuffle(offsets)
    elif order == "late":  # a drain in order, every 97th job finishing 3,000 jobs later (a retry)
        offsets.sort(key=lambda o: o + (900_000 if o % 97 == 0 else 0))
    done = SegmentOutcomes()
    done.insert(offsets[0], "succeeded")
    assert done.spill(str(tmp_path))
    for n, offset in enumerate(offsets[1:], 2):
        assert done.insert(offset, "failed" if n % 11 == 0 else "succeeded") is None
        assert offset in done
        if n % 499 == 0:
            assert all(o in done for o in offsets[:n])
            assert not any(o + 1 in done for o in offsets[:n])
    done.spill(str(tmp_path))
    assert done.spilled
    assert done.resident() == 0
    assert len(done) == len(offsets) == sum(done.tally().values())
    assert done.holds("failed")
    assert not done.holds("cancelled")
    assert sorted(done) == sorted(offsets)


def test_a_spilled_map_past_four_bytes(block: int, tmp_path: Path) -> None:
    done = SegmentOutcomes((4096 + i, "succeeded") for i in range(300))
    assert done.spill(str(tmp_path))
    done[2**32 + 5] = "failed"
    done.update((2**33 + i, "cancelled") for i in range(300))  # appended, 8-byte offsets
    done.update((2**64 - 1 - i, "invalid") for i in range(3))
    done.spill(str(tmp_path))
    done[4100] = "failed"  # in place, in the file
    model = {4096 + i: "succeeded" for i in range(300)} | {2**32 + 5: "failed", 4100: "failed"}
    model |= {2**33 + i: "cancelled" for i in range(300)} | {2**64 - 1 - i: "invalid" for i in range(3)}
    assert done.spilled
    assert done.resident() == 0
    check_whole(done, model)
    check_same(done, model, [*model, 2**32 + 4, 2**33 + 300, 2**64 - 4, 2**64])


@pytest.mark.parametrize("seed", range(8))
def test_a_spilled_map_with_punched_ranges_answers_as_a_dict_does(
    seed: int, block: int, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    offsets = records(rng)
    done, model = SegmentOutcomes(), {}
    for step in range(rng.randrange(300, 2000)):
        offset, name, op = rng.choice(offsets[:-1]), rng.choice(NAMES), rng.random()
        punch_step(done, model, rng, offsets, offset, name, op)
        if step % 17 == 0:
            done.spill(str(tmp_path))
        if step % 50 == 0:
            check(done, model, offsets)
    check(done, model, offsets)
    assert len(done.punched()) > 0


def test_the_index_past_its_cap_spills_the_largest_segments_and_answers_the_same(
    block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four writers, twelve segments each, jobs finishing interleaved (priorities): past a cap of
    2,000 offsets the largest segments but each writer's newest two move to disk; every answer,
    the counts and the saved index stay those of the index without a cap."""
    monkeypatch.setattr(outcome_disk, "SPILL_CHECK_MIN", 64)
    rng = random.Random(29)
    capped, plain = LedgerIndex(), LedgerIndex()
    capped.spill_past(str(tmp_path), 2000)
    jobs = [(f"w{w}", s, 4096 + 300 * i) for w in range(4) for s in range(12) for i in range(300)]
    rng.shuffle(jobs)
    for n, loc in enumerate(jobs):
        outcome = rng.choice(NAMES)
        for index in (capped, plain):
            if outcome == "succeeded":
                index.apply_succeeded(loc)
            else:
                index.apply(Entry("done", "j", loc, outcome=outcome, at=1.0))
        if n % 100 == 99:
            capped.check_spill()  # as the forwarder does after each ledger append
        if n % 1000 == 0:
            assert sum(done.resident() for done in capped.terminal.values()) <= 2000 + 2000 // 8 + 8 * 300
    spilled = {seg for seg, done in capped.terminal.items() if done.spilled}
    assert spilled
    assert not any(s >= 10 for _, s in spilled)
    assert capped.terminal == plain.terminal
    assert (capped.terminal_count, capped.totals) == (plain.terminal_count, plain.totals)
    for loc in rng.sample(jobs, 2000):
        for probe in (loc, (loc[0], loc[1], loc[2] + 1)):
            assert capped.is_terminal(probe) == plain.is_terminal(probe)
            assert capped.outcome(probe) == plain.outcome(probe)
    assert capped.counts(list(capped.terminal)) == plain.counts(list(plain.terminal))
    raw = saved_index.encode(capped, {}, {}, {})
    assert raw == saved_index.encode(plain, {}, {}, {})  # no format change: every map in full
    back = saved_index.decode(raw).index
    back.spill_past(str(tmp_path), 2000)  # loaded, spilled again past the cap
    assert any(done.spilled for done in back.terminal.values())
    assert back.terminal == plain.terminal
    for seg in list(capped.terminal):
        capped.forget_segment(seg)
    assert capped.terminal_count == 0
    assert not any(capped.totals.values())


def test_a_failed_write_keeps_the_map_in_memory_and_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(spill_files, "_warned", False)
    monkeypatch.setattr(spill_files, "_resume_at", 0.0)  # restored after: no backoff left to the next test
    monkeypatch.setattr(outcomes, "MERGE_FLOOR", 4)
    done, model = SegmentOutcomes(), {}
    for i in range(100):
        done.insert(4096 + 300 * i, "succeeded")
        model[4096 + 300 * i] = "succeeded"
    assert done.spill(str(tmp_path))
    real = os.pwrite

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with caplog.at_level(logging.DEBUG, logger="hybridq.ledger"):
        for i in range(100, 200):  # appends fail: merged in memory, the file dropped
            done.insert(4096 + 300 * i, "succeeded")
            model[4096 + 300 * i] = "succeeded"
        done[4096] = "failed"
        model[4096] = "failed"
        assert not done.spill(str(tmp_path))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "spill file" in warnings[0].getMessage()
    assert not done.spilled
    check_whole(done, model)
    check_same(done, model, list(model))
    monkeypatch.setattr(os, "pwrite", real)
    spill_files._resume_at = 0.0  # the backoff after the failure over
    assert done.spill(str(tmp_path))  # room again
    check_whole(done, model)


@pytest.mark.parametrize("damage", ["eio", "truncated"])
def test_a_read_error_of_the_spill_file_raises_and_never_answers_not_finished(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outcome_spill, "SPILL_BLOCK", 4)
    index = LedgerIndex()
    for i in range(64):
        index.apply_succeeded(("w", 0, 4096 + 300 * i))
    done = index.terminal[("w", 0)]
    assert done.spill(str(tmp_path))
    spill = done._spill
    assert spill is not None
    outcome_spill._forget_kept(spill._serial)  # no block kept from the spill itself
    if damage == "eio":

        def broken(*args: object) -> bytes:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "pread", broken)
    else:
        os.ftruncate(spill._fd, 9 * 4 * 3)
    loc = ("w", 0, 4096 + 300 * 40)
    with pytest.raises(JournalIOError, match="spill file"):
        index.is_terminal(loc)
    with pytest.raises(JournalIOError):
        index.outcome(loc)
    with pytest.raises(JournalIOError):
        index.apply_succeeded(loc)  # not added again as new
    with pytest.raises(JournalIOError):
        list(done)
    assert index.terminal_count == 64


def in_memory(index: LedgerIndex) -> set[int]:
    """The segments whose map holds offsets in memory."""
    return {seg[1] for seg, done in index.terminal.items() if done.resident()}


def test_the_forwarder_spills_past_index_offsets_max_and_runs_no_job_twice(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty small segments, one job of each waiting in a queue no worker takes: their maps stay
    live. Under ``index_offsets_max=0`` the finished jobs of all but the newest two move to disk,
    a restart spills them again from the saved index, and no job is pushed or run twice."""
    monkeypatch.setattr(outcome_disk, "SPILL_CHECK_MIN", 1)
    monkeypatch.setattr(outcome_spill, "SPILL_BLOCK", 4)
    fast, slow = Queue(journal=journal_dir), Queue("slow", journal=journal_dir)
    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        for s in range(20):
            envs = [slow.prepare(tasks.add, (s, 0)), *(fast.prepare(tasks.add, (s, i)) for i in range(1, 10))]
            writer.append_many(e.to_bytes() for e in envs)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, index_offsets_max=0)
    settle(forwarder)
    assert transport.work() == 180
    settle(forwarder)
    index = forwarder.state.index
    assert in_memory(index) == {18, 19}  # the drain front; the others spilled (or punched: none listed)
    assert sum(done.spilled for done in index.terminal.values()) >= 9
    assert index.terminal_count == 180
    forwarder.close()
    forwarder = make_forwarder(journal_dir, transport, index_offsets_max=0)
    settle(forwarder)
    index = forwarder.state.index
    assert in_memory(index) == {18, 19}  # the saved index's maps spilled again
    assert transport.work() == 0  # nothing pushed again
    assert transport.work("slow") == 20
    settle(forwarder)
    settle(forwarder)
    forwarder.close()
    assert len(transport.executions) == 200
    status = collect_status(str(journal_dir))
    assert (status["succeeded"], status["pending"]) == (200, 0)
