"""The saved ledger index: a start that resumes from it gets exactly the index a full replay gets.

``hybridq.ledger.saved_index`` (issue 29): the forwarder saves its index with what it covers; a
start loads it and replays only the ledger records past it. Over random ledgers of every kind of
entry, in several chains, saved at a random point, with more appended and compacted after, the
index must equal ``load_index``'s. A saved index that is damaged, or that no longer describes
the ledger (a chain shortened under it, compaction it assumed undone) is ignored, never trusted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
from hybridq.errors import JournalCorruption
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.journal.fileops import FileOps
from hybridq.journal.format import FILE_HEADER_SIZE, segment_name
from hybridq.journal.reader import list_chains
from hybridq.ledger import saved_codec, saved_index
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import ledger_dir, load_index, open_ledger_writer, replay
from hybridq.ops.journal_repair import repair

from tests.support.writers import small_segments
from tests.unit import test_ledger_replay


def entries(rng: random.Random, writer: str, n: int) -> list[Entry]:
    """test_ledger_replay's random entries, but no ``invalid`` outcome.

    ``invalid`` is recorded only for a record that is not a job (it never runs), and it ranks
    with nothing: which of it and another outcome of the same job is read first wins, and a
    resumed replay reads the chains' records in another order than a full one.
    Only ``done`` entries are duplicates here, as only a run's outcome is: an event id seen first
    on another kind would hide a duplicate outcome from the count, in one order and not another.
    """
    out = test_ledger_replay.entries(rng, writer, n)
    return [
        e if e.kind == "done" else dataclasses.replace(e, dup=False) for e in out if e.outcome != "invalid"
    ]


def save_now(journal: str, compacted: Compacted) -> LedgerIndex:
    """Replay the ledger as it is and save the result, covering what was read.

    Into the journal's key table, as the forwarder does: a saved index vouches for that table.
    """
    index = LedgerIndex(keys=KeyTable.in_journal(journal))
    covered = replay(journal, index, compacted)
    saved_index.save(journal, index, covered, compacted.through)
    return index


@pytest.mark.parametrize("seed", range(16))
def test_resuming_from_a_saved_index_gives_the_full_replay(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    chains = [open_ledger_writer(journal) for _ in range(2)]
    for chain in chains:
        chain.max_segment_bytes = 2048  # several ledger segments per chain
    for chain in chains:
        chain.append_many(e.to_bytes() for e in entries(rng, writer, rng.randrange(1, 150)))
    before = Compacted(through={writer: 0}) if seed % 3 == 0 else Compacted()
    save_now(journal, before)
    # More in the same chains, in a chain the save never saw, and compaction after the save.
    for chain in chains:
        chain.append_many(e.to_bytes() for e in entries(rng, writer, rng.randrange(0, 150)))
    late = open_ledger_writer(journal)
    late.append_many(e.to_bytes() for e in entries(rng, "gone-writer", 20))
    for chain in [*chains, late]:
        chain.close()
    after = Compacted(through={writer: 1}) if seed % 2 else before
    index, _, resumed = saved_index.resume(journal, after, KeyTable.in_journal(journal))
    assert resumed == 2
    full = load_index(journal, after)
    if after != before:
        # Of a segment compacted after the save, the full replay lists every failure recorded;
        # the saved index (as the forwarder that saved it did) not one a success outranked since.
        # Compaction never deletes a segment with a job not terminal: no such ledger is real.
        # Nor does a ``key`` entry carry a duplicate's event id (the random ones here may).
        assert set(index.failed) <= set(full.failed)
        for listed in (index.failed, full.failed):
            for loc in [loc for loc in listed if loc[1] <= 1]:
                listed.delist(loc)
        index.dup_events = {seg: ids for seg, ids in index.dup_events.items() if seg[1] > 1}
        full.dup_events = {seg: ids for seg, ids in full.dup_events.items() if seg[1] > 1}
    # Of a job that failed twice, which failure is listed depends on the order the chains are
    # read in (the first read wins), as it does in a full replay: the same jobs are listed.
    assert set(index.failed) == set(full.failed)
    for listed in (index.failed, full.failed):
        for loc in list(listed):
            listed.delist(loc)
    assert index == full


def corrupt_bytes(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["flipped", "garbage", "truncated", "compaction undone", "chain gone"])
def test_a_saved_index_that_does_not_describe_the_ledger_is_ignored(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(3)
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    chain = open_ledger_writer(journal)
    chain.append_many(e.to_bytes() for e in entries(rng, writer, 200))
    chain.close()
    compacted = Compacted(through={writer: 0})
    saved = save_now(journal, compacted)
    state = Path(journal) / "ledger-index.state"
    if damage == "flipped":
        corrupt_bytes(state)
    elif damage == "garbage":
        saved_index.save(journal, saved, {}, {})
        raw = state.read_bytes()
        assert f'"v":{saved_codec.VERSION}'.encode() in raw
        state.write_bytes(raw.replace(f'"v":{saved_codec.VERSION}'.encode(), b'"v":9'))
    elif damage == "truncated":  # the ledger lost its tail under the saved position
        [(ledger_chain, [segment])] = list_chains(ledger_dir(journal)).items()
        seg = Path(ledger_dir(journal)) / segment_name(ledger_chain, segment)
        os.truncate(seg, seg.stat().st_size // 2)
    elif damage == "chain gone":  # the ledger it covered deleted (by hand): not a full replay's
        [(ledger_chain, [segment])] = list_chains(ledger_dir(journal)).items()
        os.unlink(Path(ledger_dir(journal)) / segment_name(ledger_chain, segment))
    else:  # saved under a compaction that the state on disk does not have
        saved_index.save(journal, saved, {}, {writer: 1})
    fresh = Compacted() if damage == "compaction undone" else compacted
    if damage == "truncated":  # not trusted: the full replay reports the damage, as without it
        with pytest.raises(JournalCorruption):
            saved_index.resume(journal, fresh, KeyTable.in_journal(journal))
        assert "does not reach its position" in caplog.text
        return
    index, _, resumed = saved_index.resume(journal, fresh, KeyTable.in_journal(journal))
    assert resumed == 0
    assert index == load_index(journal, fresh)
    assert "ignoring the saved ledger index" in caplog.text


def test_the_forwarder_saves_its_index_at_a_stop_and_the_next_start_resumes_from_it(tmp_path: Path) -> None:
    rng = random.Random(11)
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    config = ForwarderConfig()
    first = ForwarderState(journal, config)
    first.load()
    done = [e for e in entries(rng, writer, 300) if e.kind != "requeued"]
    for at in range(0, len(done), 25):
        first.append(done[at : at + 25])
    first.close()
    second = ForwarderState(journal, config)
    second.load()
    try:
        assert second.index == load_index(journal, Compacted())
        assert second.index.terminal_count > 0
        _, _, resumed = saved_index.resume(journal, Compacted(), KeyTable.in_journal(journal))
        assert resumed == 1
    finally:
        second.close()


def test_an_append_not_folded_in_stops_the_saves_of_that_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its records may be durable and missing from the index: a save would claim to cover them."""
    monkeypatch.setattr(saved_index, "SAVE_EVERY", 1)
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    state.append([Entry("done", "a", (writer, 0, 32), outcome="succeeded")])
    state.refresh_snapshot()  # the end of a step: saved (one entry is due here)
    state.on_append = lambda *_: (_ for _ in ()).throw(RuntimeError("lookup index"))
    with pytest.raises(RuntimeError):
        state.append([Entry("done", "b", (writer, 1, 32), outcome="succeeded")])
    state.on_append = None
    state.append([Entry("done", "c", (writer, 2, 32), outcome="succeeded")])
    state.refresh_snapshot()
    state.close()
    saved = saved_index.load(journal)
    assert saved is not None
    assert saved.index.is_terminal((writer, 0, 32))
    assert not saved.index.is_terminal((writer, 2, 32))  # the save after the failure never came
    fresh = ForwarderState(journal, ForwarderConfig())
    fresh.load()
    try:
        assert all(fresh.index.is_terminal((writer, s, 32)) for s in range(3))
    finally:
        fresh.close()


