"""The saved ledger index written and read one segment at a time (format 6; issue 29).

A save and a load of the index held the whole of it in memory (its JSON, the payload's bytes,
the parsed lists), past the forwarder's cap on the offsets it holds (``index_offsets_max``):
O(all finished jobs of the live journal) at each save and at each start. Now each is about one
segment's, and a replay past the cap spills as it goes.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq.errors import JournalIOError, StateFileCorrupt
from hybridq.journal import statefile
from hybridq.journal.fileops import OS_FILEOPS, FileOps
from hybridq.journal.format import crc32c
from hybridq.journal.statefile import _crc32c_combine, open_state, read_state, write_state, write_state_pieces
from hybridq.ledger import saved_codec, saved_index, store
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.outcomes import SegmentOutcomes
from hybridq.ledger.store import open_ledger_writer

from tests.unit import test_ledger_replay

#: 500,000 jobs (a few seconds under tracemalloc); docs/benchmarks.md has 2,000,000 under 100,000.
SEGMENTS, PER_SEGMENT, CAP = 20, 25_000, 25_000


def big_index(segments: int = SEGMENTS, jobs: int = PER_SEGMENT) -> LedgerIndex:
    """``segments`` journal segments of ``jobs`` succeeded jobs each, a failure and a range in one."""
    index = LedgerIndex()
    for s in range(segments):
        index.terminal["chain", s] = SegmentOutcomes.from_groups(
            {"succeeded": range(4096, 4096 + 330 * jobs, 330)}
        )
        index.terminal_count += jobs
        index.totals["succeeded"] += jobs
    index.apply(Entry("done", "j", ("chain", 1, 4096 + 330 * jobs), outcome="failed", at=1.0))
    index.collapse(("chain", 2), [(4096 + 330 * jobs, 4096 + 330 * (jobs + 10), 10)])
    return index


def test_crc_combine_is_the_crc_of_the_whole() -> None:
    for a, b in [
        (b"head", b"payload" * 1000),
        (b"", b"x"),
        (b"abc", b""),
        (bytes(16), bytes(range(256)) * 99),
    ]:
        assert _crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_a_state_file_written_in_pieces_is_the_one_written_whole(tmp_path: Path) -> None:
    pieces = [b"one ", b"", b"two" * 100_000, b"\nthree"]
    assert write_state_pieces(str(tmp_path), "p", iter(pieces)) == len(b"".join(pieces))
    write_state(str(tmp_path), "w", b"".join(pieces))
    assert (tmp_path / "p.state").read_bytes() == (tmp_path / "w.state").read_bytes()
    assert read_state(str(tmp_path), "p") == b"".join(pieces)
    state = open_state(str(tmp_path), "p")
    assert state is not None
    with state:
        assert b"".join(state.chunks()) == b"".join(pieces)
    assert open_state(str(tmp_path), "missing") is None


class _FullDisk(FileOps):
    """ENOSPC from the third write on."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, fd: int, data: bytes | memoryview) -> int:
        self.writes += 1
        if self.writes >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(fd, data)


