"""The key table (``hybridq.ledger.keytable``): the owners of idempotency keys, on disk (issue 29).

A derived cache of the ledger's ``key`` entries: applying them in any order gives the same table
(the newest by ``(at, loc, until)`` owns each key), keys past their window are forgotten (the
oldest beyond the bound), a saved index trusts only the table it was saved with, at its
generation or later, and a table missing or damaged is made again by a full replay. The
forwarder's memory per pending keyed job is O(1): its owner is a row, not an ``Entry``.
"""

from __future__ import annotations

import gc
import os
import random
import tracemalloc
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.ledger import saved_codec
from hybridq.ledger.entries import Entry
from hybridq.ledger.keytable import KEYS_TABLE_FILE, KeyTable

from tests.unit import test_ledger_replay


def _key_entries(rng: random.Random, n: int) -> list[Entry]:
    out = []
    for i in range(n):
        until = rng.choice([None, None, float(rng.randrange(100, 110))])
        out.append(
            Entry(
                "key",
                f"job-{i}",
                (rng.choice("ab"), rng.randrange(3), 32 + rng.randrange(4) * 100),
                key=f"k{rng.randrange(6)}",
                at=float(rng.randrange(5)),
                until=until,
                outcome="succeeded" if until is not None else None,
                queue="q",
            )
        )
    return out


def _newest(entries: list[Entry]) -> dict[str, Entry]:
    best: dict[str, Entry] = {}
    for e in entries:
        assert e.key is not None
        known = best.get(e.key)
        if known is None or (e.at, e.loc, e.until or 0.0) > (known.at, known.loc, known.until or 0.0):
            best[e.key] = e
    return best


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("on_disk", [False, True])
def test_applying_key_entries_in_any_order_gives_the_newest_owner_of_each(
    tmp_path: Path, seed: int, on_disk: bool
) -> None:
    rng = random.Random(seed)
    entries = _key_entries(rng, 60)
    expected = _newest(entries)
    for n in range(3):
        rng.shuffle(entries)
        table = KeyTable(str(tmp_path / f"{n}.sqlite") if on_disk else None)
        for e in entries:
            table.own(e)
        table.commit()
        assert dict(table.items()) == expected
        for e in entries:  # again: a replay over the table changes nothing
            table.own(e)
        assert dict(table.items()) == expected
        assert table == expected
        table.close()


def test_forgetting_drops_expired_keys_then_the_oldest_beyond_the_bound() -> None:
    table = KeyTable()
    pending = Entry("key", "p", ("a", 0, 32), key="pending", at=1.0)
    table.own(pending)
    for i in range(10):
        table.own(Entry("key", f"j{i}", ("a", 1, 32 + i), key=f"w{i}", at=1.0, until=100.0 + i))
    assert table.forget_expired(now=103.0) == 3  # w0, w1, w2: their window ended
    assert table.forget_expired(now=103.0, most=4) == 3  # w3, w4, w5: the oldest beyond 4
    assert sorted(k for k, _ in table.items()) == ["pending", "w6", "w7", "w8", "w9"]
    assert table.get("pending") == pending  # no window: never forgotten
    assert table.windowed() == 4


def test_a_saved_generation_is_trusted_by_its_table_only_at_it_or_later(tmp_path: Path) -> None:
    path = str(tmp_path / KEYS_TABLE_FILE)
    table = KeyTable(path)
    table.own(Entry("key", "a", ("w", 0, 32), key="k", at=1.0))
    table_id, gen = table.mark()
    assert table.trusts(table_id, gen)
    table.mark()  # marked again, its saved index not written (a crash): still holds everything
    table.close()
    again = KeyTable(path)
    assert again.trusts(table_id, gen)
    assert not again.trusts(table_id, gen + 5)  # a save it never reached
    assert not again.trusts("another", gen)
    assert again.get("k") is not None
    again.clear()  # a full replay follows: nothing saved before vouches for it
    assert not again.trusts(table_id, 0)
    assert len(again) == 0
    again.close()
    assert not KeyTable().trusts("", 0)  # in memory: never vouched for


@pytest.mark.parametrize("damage", ["deleted", "garbage", "flipped"])
def test_a_damaged_or_missing_table_is_made_again_and_the_ledger_replayed(
    tmp_path: Path, damage: str
) -> None:
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    keys = [
        Envelope(id=f"j{i}", func="m.f", queue="q", idempotency_key=f"k{i}", created_at=0.0) for i in range(3)
    ]
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    admission = Admission(state)
    for i, env in enumerate(keys):
        assert admission.admit(env, (writer, i, 32))
    admission.flush()
    state.close()  # saves the index, marks the table
    path = Path(journal) / KEYS_TABLE_FILE
    if damage == "deleted":
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(str(path) + suffix):
                os.unlink(str(path) + suffix)
    elif damage == "garbage":
        for suffix in ("-wal", "-shm"):
            if os.path.exists(str(path) + suffix):
                os.unlink(str(path) + suffix)
        path.write_bytes(b"not a database at all" * 300)
    else:
        raw = bytearray(path.read_bytes())
        for at in range(100, len(raw), 97):
            raw[at] ^= 0x5A
        path.write_bytes(bytes(raw))
    fresh = ForwarderState(journal, ForwarderConfig())
    fresh.load()
    try:
        for i, env in enumerate(keys):
            owner = fresh.index.keys.get(env.key_id)
            assert owner is not None, damage
            assert owner.loc == (writer, i, 32)
        again = Envelope(id="new", func="m.f", queue="q", idempotency_key="k1", created_at=0.0)
        assert not Admission(fresh).admit(again, (writer, 2, 999))  # a duplicate: never pushed
    finally:
        fresh.close()


