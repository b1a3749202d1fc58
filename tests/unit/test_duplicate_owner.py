"""Which owner a pending duplicate follows, and what its settle reads of it (issue 29's review).

A duplicate follows the owner it was recorded against: its ``duplicate`` entry holds that
owner's position (``ol``), so a rebuilt table has the rows the lost one had, and a crash never
changes a duplicate's outcome (docs/reliability.md, "Duplicates"). A compacted owner's outcome
is the one its key entry or its failure's row kept, not ``succeeded``; a settle sends SQL only
about the endings that may own duplicates, and reads no more rows at once than it settles; a saved index of format 2 (duplicates in it)
still loads them.
"""

from __future__ import annotations

import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.forwarder import admission as admission_module
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.ledger.entries import Entry
from hybridq.ledger.keytable import KEYS_TABLE_FILE
from hybridq.ledger.store import read_ledger

from tests.unit import test_ledger_replay
from tests.unit.test_duplicate_table import _state_with_duplicates, as_older_format, statements

Loc = tuple[str, int, int]


def _env(job_id: str, key: str, requeue: int = 0) -> Envelope:
    return Envelope(id=job_id, func="m.f", queue="q", idempotency_key=key, created_at=0.0, requeue=requeue)


def _loaded(journal: str) -> ForwarderState:
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    return state


# -- a requeue takes the key over --------------------------------------------------------------


def _requeue_story(tmp_path: Path, old_entry: bool) -> tuple[str, str]:
    """D is a duplicate of A (its entry with A's position, or as written before ``ol``); the
    forwarder settled once (D waits for A); A fails and the process is killed before D's
    settle; the requeue A2 takes the key over, read after the restart."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = _loaded(journal)
    admission = Admission(state)
    assert admission.admit(_env("A", "k"), (writer, 0, 32))
    admission.flush()
    if old_entry:
        key = _env("A", "k").key_id
        state.append([Entry("duplicate", "D", (writer, 1, 32), key=key, dup_of="A", at=1.0, queue="q")])
    else:
        assert not admission.admit(_env("D", "k"), (writer, 1, 32))
        admission.flush()
    admission.settle()  # D waits for A
    state.append([Entry("done", "A", (writer, 0, 32), outcome="failed", at=2.0)])
    assert admission.admit(_env("A", "k", requeue=1), (writer, 2, 32))  # the requeue: A's key
    state.append(admission._entries)
    admission.reset()
    state.close()
    return journal, writer


def _restart(journal: str, writer: str, lose_table: bool) -> tuple[str | None, bool]:
    if lose_table:
        os.unlink(os.path.join(journal, KEYS_TABLE_FILE))
    state = _loaded(journal)
    try:
        Admission(state).settle()
        return state.index.outcome((writer, 1, 32)), (writer, 1, 32) in state.index.duplicates
    finally:
        state.close()


def test_a_duplicate_follows_its_owner_after_a_requeue_whether_the_table_survived(tmp_path: Path) -> None:
    """Fails before: trusted ``('failed', False)``, rebuilt ``(None, True)`` (waiting for A2)."""
    journal, writer = _requeue_story(tmp_path, old_entry=False)
    copy = str(tmp_path / "copy")
    shutil.copytree(journal, copy)
    assert _restart(journal, writer, lose_table=False) == ("failed", False)
    assert _restart(copy, writer, lose_table=True) == ("failed", False)


def test_an_entry_without_its_owners_position_follows_the_owner_of_the_first_look(tmp_path: Path) -> None:
    """Entries written before ``ol``: the first look records the key's owner then, in the table
    only; a table rebuilt after the requeue records the requeue (docs/reliability.md)."""
    journal, writer = _requeue_story(tmp_path, old_entry=True)
    copy = str(tmp_path / "copy")
    shutil.copytree(journal, copy)
    assert _restart(journal, writer, lose_table=False) == ("failed", False)
    assert _restart(copy, writer, lose_table=True) == (None, True)  # waits for the requeue


def test_the_entry_records_the_owners_position(tmp_path: Path) -> None:
    journal, writer, state, _ = _state_with_duplicates(tmp_path, 2)
    state.close()
    dups = [e for _, e in read_ledger(journal) if e.kind == "duplicate"]
    assert [e.owner_loc for e in dups] == [(writer, 0, 32)] * 2
    assert Entry.from_bytes(dups[0].to_bytes()) == dups[0]
    assert b'"ol":' in dups[0].to_bytes()


# -- a compacted owner ---------------------------------------------------------------------------


def _compact_owner(state: ForwarderState, writer: str) -> None:
    """As if the owner's journal segment was compacted: its outcome forgotten by the index."""
    state.index.forget_segment((writer, 0))
    real = state.compacted.is_compacted
    state.compacted.is_compacted = lambda seg: seg == (writer, 0) or real(seg)  # type: ignore[method-assign]


def _a_start_settles_them(journal: str, writer: str, outcome: str) -> None:
    """A start whose owner's segment was compacted: its look settles every duplicate with ``outcome``."""
    state = _loaded(journal)
    try:
        _compact_owner(state, writer)
        assert state.index.duplicates.check_all  # the start's look
        Admission(state).settle()
        assert len(state.index.duplicates) == 0
        assert state.index.outcome((writer, 1, 32)) == outcome
    finally:
        state.close()


