"""The reader: tailing from a position, live writers, recovery of dead chains, state files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hybridq.errors import JournalCorruption, JournalPathError, StateFileCorrupt
from hybridq.journal import ChainPosition, JournalReader, JournalWriter
from hybridq.journal.format import FILE_HEADER_SIZE, encode_records
from hybridq.journal.recovery import recover, verify
from hybridq.journal.statefile import read_state, write_state

from tests.support.writers import abandon_writer as kill_writer


def test_a_second_scan_tails_only_new_records(journal_dir: Path) -> None:
    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        writer.append_many([b"a%d" % i for i in range(50)])
        reader = JournalReader(journal_dir)
        assert len(list(reader.records())) == 50
        assert list(reader.records()) == []
        writer.append_many([b"b%d" % i for i in range(200)])  # crosses segments
        assert [r.payload for r in reader.records()] == [b"b%d" % i for i in range(200)]
    assert list(reader.records()) == []  # the seals close the chain; nothing new


def test_reading_resumes_from_a_saved_position(journal_dir: Path) -> None:
    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        writer.append_many([b"%d" % i for i in range(300)])
    records = list(JournalReader(journal_dir).records())
    for cut in (0, 1, 77, 150, 299):
        saved = {records[cut].writer_id: ChainPosition.from_json(records[cut].position.to_json())}
        rest = [int(r.payload) for r in JournalReader(journal_dir).records(saved)]
        assert rest == list(range(cut + 1, 300))


def test_the_reader_position_stops_at_the_last_record_consumed(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        writer.append_many([b"1", b"2", b"3"])
    reader = JournalReader(journal_dir)
    it = reader.records()
    next(it)
    second = next(it)
    assert reader.position == {second.writer_id: second.position}
    assert [r.payload for r in JournalReader(journal_dir).records(reader.position)] == [b"3"]


def test_a_live_writers_partial_record_is_not_an_error(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        writer.append(b"complete")
        seg = writer._segment
        assert seg is not None
        blob = encode_records(seg.seed, seg.next_seq, 1, [b"in-flight"])
        os.write(seg.fd, blob[:10])  # a write still in progress, as another process sees it
        reader = JournalReader(journal_dir)
        assert [r.payload for r in reader.records()] == [b"complete"]
        assert reader.torn_tails == []
        os.write(seg.fd, blob[10:])
        seg.size += len(blob)
        seg.next_seq += 1
        seg.written_seq = seg.synced_seq = seg.next_seq - 1
        assert [r.payload for r in reader.records()] == [b"in-flight"]


def test_recover_repairs_a_dead_writers_torn_tail_once_with_a_backup(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir)
    writer.append_many([b"kept-1", b"kept-2"])
    seg = writer._segment
    assert seg is not None
    os.write(seg.fd, encode_records(seg.seed, seg.next_seq, 1, [b"torn"])[:15])
    kill_writer(writer)
    assert verify(journal_dir).torn_tails  # read-only check reports, does not repair
    report = recover(journal_dir)
    assert len(report.repaired) == 1
    (segment,) = journal_dir.glob("*.wal")
    backup = Path(str(segment) + ".broken")
    assert backup.exists()
    assert stat.S_IMODE(segment.stat().st_mode) == 0o400  # sealed: never repaired again
    again = recover(journal_dir)
    assert again.repaired == []
    assert again.sealed == []
    assert [r.payload for r in JournalReader(journal_dir).records()] == [b"kept-1", b"kept-2"]


def test_recover_seals_a_dead_writers_clean_chain_and_removes_stale_temp_files(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir)
    writer.append(b"x")
    kill_writer(writer)
    stale = journal_dir / "0000000000000000-00000000.wal.tmp"
    stale.write_bytes(b"")
    fresh = journal_dir / "1111111111111111-00000000.wal.tmp"
    fresh.write_bytes(b"")  # a writer between its open() and its flock(): not touched
    os.utime(stale, (0, 0))
    report = recover(journal_dir)
    assert fresh.exists()
    assert len(report.sealed) == 1
    assert report.repaired == []
    assert report.removed == [stale.name]
    assert not stale.exists()


def test_recover_never_touches_a_live_writer(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        writer.append(b"x")
        report = recover(journal_dir)
        assert report.sealed == []
        assert report.verify.live_chains == 1
        writer.append(b"y")
    assert [r.payload for r in JournalReader(journal_dir).records()] == [b"x", b"y"]


def test_recover_changes_nothing_when_any_chain_is_corrupt(journal_dir: Path) -> None:
    dead = JournalWriter(journal_dir)
    dead.append(b"x")
    seg = dead._segment
    assert seg is not None
    os.write(seg.fd, b"\x01" * 7)  # a torn tail that recovery would otherwise repair
    kill_writer(dead)
    with JournalWriter(journal_dir, max_segment_bytes=4096) as other:
        other.append_many([b"y" * 100] * 80)
    victim = sorted(p for p in journal_dir.glob("*.wal") if p.stat().st_size > 4000)[0]
    raw = bytearray(victim.read_bytes())
    raw[FILE_HEADER_SIZE + 30] ^= 0x01
    victim.chmod(0o600)
    victim.write_bytes(bytes(raw))
    victim.chmod(0o400)
    before = sorted(p.name for p in journal_dir.iterdir())
    with pytest.raises(JournalCorruption) as info:
        recover(journal_dir)
    assert info.value.path == str(victim)
    assert sorted(p.name for p in journal_dir.iterdir()) == before  # no backup, no repair


def test_a_missing_journal_is_an_error_not_an_empty_journal(tmp_path: Path) -> None:
    with pytest.raises(JournalPathError, match="does not exist"):
        JournalReader(tmp_path / "nope")


def test_a_missing_middle_segment_is_corruption(journal_dir: Path) -> None:
    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        writer.append_many([b"z" * 200] * 20)
        writer.append_many([b"z" * 200] * 20)
        writer.append_many([b"z" * 200] * 20)
    segments = sorted(journal_dir.glob("*.wal"))
    segments[1].unlink()
    with pytest.raises(JournalCorruption, match="segment index 1 of the chain is missing"):
        list(JournalReader(journal_dir).records())


def test_state_file_round_trip_and_missing(tmp_path: Path) -> None:
    assert read_state(str(tmp_path), "checkpoint") is None
    write_state(str(tmp_path), "checkpoint", b"one")
    write_state(str(tmp_path), "checkpoint", b"two")
    assert read_state(str(tmp_path), "checkpoint") == b"two"
    assert stat.S_IMODE((tmp_path / "checkpoint.state").stat().st_mode) == 0o600
    assert not (tmp_path / "checkpoint.state.tmp").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "magic"])
def test_a_damaged_state_file_is_an_error_never_missing(tmp_path: Path, damage: str) -> None:
    write_state(str(tmp_path), "checkpoint", b'{"position": 42}')
    path = tmp_path / "checkpoint.state"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-1] ^= 1
    elif damage == "truncate":
        raw = raw[:-3]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw[0] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(StateFileCorrupt):
        read_state(str(tmp_path), "checkpoint")


@pytest.mark.parametrize("name", ["", "../x", ".hidden", "a/b"])
def test_state_file_names_are_validated(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="invalid state file name"):
        write_state(str(tmp_path), name, b"x")


def test_a_segment_whose_previous_salt_does_not_match_is_corruption(journal_dir: Path) -> None:
    from hybridq.journal.format import SegmentHeader, decode_segment_header

    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        writer.append_many([b"s" * 200] * 20)
        writer.append_many([b"s" * 200] * 20)
    second = sorted(journal_dir.glob("*.wal"))[1]
    raw = second.read_bytes()
    header = decode_segment_header(raw)
    forged = SegmentHeader(header.writer_id, header.salt, b"otherjnl", header.index, header.first_seq)
    second.chmod(0o600)
    second.write_bytes(forged.encode() + raw[FILE_HEADER_SIZE:])
    second.chmod(0o400)
    with pytest.raises(JournalCorruption, match="salt mismatch") as info:
        list(JournalReader(journal_dir).records())
    assert info.value.path == str(second)
    assert info.value.first_seq == header.first_seq


@pytest.mark.parametrize("keep", [0, 1, 10, 20, 35])
def test_a_partial_seal_of_a_dead_writer_is_a_torn_tail(journal_dir: Path, keep: int) -> None:
    """The writer died while sealing: one seal (or part of one) and then the end of the file."""
    from hybridq.journal.format import encode_seal

    writer = JournalWriter(journal_dir)
    writer.append_many([b"a", b"b"])
    seg = writer._segment
    assert seg is not None
    seals = encode_records(seg.seed, seg.next_seq, 255, [encode_seal(2, 2)] * 2)
    os.write(seg.fd, seals[: 20 + 16 + keep])  # the first seal whole, then `keep` bytes more
    kill_writer(writer)
    report = recover(journal_dir)
    assert len(report.repaired) == 1
    assert report.repaired[0].offset == seg.size  # truncated back to before the first seal
    assert [r.payload for r in JournalReader(journal_dir).records()] == [b"a", b"b"]
    assert recover(journal_dir).repaired == []
    assert verify(journal_dir).torn_tails == []


def test_a_single_seal_at_the_end_of_a_sealed_segment_is_corruption(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        writer.append(b"a")
    (segment,) = journal_dir.glob("*.wal")
    size = segment.stat().st_size
    segment.chmod(0o600)
    os.truncate(segment, size - 36)  # drop the second seal; the mode still says "sealed"
    segment.chmod(0o400)
    with pytest.raises(JournalCorruption, match="in a sealed segment"):
        verify(journal_dir)


def test_an_unsynced_hole_from_power_loss_is_a_torn_tail_not_corruption(journal_dir: Path, caplog) -> None:
    """Power loss persisted later unsynced records but not an earlier one (pages reordered)."""
    writer = JournalWriter(journal_dir)
    writer.append(b"acked")
    seg = writer._segment
    assert seg is not None
    start = seg.size
    # A batch written but (as far as the disk knows) never fsync'd: its records say so.
    os.write(seg.fd, encode_records(seg.seed, seg.next_seq, 1, [b"a" * 100] * 3, synced_seq=seg.synced_seq))
    kill_writer(writer)
    (segment,) = journal_dir.glob("*.wal")
    with segment.open("r+b") as f:
        f.seek(start)
        f.write(bytes(120))  # the first unsynced record never reached the disk
    report = recover(journal_dir)
    assert report.repaired[0].offset == start
    assert report.repaired[0].unsynced_records == 2
    assert "were never durable" in caplog.text
    assert [r.payload for r in JournalReader(journal_dir).records()] == [b"acked"]


def test_damage_followed_by_records_written_after_it_was_durable_is_corruption(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir)
    for i in range(3):
        writer.append(b"record-%d" % i)  # each one fsync'd before the next was written
    kill_writer(writer)
    (segment,) = journal_dir.glob("*.wal")
    raw = bytearray(segment.read_bytes())
    raw[FILE_HEADER_SIZE + 20 + 2] ^= 0x01  # a payload byte of the first record
    segment.write_bytes(bytes(raw))
    with pytest.raises(JournalCorruption, match="written after this one was durable") as info:
        recover(journal_dir)
    assert info.value.first_seq == 1


def test_a_failure_while_sealing_fails_the_append_and_never_wedges_the_writer(journal_dir: Path) -> None:
    from hybridq.errors import JournalIOError

    writer = JournalWriter(journal_dir, max_segment_bytes=4096)
    writer.append(b"x" * 3000)
    seg = writer._segment
    assert seg is not None
    os.close(seg.fd)  # the next rotation's seal fails on a dead descriptor
    with pytest.raises(JournalIOError):
        writer.append(b"y" * 3000)
    writer.append(b"z")  # a new chain
    writer.close()  # returns: nothing is left waiting
    assert sorted(r.payload for r in JournalReader(journal_dir).records()) == [b"x" * 3000, b"z"]


def test_a_writer_sealing_while_a_scan_reaches_its_end_is_not_taken_for_dead(journal_dir: Path) -> None:
    writer = JournalWriter(journal_dir)
    writer.append_many([b"a", b"b"])
    reader = JournalReader(journal_dir)
    reader.on_bytes = lambda _n: writer.close()  # seal right after the scan's read, before EOF
    assert [r.payload for r in reader.records()] == [b"a", b"b"]
    (info,) = reader.chain_ends.values()
    assert info.sealed
    assert reader.torn_tails == []


def test_a_missing_segment_under_a_saved_position_is_corruption(journal_dir: Path) -> None:
    with JournalWriter(journal_dir, max_segment_bytes=4096) as writer:
        for _ in range(3):
            writer.append_many([b"m" * 200] * 20)
    records = list(JournalReader(journal_dir).records())
    in_second = next(r for r in records if r.segment_index == 1)
    saved = {in_second.writer_id: in_second.position}
    sorted(journal_dir.glob("*.wal"))[1].unlink()
    with pytest.raises(JournalCorruption, match="segment index 1 of the chain is missing"):
        list(JournalReader(journal_dir).records(saved))


def test_bytes_after_two_valid_seals_are_corruption_even_if_writable(journal_dir: Path) -> None:
    """A crash between the seal's fsync and its chmod leaves 0600; junk after the seal is damage."""
    with JournalWriter(journal_dir) as writer:
        writer.append(b"a")
    (segment,) = journal_dir.glob("*.wal")
    segment.chmod(0o600)
    with segment.open("ab") as f:
        f.write(b"\x07" * 13)
    with pytest.raises(JournalCorruption, match="bytes after the seal"):
        recover(journal_dir)