#: Admitted keyed jobs, and the bytes of Python memory each may cost (the table's rows are on
#: disk, its page cache bounded by SQLite's cache_size, outside tracemalloc). Measured: under
#: half a byte; 439 while the index kept an Entry per key.
KEYED_JOBS = 20_000
BOUND = 8


def test_memory_per_pending_keyed_job_is_constant(tmp_path: Path) -> None:
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    admission = Admission(state)
    envs = [
        Envelope(id=f"job-{i}", func="m.f", queue="q", idempotency_key=f"key-{i}", created_at=0.0)
        for i in range(KEYED_JOBS + 1000)
    ]

    def admit(start: int, stop: int) -> None:
        for lo in range(start, stop, 1000):  # a step of 1,000 records, one flush
            for i in range(lo, lo + 1000):
                assert admission.admit(envs[i], (writer, 1, 32 + 200 * i))
            admission.flush()

    try:
        admit(0, 1000)  # the table, the writer and their caches exist before the count starts
        gc.collect()
        tracemalloc.start()
        try:
            admit(1000, KEYED_JOBS + 1000)
            gc.collect()
            grown, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(state.index.keys) == KEYED_JOBS + 1000
        dup = Envelope(id="dup", func="m.f", queue="q", idempotency_key="key-7", created_at=0.0)
        assert not admission.admit(dup, (writer, 2, 32))
    finally:
        state.close()
    assert grown / KEYED_JOBS < BOUND, f"{grown / KEYED_JOBS:.0f} bytes per pending keyed job"


def test_an_sqlite_error_is_a_journal_io_error_that_stops_the_forwarder(tmp_path: Path) -> None:
    """Not a disk-full pause: a failed statement may have rolled the run's rows back."""
    import errno

    from hybridq.errors import JournalIOError

    table = KeyTable(str(tmp_path / KEYS_TABLE_FILE))
    table._db.close()  # any SQLite error will do
    with pytest.raises(JournalIOError) as raised:
        table.own(Entry("key", "a", ("w", 0, 32), key="k", at=1.0))
    assert raised.value.errno == errno.EIO
    with pytest.raises(JournalIOError):
        table.get("k")


def test_settle_reads_each_pending_duplicates_owner_from_the_table_once(tmp_path: Path) -> None:
    """Not a query per pending duplicate on every delivered batch (fails before: 3 per settle)."""
    from hybridq.ledger.entries import Entry as LedgerEntry
    from hybridq.protocol import EntryKind

    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    try:
        admission = Admission(state)
        for i in range(3):
            assert admission.admit(_env(f"o{i}", f"k{i}"), (writer, 1, 32 + i))
        admission.flush()
        for i in range(3):
            assert not admission.admit(_env(f"d{i}", f"k{i}"), (writer, 2, 32 + i))
        admission.flush()  # settles once: the owners read
        reads = []
        real_get = state.index.keys.get
        state.index.keys.get = lambda key: reads.append(key) or real_get(key)  # type: ignore[method-assign]
        admission.settle()
        admission.settle()
        assert reads == []
        assert len(state.index.duplicates) == 3
        state.append([LedgerEntry(EntryKind.DONE, "o1", (writer, 1, 33), outcome="failed", at=1.0)])
        admission.settle()
        assert reads == []
        assert sorted(loc[2] for loc in state.index.duplicates) == [32, 34]
        assert state.index.outcome((writer, 2, 33)) == "failed"
    finally:
        state.close()


def loaded_with_one_keyed_job(tmp_path: Path) -> tuple[str, ForwarderState]:
    """A forwarder's state, loaded, that admitted one job with key ``k`` (its ledger entry written)."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    admission = Admission(state)
    assert admission.admit(_env("j", "k"), (writer, 0, 32))
    admission.flush()
    return journal, state


def _env(job_id: str, key: str) -> Envelope:
    return Envelope(id=job_id, func="m.f", queue="q", idempotency_key=key, created_at=0.0)


def test_a_symlinked_table_is_refused_not_written_through(tmp_path: Path) -> None:
    """As every journal file (O_NOFOLLOW): fails before, a row lands in the link's target."""
    import errno

    elsewhere = tmp_path / "elsewhere.sqlite"
    KeyTable(str(elsewhere)).close()
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / KEYS_TABLE_FILE).symlink_to(elsewhere)
    with pytest.raises(OSError) as raised:
        KeyTable.in_journal(str(journal))
    assert raised.value.errno == errno.ELOOP
    assert len(KeyTable(str(elsewhere))) == 0