@pytest.mark.parametrize("fault", ["over the limit", "ENOSPC", "a piece's error"])
def test_a_save_that_fails_leaves_the_old_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The old file stays whole, and the temp file (up to 64 MiB written) does not stay."""
    write_state(str(tmp_path), "p", b"old")
    monkeypatch.setattr(statefile, "MAX_STATE_BYTES", 100)

    def pieces() -> Iterator[bytes]:
        yield b"x" * 60
        if fault == "a piece's error":
            raise RuntimeError("encoding")
        yield b"y" * 60 if fault == "over the limit" else b"y"

    raised = {"over the limit": ValueError, "ENOSPC": JournalIOError, "a piece's error": RuntimeError}[fault]
    with pytest.raises(raised):
        write_state_pieces(
            str(tmp_path), "p", pieces(), fileops=_FullDisk() if fault == "ENOSPC" else OS_FILEOPS
        )
    assert read_state(str(tmp_path), "p") == b"old"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["p.state"]


@pytest.mark.parametrize("where", ["header", "segment", "length"])
def test_a_damaged_piece_is_refused_as_the_whole_file_was(tmp_path: Path, where: str) -> None:
    """Never read as missing, nor in part (docs/reliability.md rule 12): the checksum of the whole
    file is checked before any piece is read; the saved index is ignored (a full replay)."""
    index = big_index(3, 1000)
    saved_index.save(str(tmp_path), index, {}, {})
    path = tmp_path / (saved_index.SAVED_INDEX_NAME + ".state")
    raw = bytearray(path.read_bytes())
    if where == "length":
        raw = raw[:-5]
    else:
        at = raw.index(b'["chain",1,') if where == "segment" else raw.index(b'"v":')
        raw[at + 3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(StateFileCorrupt):
        open_state(str(tmp_path), saved_index.SAVED_INDEX_NAME)
    assert saved_index.load(str(tmp_path)) is None


def test_the_new_format_round_trips_spilled_segments_and_the_old_one_still_reads(tmp_path: Path) -> None:
    plain, capped = big_index(6, 5000), big_index(6, 5000)
    capped.spill_past(str(tmp_path), 5000)
    assert sum(done.spilled for done in capped.terminal.values()) >= 3
    raw = saved_codec.encode(capped, {}, {"chain": 0}, {"chain": 1}, ("t", 3))
    assert raw == saved_codec.encode(plain, {}, {"chain": 0}, {"chain": 1}, ("t", 3))  # spilled read back
    assert raw.count(b"\n") == 1 + 6  # a header, a line per segment
    for cap in (None, 5000):
        journal = tmp_path / str(cap)
        journal.mkdir()
        saved_index.save(str(journal), capped, {}, {"chain": 0})
        back = saved_index.load(str(journal), cap=cap)
        assert back is not None
        assert back.index.terminal == plain.terminal
        assert (back.index.terminal_count, back.index.totals) == (plain.terminal_count, plain.totals)
        assert any(done.spilled for done in back.index.terminal.values()) == (cap is not None)
    # Version 5 (one JSON object), as the previous release wrote it: read as before.
    body = saved_codec.body_of_payload(raw)
    body["v"] = 5
    old = saved_codec.decode(json.dumps(body).encode()).index
    assert old.terminal == plain.terminal
    assert (old.terminal_count, old.totals) == (plain.terminal_count, plain.totals)
    assert old.is_terminal(("chain", 2, 4096 + 330 * 5003))  # in the punched range


def test_a_file_cut_at_a_line_or_with_a_line_more_is_refused() -> None:
    raw = saved_codec.encode(big_index(3, 100), {}, {}, {})
    cut = raw[: raw.rindex(b'["chain"')]
    with pytest.raises(ValueError, match="2 segments of 3"):
        saved_codec.decode(cut)
    with pytest.raises(ValueError, match="4 segments of 3"):
        saved_codec.decode(raw + b'["chain",9,{"succeeded":[4096]},[]]\n')
    with pytest.raises(ValueError, match="twice"):
        saved_codec.decode(raw + raw[raw.rindex(b'["chain"') :])


def _main_decode(raw: bytes) -> None:
    """How the previous release (formats 2 to 5, main's saved_codec.decode) starts a read."""
    body = json.loads(raw)
    if body["v"] not in (2, 3, 4, 5):
        raise ValueError(f"version {body['v']!r}")


@pytest.mark.parametrize(("segments", "refusal"), [(3, "Extra data"), (0, "version 6")])
def test_a_format_6_file_is_refused_by_the_previous_release_not_misread(
    tmp_path: Path, segments: int, refusal: str
) -> None:
    """A downgrade: the previous release reads the whole payload as one JSON object. Format 6's
    segment lines make that fail ("Extra data"); with none, its version check refuses it. Either
    is an Exception its load logs and returns None for: the whole ledger replayed, never the
    offsets read without the punched ranges (which would push their jobs again)."""
    saved_index.save(str(tmp_path), big_index(segments, 100) if segments else LedgerIndex(), {}, {})
    raw = read_state(str(tmp_path), saved_index.SAVED_INDEX_NAME)
    assert raw is not None
    assert json.loads(raw.split(b"\n", 1)[0])["v"] == 6
    with pytest.raises(ValueError, match=refusal):
        _main_decode(raw)


def _peak(run: object) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        run()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_save_and_a_load_hold_about_one_segment_not_the_index(tmp_path: Path) -> None:
    """500,000 finished jobs in 20 segments under a cap of 25,000: the save's and the load's peak
    is about a segment's (25,000 offsets as Python ints and their JSON), not the index's (36 bytes
    a job at peak when it was one JSON: 18 MB; docs/forwarder.md, "Memory")."""
    index = big_index()
    index.spill_past(str(tmp_path), CAP)
    journal = str(tmp_path)
    saved: list[int] = []
    save_peak = _peak(
        lambda: saved.append(write_state_pieces(journal, "idx", saved_codec.encode_pieces(index, {}, {}, {})))
    )
    loaded: list[LedgerIndex] = []

    def load() -> None:
        state = open_state(journal, "idx")
        assert state is not None
        with state:
            loaded.append(
                saved_codec.decode_lines(saved_codec.lines_of(state.chunks()), None, journal, CAP).index
            )

    load_peak = _peak(load)
    back = loaded[0]
    assert back.terminal_count == SEGMENTS * PER_SEGMENT + 11  # a failure, 10 punched
    assert sum(done.resident() for done in back.terminal.values()) <= CAP + CAP // 8 + PER_SEGMENT
    assert back.is_terminal(("chain", 7, 4096 + 330 * 777))
    assert not back.is_terminal(("chain", 7, 4097))
    # Its ints (36 bytes each with the list's slot), the JSON's strings, its arrays: ~130 bytes
    # a job measured at the save (3.2 MB for 25,000), whatever the number of segments.
    one_segment = PER_SEGMENT * 200
    assert save_peak < one_segment, f"save: {save_peak} bytes at peak for {saved[0]} saved"
    assert load_peak < 2 * one_segment + CAP * 8, f"load: {load_peak} bytes at peak"
    logging.getLogger(__name__).info("peaks: save %d, load %d bytes", save_peak, load_peak)
    whole = SEGMENTS * PER_SEGMENT * 36  # the whole index's JSON as Python ints alone
    assert save_peak < whole // 3
    assert load_peak < whole // 3


def test_a_replay_past_the_cap_spills_as_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start with no saved index replays the whole ledger: past the cap it spills during the
    replay (every SPILL_CHECK_RECORDS records), the peak bounded by the cap, not the ledger."""
    monkeypatch.setattr(store, "SPILL_CHECK_RECORDS", 64)
    journal, chain = test_ledger_replay.journal_of_three_segments(tmp_path)  # its segments live from 0
    with open_ledger_writer(journal) as writer:
        for s in range(12):
            writer.append_many(
                Entry("done", f"j{s}-{i}", (chain, s, 4096 + 300 * i), outcome="succeeded", at=1.0).to_bytes()
                for i in range(3000)
            )
    held: list[int] = []
    real = LedgerIndex.check_spill

    def check_spill(self: LedgerIndex) -> None:
        real(self)
        held.append(sum(done.resident() for done in self.terminal.values()))

    monkeypatch.setattr(LedgerIndex, "check_spill", check_spill)
    index, _, resumed = saved_index.resume(journal, Compacted(), KeyTable(str(tmp_path / "keys")), cap=2000)
    assert resumed == 0
    assert index.terminal_count == 36_000
    assert any(done.spilled for done in index.terminal.values())
    assert held, "no check during the replay"
    assert max(held) <= 2000 + 1024 + 64 + 3000 * 2  # the cap, a check's jobs, the front
    plain = store.load_index(journal, Compacted())
    assert index.terminal == plain.terminal


def _rewrite_in_place(path: Path, old: bytes, new: bytes) -> None:
    """Replace the first ``old`` in the file by ``new`` (as long), in the same inode."""
    at = path.read_bytes().index(old)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, new, at)
    finally:
        os.close(fd)


def test_bytes_changed_after_the_check_are_refused_at_the_end_of_the_read(tmp_path: Path) -> None:
    """open_state checks the checksum, then chunks() reads the file again: the second read's
    bytes are checked too (here the file changed in place; silent media or page-cache damage)."""
    write_state(str(tmp_path), "p", b"0123456789" * 300_000)  # 3 chunks
    state = open_state(str(tmp_path), "p")
    assert state is not None
    with state:
        _rewrite_in_place(tmp_path / "p.state", b"345", b"354")
        with pytest.raises(StateFileCorrupt, match="changed since"):
            b"".join(state.chunks())


def test_a_saved_index_changed_after_its_check_gives_a_replay_of_the_whole_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change that still parses (an offset one less: its job not finished, another one is)
    is not used: the saved index is ignored and the whole ledger replayed (resumed 0)."""
    journal, chain = test_ledger_replay.journal_of_three_segments(tmp_path)
    with open_ledger_writer(journal) as writer:
        for s in range(3):
            writer.append_many(
                Entry("done", f"j{s}-{i}", (chain, s, 4096 + 300 * i), outcome="succeeded", at=1.0).to_bytes()
                for i in range(100)
            )
    index = LedgerIndex(keys=KeyTable.in_journal(journal))
    saved_index.save(journal, index, store.replay(journal, index, Compacted()), {})
    index.keys.close()
    path = Path(journal) / (saved_index.SAVED_INDEX_NAME + ".state")
    real = saved_index.open_state

    def open_then_change(directory: str, name: str) -> statefile.StatePayload | None:
        state = real(directory, name)
        _rewrite_in_place(
            path, f'"{chain}",0,{{"succeeded":[4096,'.encode(), f'"{chain}",0,{{"succeeded":[4095,'.encode()
        )
        return state

    monkeypatch.setattr(saved_index, "open_state", open_then_change)
    keys = KeyTable.in_journal(journal)
    try:
        resumed_index, _, resumed = saved_index.resume(journal, Compacted(), keys)
        assert resumed == 0
        assert resumed_index.is_terminal((chain, 0, 4096))
        assert not resumed_index.is_terminal((chain, 0, 4095))
        assert resumed_index == store.load_index(journal, Compacted())
    finally:
        keys.close()
