"""The pending duplicates as rows of the key table's file (``hybridq.ledger.duptable``, issue 29).

Applying ``duplicate``/``done``/``cancel`` entries in any order gives the same pending
duplicates, on disk as in memory; a plain success while none is pending runs no statement; the
forwarder settles a duplicate when its owner turns terminal (one query for the owners of a
step, none per pending duplicate), also after a restart from its saved index; a table that does
not fit the saved index is rebuilt from the ledger; a saved index of format 3 (duplicates in it)
still loads; and the forwarder's heap no longer grows with pending duplicates.
"""

from __future__ import annotations

import gc
import json
import random
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.journal.statefile import read_state, write_state
from hybridq.ledger import duptable, saved_codec
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KEYS_TABLE_FILE, KeyTable
from hybridq.ledger.saved_index import SAVED_INDEX_NAME
from hybridq.ledger.store import read_ledger
from hybridq.ledger.tablefile import TableFile

from tests.unit import test_failure_table, test_ledger_replay

Loc = tuple[str, int, int]


def _env(job_id: str, key: str) -> Envelope:
    return Envelope(id=job_id, func="m.f", queue="q", idempotency_key=key, created_at=0.0)


@contextmanager
def statements(file: TableFile) -> Iterator[list[str]]:
    """The SQL statements ``file`` runs within (SQLite's trace callback)."""
    seen: list[str] = []
    file._db.set_trace_callback(seen.append)
    try:
        yield seen
    finally:
        file._db.set_trace_callback(None)


# -- any order -----------------------------------------------------------------------------------


def _story(rng: random.Random, n: int) -> tuple[list[Entry], set[Loc]]:
    """Entries about ``n`` duplicates of two chains, and the locs still pending after all of them."""
    out, pending = [], set()
    for i in range(n):
        loc = (rng.choice("ab"), rng.randrange(2), 32 + 100 * i)
        out.append(Entry("duplicate", f"d{i}", loc, key=f"k{i % 3}", dup_of=f"o{i % 3}", at=1.0, queue="q"))
        what = rng.choice(["pending", "settled", "cancelled", "cancel asked"])
        if what == "settled":
            out.append(Entry("done", f"d{i}", loc, outcome="succeeded", dup=True, dup_of=f"o{i % 3}", at=2.0))
        elif what == "cancelled":
            out.append(Entry("cancel", f"d{i}", loc, at=2.0))
            out.append(Entry("done", f"d{i}", loc, outcome="cancelled", at=3.0))
        elif what == "cancel asked":  # not settled yet: still pending
            out.append(Entry("cancel", f"d{i}", loc, at=2.0))
        if what in ("pending", "cancel asked"):
            pending.add(loc)
    return out, pending


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("on_disk", [False, True])
def test_applying_entries_in_any_order_gives_the_same_pending_duplicates(
    tmp_path: Path, seed: int, on_disk: bool
) -> None:
    rng = random.Random(seed)
    entries, expected = _story(rng, 40)

    def check(index: LedgerIndex) -> None:
        assert set(index.duplicates) == expected
        assert len(index.duplicates) == len(expected)
        assert all(loc in index.duplicates for loc in expected)
        for loc in expected:
            assert index.duplicates.get(loc) == next(
                e for e in entries if e.loc == loc and e.kind == "duplicate"
            )

    test_failure_table.in_three_orders(tmp_path, rng, entries, on_disk, check)


def test_a_plain_success_with_no_pending_duplicate_runs_no_statement(tmp_path: Path) -> None:
    """B1's hot path: nothing new per outcome while no duplicate is pending (an int test)."""
    index = LedgerIndex(keys=KeyTable(str(tmp_path / KEYS_TABLE_FILE)))
    try:
        with statements(index.keys) as seen:
            for i in range(100):
                index.apply_succeeded(("w", 0, 32 + i))
                index.apply(Entry("done", f"j{i}", ("w", 1, 32 + i), outcome="succeeded"))
                assert ("w", 0, 32 + i) not in index.duplicates
        assert seen == []
    finally:
        index.keys.close()


def test_outcomes_while_duplicates_are_pending_are_deleted_in_one_batch(tmp_path: Path) -> None:
    index = LedgerIndex(keys=KeyTable(str(tmp_path / KEYS_TABLE_FILE)))
    try:
        index.apply(Entry("duplicate", "d", ("w", 0, 32), key="k", dup_of="o", at=1.0))
        with statements(index.keys) as seen:
            for i in range(500):
                index.apply_succeeded(("w", 1, 32 + i))
            index.apply(Entry("done", "d", ("w", 0, 32), outcome="succeeded", dup=True, dup_of="o"))
        assert seen == []  # noted only
        with statements(index.keys) as seen:
            assert ("w", 0, 32) not in index.duplicates
        assert len([s for s in seen if s.startswith("DELETE")]) == 1  # its segment's only
        assert len(index.duplicates) == 0
    finally:
        index.keys.close()