def test_a_locked_table_is_an_io_error_not_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Locked, read-only, unable to open: the file is kept (fails before: unlinked as damaged)."""
    import sqlite3

    from hybridq.errors import JournalIOError

    path = tmp_path / KEYS_TABLE_FILE
    table = KeyTable(str(path))
    table.own(Entry("key", "a", ("w", 0, 32), key="k", at=1.0))
    table.close()

    def locked(self: KeyTable) -> sqlite3.Connection:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(KeyTable, "_connect", locked)
    with pytest.raises(JournalIOError):
        KeyTable(str(path))
    monkeypatch.undo()
    assert KeyTable(str(path)).get("k") is not None


def test_an_error_writing_a_bulk_is_a_journal_io_error_and_ends_the_bulk() -> None:
    """Fails before: a raw sqlite3 error, and later rows only buffered."""
    from hybridq.errors import JournalIOError

    table = KeyTable()

    def a_bulk_on_a_closed_connection() -> None:
        with table.bulk():
            table.own(Entry("key", "a", ("w", 0, 32), key="k", at=1.0))
            table._db.close()

    with pytest.raises(JournalIOError):
        a_bulk_on_a_closed_connection()
    assert table._bulk is None
    assert table.failed


def test_readers_that_never_look_at_key_owners_load_none(tmp_path: Path) -> None:
    from hybridq.ledger.compacted import Compacted
    from hybridq.ledger.keytable import UnreadKeys
    from hybridq.ledger.store import load_index

    journal, state = loaded_with_one_keyed_job(tmp_path)
    state.close()
    assert len(load_index(journal, Compacted()).keys) == 1
    unread = load_index(journal, Compacted(), keys=False).keys
    assert isinstance(unread, UnreadKeys)
    assert len(unread) == 0
    with pytest.raises(RuntimeError):
        unread.get("k")


def test_a_table_ahead_of_a_restored_ledger_is_rebuilt(tmp_path: Path) -> None:
    """The journal restored from a backup without the table: its owners of jobs the restored
    ledger does not have are not trusted (fails before: k1 stays owned by a job that is gone)."""
    import shutil

    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    for i, backup in enumerate([True, False]):
        state = ForwarderState(journal, ForwarderConfig())
        state.load()
        admission = Admission(state)
        assert admission.admit(_env(f"j{i}", f"k{i}"), (writer, i, 32))
        admission.flush()
        state.close()
        if backup:
            shutil.copytree(
                journal, tmp_path / "backup", ignore=shutil.ignore_patterns(KEYS_TABLE_FILE + "*")
            )
    table = [name for name in os.listdir(journal) if name.startswith(KEYS_TABLE_FILE)]
    for name in os.listdir(journal):
        if name not in table:
            path = os.path.join(journal, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    shutil.copytree(tmp_path / "backup", journal, dirs_exist_ok=True)
    restored = ForwarderState(journal, ForwarderConfig())
    restored.load()
    try:
        assert restored.index.keys.get(_env("j0", "k0").key_id) is not None
        assert restored.index.keys.get(_env("j1", "k1").key_id) is None
    finally:
        restored.close()


def test_a_journal_of_the_version_before_the_table_keeps_its_owners(tmp_path: Path) -> None:
    """Upgrade: a saved index of format 1 (the owners in it) and no table file, as the previous
    release leaves them: the file is ignored, the ledger replayed into a new table, and a second
    job with the key is a duplicate. (Format 1 is made from this run's file here; checked
    against the previous release's own code in the review of issue 29.)"""
    import json

    from hybridq import Queue
    from hybridq.journal.statefile import read_state, write_state
    from hybridq.ledger.saved_index import SAVED_INDEX_NAME
    from hybridq.ledger.store import read_ledger
    from hybridq.transport import MemoryTransport

    from tests.unit.test_completions import make_forwarder, settle

    journal = tmp_path / "j"
    Queue(journal=journal).enqueue("tests.tasks.add", 1, 2, idempotency_key="K", job_id="first")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal, transport)
    settle(forwarder)
    forwarder.close()
    raw = read_state(str(journal), SAVED_INDEX_NAME)
    assert raw is not None
    body = saved_codec.body_of_payload(raw)
    owners = [json.loads(e.to_bytes()) for _, e in read_ledger(str(journal)) if e.kind == "key"]
    body.update(v=1, keys=owners)
    del body["keys_table"]
    write_state(str(journal), SAVED_INDEX_NAME, json.dumps(body).encode())
    for name in os.listdir(journal):
        if name.startswith(KEYS_TABLE_FILE):
            os.unlink(journal / name)
    forwarder = make_forwarder(journal, transport)
    try:
        Queue(journal=journal).enqueue("tests.tasks.add", 1, 2, idempotency_key="K", job_id="again")
        settle(forwarder)
        assert "again" not in transport.deliveries
    finally:
        forwarder.close()
    assert "again" in {e.job_id for _, e in read_ledger(str(journal)) if e.kind == "duplicate"}