@pytest.mark.parametrize(
    ("rtype", "synced", "reason"),
    [
        (0, None, "invalid record type"),
        (200, None, "invalid record type"),
        (1, 0, "unsynced distance is zero"),
    ],
)
def test_read_record_at_refuses_what_the_scanner_refuses(
    journal_dir: Path, rtype: int, synced: int | None, reason: str
) -> None:
    """One record checker (issue 14.4): a record the scan refuses is never read back by location."""
    from hybridq.journal.reader import read_record_at

    with JournalWriter(journal_dir) as writer:
        ids = writer.append_many([b"first", b"second", b"third"])
        seed = writer._segment.seed if writer._segment is not None else 0
    bad = ids[1]
    segment = journal_dir / f"{bad.writer_id}-{bad.segment:08d}.wal"
    # The same record with a checksum that verifies, but a type or distance the format forbids.
    frame = encode_records(seed, bad.seq, rtype, [b"second"], synced_seq=bad.seq if synced == 0 else None)
    raw = bytearray(segment.read_bytes())
    raw[bad.offset : bad.offset + len(frame)] = frame
    segment.chmod(0o600)
    segment.write_bytes(bytes(raw))
    segment.chmod(0o400)
    with pytest.raises(JournalCorruption, match=reason):
        list(JournalReader(journal_dir).records())
    with pytest.raises(JournalCorruption, match=reason):
        read_record_at(str(journal_dir), bad.writer_id, bad.segment, bad.offset)
    good = read_record_at(str(journal_dir), ids[2].writer_id, ids[2].segment, ids[2].offset)
    assert good.payload == b"third"


def test_the_journal_package_knows_nothing_of_its_consumers() -> None:
    """The journal is bytes in, bytes out (issue 14.4): the layers above name their own things."""
    import re

    import hybridq.journal

    package = Path(hybridq.journal.__file__).parent
    words = re.compile(r"forwarder|ledger", re.IGNORECASE)
    found = [
        f"{source.name}:{n}"
        for source in sorted(package.glob("*.py"))
        for n, line in enumerate(source.read_text().splitlines(), 1)
        if words.search(line)
    ]
    assert found == []