def test_a_job_of_a_segment_or_past_an_offset_without_duplicates_runs_no_statement(tmp_path: Path) -> None:
    """The forwarder's read path (``loc in index.duplicates`` per record) while some are pending."""
    index = LedgerIndex(keys=KeyTable(str(tmp_path / KEYS_TABLE_FILE)))
    try:
        index.apply(Entry("duplicate", "d", ("w", 0, 320), key="k", dup_of="o", at=1.0))
        with statements(index.keys) as seen:
            assert ("w", 1, 320) not in index.duplicates  # another segment
            assert ("w", 0, 420) not in index.duplicates  # read after it
            assert index.duplicates.get(("w", 0, 420)) is None
        assert seen == []
        assert ("w", 0, 320) in index.duplicates
        assert ("w", 0, 32) not in index.duplicates  # before it: looked up
    finally:
        index.keys.close()


# -- the forwarder's settle ----------------------------------------------------------------------


def _state_with_duplicates(tmp_path: Path, n: int) -> tuple[str, str, ForwarderState, Admission]:
    """A loaded forwarder state: job ``owner`` owns key ``k`` (pending), ``n`` duplicates of it."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    admission = Admission(state)
    assert admission.admit(_env("owner", "k"), (writer, 0, 32))
    admission.flush()
    for lo in range(0, n, 1000):
        for i in range(lo, min(n, lo + 1000)):
            assert not admission.admit(_env(f"dup-{i}", "k"), (writer, 1, 32 + 200 * i))
        admission.flush()
    return journal, writer, state, admission


def test_duplicates_settle_once_when_their_owner_finishes_and_not_before(tmp_path: Path) -> None:
    journal, writer, state, admission = _state_with_duplicates(tmp_path, 50)
    try:
        assert len(state.index.duplicates) == 50
        admission.settle()
        assert len(state.index.duplicates) == 50
        state.append([Entry("done", "owner", (writer, 0, 32), outcome="failed", at=1.0)])
        admission.settle()
        admission.settle()
        assert len(state.index.duplicates) == 0
        assert all(state.index.outcome((writer, 1, 32 + 200 * i)) == "failed" for i in range(50))
    finally:
        state.close()
    settled = [e for _, e in read_ledger(journal) if e.kind == "done" and e.dup_of == "owner"]
    assert sorted(e.job_id for e in settled) == sorted(f"dup-{i}" for i in range(50))


def test_a_duplicate_of_a_finished_owner_settles_at_the_next_settle(tmp_path: Path) -> None:
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        admission = Admission(state)
        assert admission.admit(_env("owner", "k"), (writer, 0, 32))
        admission.flush()
        state.append([Entry("done", "owner", (writer, 0, 32), outcome="succeeded", at=1.0)])
        assert not admission.admit(_env("dup", "k"), (writer, 1, 32))
        admission.flush()  # settles: its owner finished already
        assert state.index.outcome((writer, 1, 32)) == "succeeded"
        assert len(state.index.duplicates) == 0
    finally:
        state.close()


#: Pending duplicates of one owner while other jobs finish, batch after batch.
MANY = 20_000


def test_settle_costs_no_walk_of_the_pending_duplicates(tmp_path: Path) -> None:
    """Fails before: every settle walked all of them (one dict lookup each, O(n) per batch)."""
    _, writer, state, admission = _state_with_duplicates(tmp_path, MANY)
    try:
        admission.settle()  # the start's look at every owner, and the new ones resolved
        index, looked = state.index, []
        real = index.outcome
        index.outcome = lambda loc: looked.append(loc) or real(loc)  # type: ignore[method-assign]
        with statements(index.keys) as seen:
            for step in range(10):  # a batch of 100 other jobs finishing, then a settle
                for i in range(100):
                    index.apply_succeeded((writer, 2, 32 + 1000 * step + i))
                admission.settle()
        assert looked == []  # main: MANY per settle (each pending duplicate's owner looked up)
        queries = [s for s in seen if s.startswith("SELECT")]
        assert len(queries) <= 10  # one per settle: the duplicates of what finished
        assert len(index.duplicates) == MANY
    finally:
        state.close()


# -- restarts and the saved index ----------------------------------------------------------------


def test_a_restart_from_the_saved_index_keeps_them_and_settles_them_once(tmp_path: Path) -> None:
    journal, writer, state, _ = _state_with_duplicates(tmp_path, 30)
    state.close()  # saves the index (format 4 on: no duplicates in it)
    raw = read_state(journal, SAVED_INDEX_NAME)
    assert raw is not None
    body = saved_codec.body_of_payload(raw)
    assert body["v"] >= 4
    assert "duplicates" not in body
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert state.index.duplicates.pending == 30  # counted per segment at the open
        admission = Admission(state)
        admission.settle()
        assert len(state.index.duplicates) == 30
        state.append([Entry("done", "owner", (writer, 0, 32), outcome="succeeded", at=1.0)])
        admission.settle()
        assert len(state.index.duplicates) == 0
    finally:
        state.close()
    settled = [e for _, e in read_ledger(journal) if e.kind == "done" and e.dup_of == "owner"]
    assert len(settled) == 30


def test_a_start_settles_duplicates_whose_owner_finished_before_the_saved_index(tmp_path: Path) -> None:
    """The owner's ``done`` is covered by the saved index, its duplicates' settling is not (a crash
    in between): the start's look at every owner finds it, without a replay of the ``done``."""
    journal, writer, state, _ = _state_with_duplicates(tmp_path, 5)
    state.append([Entry("done", "owner", (writer, 0, 32), outcome="failed", at=1.0)])
    state.index.duplicates.take_ended()  # as if the settle never came
    state.close()
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert len(state.index.duplicates) == 5
        Admission(state).settle()
        assert len(state.index.duplicates) == 0
        assert state.index.outcome((writer, 1, 32)) == "failed"
    finally:
        state.close()