def test_a_repair_of_the_ledger_that_may_drop_records_forgets_the_saved_index(tmp_path: Path) -> None:
    rng = random.Random(5)
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    chain = open_ledger_writer(journal)
    chain.append_many(e.to_bytes() for e in entries(rng, writer, 50))
    chain.close()
    save_now(journal, Compacted())
    repair(ledger_dir(journal), accept_loss=False)  # a dry run changes nothing
    assert saved_index.load(journal) is not None
    calls: list[tuple[str, str]] = []

    class Calls(FileOps):
        def unlink(self, path: str) -> None:
            calls.append(("unlink", path))
            super().unlink(path)

        def fsync_dir(self, path: str) -> None:
            calls.append(("fsync_dir", path))
            super().fsync_dir(path)

    repair(ledger_dir(journal), accept_loss=True, fileops=Calls())
    assert saved_index.load(journal) is None
    # Through the seam, durable (its directory fsynced) before the repair changes the ledger.
    state = os.path.join(journal, saved_index.SAVED_INDEX_NAME + ".state")
    assert calls[:2] == [("unlink", state), ("fsync_dir", journal)]


def test_a_saved_position_past_a_segment_a_repair_sealed_again_does_not_fit(tmp_path: Path) -> None:
    """A saved index the forget did not remove (a power cut brought it back) is not trusted: a
    position "all of segment 1 read" no longer fits once a repair cut segment 1 and sealed it again,
    nor does a position inside the records the repair dropped."""
    from hybridq.journal import ChainPosition, JournalReader

    journal = tmp_path / "journal"
    ldir = Path(ledger_dir(str(journal)))
    recs = small_segments(ldir)
    writer = recs[0].writer_id
    seg1 = [r for r in recs if r.segment_index == 1]
    damaged = seg1[len(seg1) // 2]
    past_seg1 = ChainPosition(2, FILE_HEADER_SIZE, next(r.seq for r in recs if r.segment_index == 2))
    in_seg1 = ChainPosition(1, damaged.end, damaged.seq + 1)  # the damaged record read
    for at in (past_seg1, in_seg1):
        assert saved_index._fits(str(journal), {writer: at}, {writer: 0}) is not None
    path = ldir / segment_name(writer, 1)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.seek(damaged.offset + 20)
        f.write(b"\xff\xff")
    os.chmod(path, 0o400)
    assert repair(str(ldir), accept_loss=True).applied
    assert max(r.segment_index for r in JournalReader(ldir).records()) == 1
    for at in (past_seg1, in_seg1):
        assert saved_index._fits(str(journal), {writer: at}, {writer: 0}) is None, at


def _ghost_key_run(journal: str, n: int) -> None:
    """Run ``n`` of the ghost key's test, in a child ending with ``os._exit`` (a kill -9: no save)."""
    from hybridq.envelope.model import Envelope
    from hybridq.forwarder.admission import Admission
    from hybridq.forwarder.dead_segments import Compactor
    from hybridq.journal import ChainPosition, JournalReader

    recs = [(r.writer_id, r.segment_index, r.offset) for r in JournalReader(journal).records()]
    window = 100.0
    key = Envelope(id="x", func="m.f", queue="q", idempotency_key="k", created_at=0.0).key_id
    now = 1000.0 + {1: 0, 2: 10, 3: 20}[n] * window
    s = ForwarderState(journal, ForwarderConfig(key_window_s=window, clock=lambda: now))
    s.load()
    ok = True
    if n == 1:
        s._writer = open_ledger_writer(journal)
        s._writer.max_segment_bytes = 600
        s.append(
            [
                Entry("key", "job-A", recs[0], key=key, at=now),
                Entry("done", "job-A", recs[0], outcome="succeeded", at=now),
            ]
        )
        s._saver.save(s.index, s.compacted)  # a periodic save
        s.append([Entry("retry", "job-B", recs[1], attempt=1, run_at=5000.0, at=now + 1)] * 3)  # rotates
        s.checkpoint.positions[recs[0][0]] = ChainPosition(2, 32, 3)  # journal segments 0 and 1 read
        Compactor(s).compact()  # k's ledger segment goes; k is in the key store, with its window
    elif n == 2:  # k's window is over: forgotten; the key store's segment with k goes too
        ok = key not in s.index.keys
        Compactor(s).compact()
    else:
        env = Envelope(id="job-C", func="m.f", queue="q", idempotency_key="k", created_at=now)
        ok = key not in s.index.keys and Admission(s).admit(env, recs[-1])
    os._exit(0 if ok else 1)


def test_a_key_compacted_into_the_key_store_and_expired_there_does_not_come_back_from_a_saved_index(
    tmp_path: Path,
) -> None:
    """A save holds key k (no window, from the ledger); compaction then moves k to the key store
    (with a window) and deletes its ledger segment; a later run forgets k (window over) and
    compacts the key store; each run ends without a save (kill -9). The next start must not get
    k back from the old save: a new job with key k would be settled as a duplicate, never run.
    """
    import multiprocessing

    from hybridq.journal import JournalWriter

    journal = str(tmp_path / "journal")
    with JournalWriter(journal, max_segment_bytes=4096) as jw:
        for _ in range(3):
            jw.append_many([b'{"x": "' + b"y" * 3000 + b'"}'])
    for n in (1, 2, 3):
        child = multiprocessing.get_context("fork").Process(target=_ghost_key_run, args=(journal, n))
        child.start()
        child.join()
        assert child.exitcode == 0, f"run {n}"


@pytest.mark.parametrize(
    "terminal", ['[["w",0,{"succeeded":[1e999]}]]', "[" * 100_000 + "]" * 100_000, '[["w",0,[1]]]']
)
def test_a_malformed_saved_index_is_ignored_not_raised(tmp_path: Path, terminal: str) -> None:
    """A checksummed file whose content is out of range or absurdly nested: a full replay."""
    from hybridq.journal.statefile import write_state

    fields = ["covered", "first", "through", "dups", "dup_events", "retries", "lost", "later", "requeued"]
    rest = ",".join(f'"{name}":{{}}' if name in fields[:3] else f'"{name}":[]' for name in fields)
    body = (
        '{"v":2,' + rest + ',"terminal":' + terminal + ',"failed":[],"keys_table":["",0],"duplicates":[],'
        '"cancels":[]}'
    )
    write_state(str(tmp_path), saved_index.SAVED_INDEX_NAME, body.encode())
    assert saved_index.load(str(tmp_path)) is None


def test_groups_whose_names_read_back_the_same_are_all_kept() -> None:
    """A missing outcome name reads back as ``failed``: a file (not one encode writes) with both
    lists keeps the offsets of both, as applying each group in turn did."""
    body = {
        "v": 2,
        "keys_table": ["", 0],
        **{k: {} for k in ("covered", "through", "first")},
        "terminal": [["w", 0, {"": [4096, 4396], "failed": [4696]}]],
        **{k: [] for k in ("dups", "dup_events", "retries", "lost", "later", "requeued", "failed")},
        **{k: [] for k in ("duplicates", "cancels")},
    }
    index = saved_index.decode(json.dumps(body).encode()).index
    assert dict(index.terminal["w", 0].items()) == {4096: "failed", 4396: "failed", 4696: "failed"}
    assert index.terminal_count == 3
    assert index.totals["failed"] == 3
    assert all(index.is_terminal(("w", 0, offset)) for offset in (4096, 4396, 4696))
