"""The listed failures as rows of the key table's file (``hybridq.ledger.failtable``, issue 29).

Applying ``done``/``requeued`` entries in any order lists the same failures (a success beats a
failure, a requeue mark delists it whether read before or after it), on disk as in memory; the
forwarder's list survives a restart from its saved index, a table that does not fit is rebuilt
from the ledger, a saved index of format 2 (failures in it) still loads, an SQLite error
poisons the file, and the forwarder's heap no longer grows with the failures it lists.
"""

from __future__ import annotations

import gc
import itertools
import json
import random
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import JournalIOError
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.journal.statefile import read_state, write_state
from hybridq.ledger import saved_codec
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KEYS_TABLE_FILE, KeyTable
from hybridq.ledger.saved_index import SAVED_INDEX_NAME

from tests.unit import test_ledger_replay


def _failure(loc: tuple[str, int, int], at: float = 1.0) -> Entry:
    env = Envelope(id=f"job-{loc[2]}", func="m.f", queue="q", idempotency_key=None, created_at=0.0)
    return Entry("done", env.id, loc, outcome="failed", error="boom", at=at, queue="q", job=env.to_dict())


def _story(rng: random.Random, n: int) -> tuple[list[Entry], set[tuple[str, int, int]]]:
    """Entries about ``n`` jobs of two chains, and the locs a ledger of them lists."""
    out, listed = [], set()
    for i in range(n):
        loc = (rng.choice("ab"), rng.randrange(2), 32 + 100 * i)
        what = rng.choice(["failed", "requeued", "succeeded", "both"])
        out.append(_failure(loc))
        if what in ("requeued", "both"):
            out.append(Entry("requeued", f"job-{loc[2]}", loc, at=2.0))
        if what in ("succeeded", "both"):
            out.append(Entry("done", f"job-{loc[2]}", loc, outcome="succeeded", at=3.0))
        if what == "failed":
            listed.add(loc)
    return out, listed


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("on_disk", [False, True])
def test_applying_entries_in_any_order_lists_the_same_failures(
    tmp_path: Path, seed: int, on_disk: bool
) -> None:
    rng = random.Random(seed)
    entries, expected = _story(rng, 40)

    def check(index: LedgerIndex) -> None:
        assert set(index.failed) == expected
        assert len(index.failed) == len(expected)
        assert all(index.failed.get(loc) == _failure(loc) for loc in expected)

    in_three_orders(tmp_path, rng, entries, on_disk, check)


def in_three_orders(
    tmp_path: Path,
    rng: random.Random,
    entries: list[Entry],
    on_disk: bool,
    check: Callable[[LedgerIndex], None],
) -> None:
    """Apply ``entries`` in three shuffled orders, each twice (a replay over the table changes
    nothing): ``check`` each index after each pass; the three tables are equal."""
    tables = []
    for n in range(3):
        rng.shuffle(entries)
        index = LedgerIndex(keys=KeyTable(str(tmp_path / f"{n}.sqlite") if on_disk else None))
        for _ in range(2):
            for e in entries:
                index.apply(e)
            check(index)
        tables.append(index.keys)
    assert tables[0] == tables[1] == tables[2]
    for table in tables:
        table.close()


def _at(loc: tuple[str, int, int], **fields: object) -> Entry:
    return Entry("done", f"job-{loc[2]}", loc, at=3.0, **fields)  # type: ignore[arg-type]


#: Entries about one job, and whether it is listed after them in any order: a cancel (its
#: request, then the forwarder's ``cancelled``: a failure outranks it), a duplicate failure
#: event (counted, listed once), a settled duplicate (``dup_of``: never listed itself, and a
#: success of it beats the failure). Order-dependent cases are left out (docs/reliability.md:
#: a failure and a settled duplicate's failed ``done`` of one job; which of two bodies is kept).
_ONE_JOB = {
    "cancel then failure": (["cancel", "cancelled", "failed"], True),
    "cancel, failure, requeue": (["cancel", "cancelled", "failed", "requeued"], False),
    "failure twice": (["failed", "failed dup"], True),
    "failure twice, requeue": (["failed", "failed dup", "requeued"], False),
    "failure twice, success": (["failed", "failed dup", "succeeded"], False),
    "settled duplicate": (["settled failed", "requeued"], False),
    "settled duplicate's success": (["failed", "settled succeeded"], False),
}