def test_past_so_many_outcomes_noted_the_owners_are_all_looked_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long replay notes at most ENDED_MOST outcomes; past it, the next settle looks at every
    distinct owner (the owner's ``done`` was among those forgotten)."""
    _, writer, state, admission = _state_with_duplicates(tmp_path, 5)
    monkeypatch.setattr(duptable, "ENDED_MOST", 3)
    try:
        admission.settle()
        state.append([Entry("done", "owner", (writer, 0, 32), outcome="succeeded", at=1.0)])
        for i in range(5):  # jobs among the duplicates' records: noted (others are not)
            state.index.apply_succeeded((writer, 1, 33 + i))
        assert state.index.duplicates.check_all
        admission.settle()
        assert len(state.index.duplicates) == 0
        assert state.index.outcome((writer, 1, 32)) == "succeeded"
    finally:
        state.close()


def test_a_table_that_does_not_fit_the_saved_index_is_rebuilt_from_the_ledger(tmp_path: Path) -> None:
    journal, writer, state, _ = _state_with_duplicates(tmp_path, 20)
    state.close()
    path = str(Path(journal) / KEYS_TABLE_FILE)
    for suffix in ("", "-wal", "-shm"):
        Path(path + suffix).unlink(missing_ok=True)
    other = KeyTable(path)  # another table (a new id): the saved index does not vouch for it
    other.duplicates.add(Entry("duplicate", "ghost", (writer, 2, 32), key="k", dup_of="owner"))
    other.mark()
    other.close()
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert set(state.index.duplicates) == {(writer, 1, 32 + 200 * i) for i in range(20)}
    finally:
        state.close()


def as_older_format(journal: str, writer: str, **fields: object) -> None:
    """Rewrite the saved index as an older release's (``fields``: its version and the like),
    with one of the pending duplicates in it only (so it shows), its entry without ``ol``."""
    raw = read_state(journal, SAVED_INDEX_NAME)
    assert raw is not None
    body = saved_codec.body_of_payload(raw)
    dup = Entry("duplicate", "dup-0", (writer, 1, 32), key=_env("x", "k").key_id, dup_of="owner", queue="q")
    body.update(fields, duplicates=[json.loads(dup.to_bytes())])
    write_state(journal, SAVED_INDEX_NAME, json.dumps(body).encode())


def test_a_saved_index_of_format_3_loads_its_duplicates(tmp_path: Path) -> None:
    """Upgrade: the previous release saved the pending duplicates in the index; a row an
    earlier upgrade left in the table (no format 4 save vouched for it) is dropped."""
    journal, writer, state, _ = _state_with_duplicates(tmp_path, 10)
    state.close()
    as_older_format(journal, writer, v=3)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert list(state.index.duplicates) == [(writer, 1, 32)]
    finally:
        state.close()


# -- memory ----------------------------------------------------------------------------------------

#: Pending duplicates of one pending owner, and the bytes of Python memory each may cost (the
#: rows are on disk, SQLite's page cache outside tracemalloc). Measured: under 1 byte; 595 while
#: the index kept each ``duplicate`` entry in a dict.
DUPLICATES = 20_000
BOUND = 16


def test_memory_per_pending_duplicate_is_constant(tmp_path: Path) -> None:
    _, writer, state, admission = _state_with_duplicates(tmp_path, 1000)
    envs = [_env(f"dup-{i}", "k") for i in range(1000, DUPLICATES + 1000)]
    try:
        gc.collect()
        tracemalloc.start()
        try:
            for lo in range(0, DUPLICATES, 1000):
                for i in range(lo, lo + 1000):
                    assert not admission.admit(envs[i], (writer, 1, 32 + 200 * (i + 1000)))
                admission.flush()
            gc.collect()
            grown, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(state.index.duplicates) == DUPLICATES + 1000
    finally:
        state.close()
    assert grown / DUPLICATES < BOUND, f"{grown / DUPLICATES:.0f} bytes per pending duplicate"