def test_a_start_settles_with_a_compacted_cancelled_owners_outcome(tmp_path: Path) -> None:
    """Fails before: read as ``succeeded`` (the key entry's outcome was not passed)."""
    journal, writer, state, _ = _state_with_duplicates(tmp_path, 3)
    owner = state.index.keys.get(_env("owner", "k").key_id)
    assert owner is not None
    state.append([Entry("done", "owner", (writer, 0, 32), outcome="cancelled", at=1.0)])
    state.index.duplicates.take_ended()  # as if the settle never came
    state.index.keys.own(
        Entry("key", "owner", owner.loc, key=owner.key, at=owner.at, outcome="cancelled", until=9e9)
    )
    state.close()
    _a_start_settles_them(journal, writer, "cancelled")


def test_a_compacted_failed_owner_that_was_requeued_is_failed(tmp_path: Path) -> None:
    """Fails before: its requeue delisted the failure, so it read as ``succeeded``."""
    journal, writer, state, _ = _state_with_duplicates(tmp_path, 3)
    state.append([Entry("done", "owner", (writer, 0, 32), outcome="failed", at=1.0)])
    state.index.duplicates.take_ended()
    state.append([Entry("requeued", "owner", (writer, 0, 32), at=2.0)])
    state.close()
    _a_start_settles_them(journal, writer, "failed")


# -- what a settle sends and reads -------------------------------------------------------------


def test_a_settle_sends_no_sql_for_endings_that_own_no_duplicate(tmp_path: Path) -> None:
    """Fails before: every ending while duplicates were pending went to SQL as JSON."""
    _, writer, state, admission = _state_with_duplicates(tmp_path, 20)
    try:
        admission.settle()
        with statements(state.index.keys) as seen:
            for step in range(5):
                for i in range(100):
                    state.index.apply_succeeded((writer, 2, 32 + 1000 * step + i))
                admission.settle()
        assert seen == []
        state.append([Entry("done", "owner", (writer, 0, 32), outcome="succeeded", at=1.0)])
        admission.settle()
        assert len(state.index.duplicates) == 0
    finally:
        state.close()


#: Duplicates without their owner's position (an upgrade's), each of its own pending key.
UNRESOLVED = 5_000


def test_the_first_look_at_rows_without_an_owner_does_not_read_them_all_at_once(tmp_path: Path) -> None:
    """Fails before: every such row was read as an entry at once (5.97 MB at 5,000, now 0.10 MB)."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = _loaded(journal)
    try:
        admission = Admission(state)
        for i in range(UNRESOLVED):
            assert admission.admit(_env(f"owner-{i}", f"k{i}"), (writer, 0, 32 + i))
        admission.flush()
        state.append(
            [
                Entry(
                    "duplicate",
                    f"d{i}",
                    (writer, 1, 32 + i),
                    key=_env("x", f"k{i}").key_id,
                    dup_of=f"owner-{i}",
                )
                for i in range(UNRESOLVED)
            ]
        )
        tracemalloc.start()
        try:
            admission.settle()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert not state.index.duplicates.unresolved
        assert peak < 50 * UNRESOLVED, f"{peak / UNRESOLVED:.0f} bytes per row at the first look"
        state.append([Entry("done", "owner-7", (writer, 0, 39), outcome="failed", at=1.0)])
        admission.settle()
        assert state.index.outcome((writer, 1, 39)) == "failed"
        assert len(state.index.duplicates) == UNRESOLVED - 1
    finally:
        state.close()


# -- upgrades --------------------------------------------------------------------------------------


def test_a_saved_index_of_format_2_loads_its_duplicates(tmp_path: Path) -> None:
    """Upgrade from format 2 (failures and duplicates in the index): its duplicates become
    rows (entries without ``ol``: the first look finds their owner), the table's others go."""
    journal, writer, state, _ = _state_with_duplicates(tmp_path, 10)
    state.close()
    as_older_format(journal, writer, v=2, failed=[], requeued=[])
    state = _loaded(journal)
    try:
        assert list(state.index.duplicates) == [(writer, 1, 32)]
        admission = Admission(state)
        admission.settle()
        assert len(state.index.duplicates) == 1  # waits for its pending owner
        state.append([Entry("done", "owner", (writer, 0, 32), outcome="succeeded", at=1.0)])
        admission.settle()
        assert state.index.outcome((writer, 1, 32)) == "succeeded"
    finally:
        state.close()


def test_a_settle_appends_one_owners_many_duplicates_a_chunk_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before: the 25 settlings went in one append (at 20,000 duplicates of
    one owner, every entry and payload at once)."""
    monkeypatch.setattr(admission_module, "SETTLE_CHUNK", 10)
    journal, writer, state, admission = _state_with_duplicates(tmp_path, 25)
    try:
        state.append([Entry("done", "owner", (writer, 0, 32), outcome="succeeded", at=1.0)])
        real, sizes = state.append, []

        def append(entries: list[Entry]) -> None:
            sizes.append(len(entries))
            real(entries)

        monkeypatch.setattr(state, "append", append)
        admission.settle()
        assert sizes == [10, 10, 5]
        assert len(state.index.duplicates) == 0
    finally:
        state.close()
    settled = [e.job_id for _, e in read_ledger(journal) if e.kind == "done" and e.dup_of == "owner"]
    assert sorted(settled) == sorted(f"dup-{i}" for i in range(25))