def _entry(name: str, loc: tuple[str, int, int]) -> Entry:
    return {
        "cancel": lambda: Entry("cancel", f"job-{loc[2]}", loc, at=0.5),
        "cancelled": lambda: _at(loc, outcome="cancelled"),
        "failed": lambda: _failure(loc),
        "failed dup": lambda: Entry(
            "done",
            f"job-{loc[2]}",
            loc,
            outcome="failed",
            dup=True,
            event_id="e2",
            error="boom",
            at=1.0,
            queue="q",
            job=_failure(loc).job,
        ),
        "succeeded": lambda: _at(loc, outcome="succeeded"),
        "settled failed": lambda: _at(loc, outcome="failed", dup_of="owner"),
        "settled succeeded": lambda: _at(loc, outcome="succeeded", dup_of="owner"),
        "requeued": lambda: Entry("requeued", f"job-{loc[2]}", loc, at=2.0),
    }[name]()


@pytest.mark.parametrize("case", sorted(_ONE_JOB))
@pytest.mark.parametrize("on_disk", [False, True])
def test_cancels_and_duplicates_in_any_order_list_the_same_failures(
    tmp_path: Path, case: str, on_disk: bool
) -> None:
    names, listed = _ONE_JOB[case]
    loc = ("a", 1, 32)
    for n, order in enumerate(itertools.permutations(names)):
        index = LedgerIndex(keys=KeyTable(str(tmp_path / f"{n}.sqlite") if on_disk else None))
        try:
            for _ in range(2):  # again: a replay over the table changes nothing
                for name in order:
                    index.apply(_entry(name, loc))
                assert (loc in index.failed, len(index.failed)) == (listed, int(listed)), order
            if listed:
                assert index.failed.job_ids() == {"job-32"}
        finally:
            index.keys.close()


def test_a_success_delists_a_failure_without_reading_it(monkeypatch: pytest.MonkeyPatch) -> None:
    index, loc = LedgerIndex(), ("a", 1, 32)
    index.apply(_failure(loc))
    monkeypatch.setattr(Entry, "from_bytes", None)  # any decode fails
    index.apply(_at(loc, outcome="succeeded"))
    assert index.apply_succeeded(loc) is False
    assert (loc not in index.failed, len(index.failed)) == (True, 0)


def _forwarder_with_failures(journal: str, writer: str, n: int) -> None:
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        state.append([_failure((writer, 1, 32 + i)) for i in range(n)])
        state.append([Entry("requeued", "job-32", (writer, 1, 32), at=2.0)])
    finally:
        state.close()  # saves the index (format 3: no failures in it), marks the table


def test_failures_are_listed_again_after_a_restart_and_not_in_the_saved_index(tmp_path: Path) -> None:
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    _forwarder_with_failures(journal, writer, 50)
    raw = read_state(journal, SAVED_INDEX_NAME)
    assert raw is not None
    body = saved_codec.body_of_payload(raw)
    assert body["v"] >= 5  # (format 5: the punched ranges too; 6: in lines)
    assert "failed" not in body
    assert "requeued" not in body
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert state.index.failed._listed == 49  # the count committed with the rows: no count query
        assert len(state.index.failed) == 49
        assert (writer, 1, 32) not in state.index.failed  # requeued
        assert state.index.failed.get((writer, 1, 33)) == _failure((writer, 1, 33))
    finally:
        state.close()


def test_a_table_that_does_not_fit_the_saved_index_is_rebuilt_from_the_ledger(tmp_path: Path) -> None:
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    _forwarder_with_failures(journal, writer, 20)
    path = str(Path(journal) / KEYS_TABLE_FILE)
    for suffix in ("", "-wal", "-shm"):
        Path(path + suffix).unlink(missing_ok=True)
    other = KeyTable(path)  # another table (a new id): the saved index does not vouch for it
    other.failures.setdefault((writer, 1, 999), _failure((writer, 1, 999)))  # not in the ledger
    other.mark()
    other.close()
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert set(state.index.failed) == {(writer, 1, 32 + i) for i in range(1, 20)}
    finally:
        state.close()


def _as_format_2(journal: str, writer: str, listed: range) -> None:
    """Rewrite the saved index as the previous release's (format 2): ``listed`` failures of
    ``writer``'s segment 1 at offsets 32 + i, and a requeue mark at 32, in the index itself."""
    raw = read_state(journal, SAVED_INDEX_NAME)
    assert raw is not None
    body = saved_codec.body_of_payload(raw)
    body.update(
        v=2,
        failed=[json.loads(_failure((writer, 1, 32 + i)).to_bytes()) for i in listed],
        requeued=[[writer, 1, 32]],
        duplicates=[],  # format 4 leaves them out (rows of the table)
    )
    write_state(journal, SAVED_INDEX_NAME, json.dumps(body).encode())


def test_a_saved_index_of_format_2_lists_its_failures(tmp_path: Path) -> None:
    """Upgrade: the previous release saved failures and requeue marks in the index (format 2)
    and its table held none. Made from this run's file here, as format 1 was last time."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    _forwarder_with_failures(journal, writer, 10)
    _as_format_2(journal, writer, range(1, 10))
    table = KeyTable(str(Path(journal) / KEYS_TABLE_FILE))
    table._db.execute("DELETE FROM failures")  # as the previous release's table: no failures
    table._db.execute("DELETE FROM meta WHERE name = 'failures_listed'")  # nor their count
    table.close()
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert set(state.index.failed) == {(writer, 1, 32 + i) for i in range(1, 10)}
        assert state.index.failed.requeued() == [(writer, 1, 32)]
    finally:
        state.close()


def test_an_upgrade_from_format_2_drops_the_rows_an_earlier_upgrade_left(tmp_path: Path) -> None:
    """An upgrade that never saved format 3 (killed; rows committed at COMMIT_ROWS or close)
    leaves rows no saved index vouches for; the previous release then ran on the file (same id
    and generation: it trusts it) and a success outranked one of those failures (job-33 here).
    The next upgrade lists the format 2 index's failures only, and counts them."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    _forwarder_with_failures(journal, writer, 10)  # the table lists 33..41: the earlier upgrade's rows
    _as_format_2(journal, writer, range(2, 10))  # what the previous release saved: job-33 succeeded
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert set(state.index.failed) == {(writer, 1, 32 + i) for i in range(2, 10)}
        assert len(state.index.failed) == 8
        assert state.index.failed.requeued() == [(writer, 1, 32)]
    finally:
        state.close()


def test_a_reader_that_knows_only_format_2_replays_a_format_3_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A downgrade: the previous release reads only format 2 (``v != 2``: a ``ValueError``),
    so it ignores a format 3 file (no failures in it) and replays the whole ledger: nothing lost."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    _forwarder_with_failures(journal, writer, 10)
    monkeypatch.setattr(saved_codec, "READ_VERSIONS", (2,))
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        assert "ignoring the saved ledger index" in caplog.text
        assert set(state.index.failed) == {(writer, 1, 32 + i) for i in range(1, 10)}
        assert state.index.failed.requeued() == [(writer, 1, 32)]
    finally:
        state.close()


def test_an_sqlite_error_listing_a_failure_poisons_the_file(tmp_path: Path) -> None:
    table = KeyTable(str(tmp_path / KEYS_TABLE_FILE))
    index = LedgerIndex(keys=table)
    table._db.close()  # any SQLite error will do
    with pytest.raises(JournalIOError):
        index.apply(_failure(("w", 0, 32)))
    assert table.failed
    with pytest.raises(JournalIOError):
        table.mark()  # no saved index may vouch for it this run


#: Failed jobs listed, and the bytes of Python memory each may cost in the ledger index (the
#: forwarder's other caches of recently finished jobs, pruned by age, are a cost of every
#: terminal job, not of failures). Measured: 6 (the rows are on disk); 926 while the index kept
#: each ``done`` entry with its envelope.
FAILED_JOBS = 20_000
BOUND = 16


def test_memory_per_failed_job_is_constant(tmp_path: Path) -> None:
    index = LedgerIndex(keys=KeyTable.in_journal(str(tmp_path)))

    def fail(start: int, stop: int) -> None:
        for i in range(start, stop):  # built here, as harvest builds it; its JSON as appended
            entry = _failure(("w", i // 1000, 32 + 200 * (i % 1000)))
            index.apply(entry, entry.to_bytes())

    try:
        fail(0, 1000)  # the table and its caches exist before the count starts
        gc.collect()
        tracemalloc.start()
        try:
            fail(1000, FAILED_JOBS + 1000)
            index.keys.commit()
            gc.collect()
            grown, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(index.failed) == FAILED_JOBS + 1000
    finally:
        index.keys.close()
    assert grown / FAILED_JOBS < BOUND, f"{grown / FAILED_JOBS:.0f} bytes per failed job"
