"""``journal repair``: dry runs change nothing, ``accept_loss`` cuts exactly what it reports.

Each test injects one kind of damage (the S6 kinds, plus a bad header and a missing segment),
then checks that the dry run reports the exact records a repair drops without changing a byte,
and that the repair leaves a journal ``verify`` accepts, keeps every record before the damage,
drops exactly the reported ones and keeps the originals in its backup directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from hybridq.errors import JournalCorruption, JournalLocked
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.format import FILE_HEADER_SIZE, RECORD_HEADER_SIZE, segment_name
from hybridq.journal.reader import list_chains, segment_usage
from hybridq.journal.recovery import recover, verify
from hybridq.journal.repair import BACKUP_PREFIX, REPORT_NAME, DropKind, RepairReport
from hybridq.ops.journal_repair import FORWARDER_LOCK_NAME, repair

from tests.support.writers import abandon_writer

SEAL_BYTES = RECORD_HEADER_SIZE + 16


@dataclass
class Chain:
    writer_id: str
    #: data sequence number -> (payload, segment index, offset)
    records: dict[int, tuple[bytes, int, int]]

    def segment(self, path: Path, index: int) -> Path:
        return path / segment_name(self.writer_id, index)

    def span(self, seq: int) -> tuple[int, int]:
        payload, _, offset = self.records[seq]
        return offset, offset + RECORD_HEADER_SIZE + len(payload)

    def in_segment(self, index: int) -> list[int]:
        return [seq for seq, (_, seg, _) in sorted(self.records.items()) if seg == index]


def write_chain(path: Path, n: int = 400, *, seed: int = 1, close: bool = True) -> Chain:
    """One chain of several 4 KiB segments (about 50 records each)."""
    rng = random.Random(seed)
    writer = JournalWriter(path, max_segment_bytes=4096)
    records: dict[int, tuple[bytes, int, int]] = {}
    for i in range(n):
        payload = rng.randbytes(rng.randint(0, 60)) + b"#%d" % i
        rid = writer.append(payload)
        records[rid.seq] = (payload, rid.segment, rid.offset)
    chain = Chain(writer.writer_id, records)
    if close:
        writer.close()
    else:
        abandon_writer(writer)
    return chain


def rewrite(segment: Path, raw: bytes) -> None:
    mode = segment.stat().st_mode
    segment.chmod(0o600)
    segment.write_bytes(raw)
    segment.chmod(mode)


def flip(segment: Path, pos: int, bit: int = 0x10) -> None:
    raw = bytearray(segment.read_bytes())
    raw[pos] ^= bit
    rewrite(segment, bytes(raw))


def snapshot(path: Path) -> dict[str, str]:
    """Every file of the journal directory (recursively) with its mode and content hash."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != FORWARDER_LOCK_NAME:
            out[str(p.relative_to(path))] = (
                f"{p.stat().st_mode:o}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
            )
    return out


def read_all(path: Path) -> dict[tuple[str, int], bytes]:
    return {(r.writer_id, r.seq): r.payload for r in JournalReader(path).records()}


def covered(report: RepairReport) -> tuple[set[int], set[int]]:
    """(sequence numbers of intact data records dropped, those of damaged or missing spans)."""
    data, spans = set(), set()
    for d in report.dropped:
        if d.kind is DropKind.DATA:
            data.add(d.seq)
        elif d.kind in (DropKind.DAMAGED, DropKind.MISSING):
            assert d.seq is not None, d
            assert d.last_seq is not None, d
            spans.update(range(d.seq, d.last_seq + 1))
    return data, spans


def check_repair(
    path: Path, chain: Chain, first_lost: int, *, damaged: set[int], shift: tuple[int, int] = (0, 0)
) -> RepairReport:
    """Dry run, then repair; every check the brief asks for. Returns the applied report.

    ``shift``: (segment, bytes) by which the damage moved the later records of that segment.
    """
    with pytest.raises(JournalCorruption):
        verify(path)
    before = snapshot(path)
    lost = {seq for seq in chain.records if seq >= first_lost}

    dry = repair(path, accept_loss=False)
    assert snapshot(path) == before  # not one byte changed
    assert not dry.applied
    assert dry.backup is None
    (only,) = dry.repairs
    assert only.writer_id == chain.writer_id
    data, spans = covered(dry)
    # Exactly the records from the damage on: intact ones listed one by one, the damaged ones
    # as spans whose sequence numbers are known, none of the kept ones.
    assert data == lost - damaged
    assert damaged <= spans
    assert not (spans & set(chain.records)) - damaged
    for d in dry.dropped:
        if d.kind is DropKind.DATA:
            payload, segment, offset = chain.records[d.seq]
            offset += shift[1] if segment == shift[0] else 0
            assert (d.writer_id, d.segment, d.offset, d.length) == (
                chain.writer_id,
                segment,
                offset,
                len(payload),
            )

    done = repair(path, accept_loss=True)
    assert done.applied
    assert [r.to_dict() for r in done.repairs] == [r.to_dict() for r in dry.repairs]
    verify(path)
    assert read_all(path) == {
        (chain.writer_id, s): chain.records[s][0] for s in chain.records if s < first_lost
    }

    # The backup holds every changed or removed file as it was, plus the report.
    assert done.backup is not None
    backup = Path(done.backup)
    assert backup.parent == path
    assert backup.name.startswith(BACKUP_PREFIX)
    changed = {os.path.basename(p) for p, _ in only.truncated} | {os.path.basename(p) for p in only.removed}
    assert changed
    for name in changed:
        assert (
            f"{(backup / name).stat().st_mode:o}:{hashlib.sha256((backup / name).read_bytes()).hexdigest()}"
            == (before[name])
        )
    assert {p.name for p in backup.iterdir()} == changed | {REPORT_NAME}
    assert json.loads((backup / REPORT_NAME).read_text())["repairs"][0]["dropped"] == [
        d.to_dict() for d in only.dropped
    ]
    # Healthy segments were not touched.
    for name, digest in before.items():
        if name not in changed:
            assert snapshot(path)[name] == digest, name

    # Idempotent: a second run finds nothing and changes nothing.
    after = snapshot(path)
    again = repair(path, accept_loss=True)
    assert again.healthy
    assert not again.applied
    assert snapshot(path) == after
    recover(path)  # the forwarder's open works on the repaired journal
    return done


def test_flipped_bit_in_a_record_of_a_sealed_segment(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    victim = chain.in_segment(1)[10]
    start, _ = chain.span(victim)
    flip(chain.segment(tmp_path, 1), start + RECORD_HEADER_SIZE + 1)
    report = check_repair(tmp_path, chain, victim, damaged={victim})
    (only,) = report.repairs
    assert only.path == str(chain.segment(tmp_path, 1))
    assert only.offset == start
    assert only.reason.startswith("checksum mismatch")
    assert only.truncated == ((str(chain.segment(tmp_path, 1)), start),)
    last_index = max(seg for _, seg, _ in chain.records.values())
    assert only.removed == tuple(str(chain.segment(tmp_path, i)) for i in range(2, last_index + 1))
    (damaged,) = [d for d in only.dropped if d.kind is DropKind.DAMAGED]
    assert (damaged.segment, damaged.offset, damaged.seq, damaged.last_seq) == (1, start, victim, victim)
    assert only.kept_through_seq == victim + 1  # the records before it, then two new seals
    size = chain.segment(tmp_path, 1).stat().st_size
    assert size == start + 2 * SEAL_BYTES
    assert not chain.segment(tmp_path, 1).stat().st_mode & 0o200  # sealed again


def test_flipped_bit_in_a_length_field(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    victim = chain.in_segment(2)[3]
    start, _ = chain.span(victim)
    flip(chain.segment(tmp_path, 2), start + 4, 0x01)
    check_repair(tmp_path, chain, victim, damaged={victim})


def test_zeroed_sector_mid_segment(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    segment = chain.segment(tmp_path, 1)
    raw = bytearray(segment.read_bytes())
    raw[1024:1536] = bytes(512)
    rewrite(segment, bytes(raw))
    hit = {s for s in chain.in_segment(1) if chain.span(s)[0] < 1536 and chain.span(s)[1] > 1024}
    report = check_repair(tmp_path, chain, min(hit), damaged=hit)
    (only,) = report.repairs
    assert only.offset == chain.span(min(hit))[0]


def test_deleted_record_leaves_a_sequence_gap(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    victim = chain.in_segment(1)[20]
    start, end = chain.span(victim)
    segment = chain.segment(tmp_path, 1)
    raw = segment.read_bytes()
    rewrite(segment, raw[:start] + raw[end:])
    report = check_repair(tmp_path, chain, victim, damaged={victim}, shift=(1, start - end))
    (only,) = report.repairs
    assert only.reason == "sequence gap"
    (missing,) = [d for d in only.dropped if d.kind is DropKind.MISSING]
    assert (missing.segment, missing.offset, missing.size, missing.seq, missing.last_seq) == (
        1,
        start,
        0,
        victim,
        victim,
    )


def test_record_spliced_from_another_file_fails_its_salted_checksum(tmp_path: Path) -> None:
    journal, other = tmp_path / "journal", tmp_path / "other"
    chain = write_chain(journal)
    donor = write_chain(other, seed=2)
    victim = chain.in_segment(2)[5]
    start, end = chain.span(victim)
    # The donor record with the same sequence number, byte for byte: only its salt differs.
    d_start, d_end = donor.span(victim)
    donor_raw = donor.segment(other, donor.records[victim][1]).read_bytes()[d_start:d_end]
    segment = chain.segment(journal, 2)
    raw = segment.read_bytes()
    rewrite(segment, raw[:start] + donor_raw + raw[end:])
    shift = (2, len(donor_raw) - (end - start))
    report = check_repair(journal, chain, victim, damaged={victim}, shift=shift)
    (damaged,) = [d for d in report.dropped if d.kind is DropKind.DAMAGED]
    assert (damaged.offset, damaged.size) == (start, len(donor_raw))


def test_damaged_segment_header_drops_that_segment_and_the_rest_of_its_chain(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    flip(chain.segment(tmp_path, 2), 55)  # a reserved byte: the header checksum fails
    first = chain.in_segment(2)[0]
    report = check_repair(tmp_path, chain, first, damaged=set())
    (only,) = report.repairs
    assert only.reason == "file header checksum mismatch"
    assert only.truncated == ()
    assert only.removed[0] == str(chain.segment(tmp_path, 2))
    # Its salt bytes were intact, so its records are listed one by one.
    assert {d.kind for d in only.dropped} == {DropKind.DATA, DropKind.SEAL}
    assert only.kept_through_seq == first - 1


def test_damaged_salt_in_a_segment_header_is_one_damaged_span(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    flip(chain.segment(tmp_path, 1), 22)  # in the salt: nothing in the segment verifies
    in_one = chain.in_segment(1)
    report = check_repair(tmp_path, chain, in_one[0], damaged=set(in_one))
    spans = [d for d in report.dropped if d.segment == 1]
    assert [d.kind for d in spans] == [DropKind.DAMAGED]
    size = chain.segment(tmp_path, 1).stat().st_size if chain.segment(tmp_path, 1).exists() else None
    assert size is None  # moved into the backup
    # Its sequence numbers come from its neighbours: the seals included.
    assert (spans[0].seq, spans[0].last_seq) == (in_one[0], in_one[-1] + 2)


def test_missing_middle_segment(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    chain.segment(tmp_path, 2).unlink()
    in_two = chain.in_segment(2)
    report = check_repair(tmp_path, chain, in_two[0], damaged=set(in_two))
    (only,) = report.repairs
    assert only.reason == "segment index 2 of the chain is missing"
    (missing,) = [d for d in only.dropped if d.kind is DropKind.MISSING]
    assert (missing.segment, missing.size, missing.seq, missing.last_seq) == (2, 0, in_two[0], in_two[-1] + 2)
    assert list_chains(str(tmp_path))[chain.writer_id] == [0, 1]


def test_mid_file_corruption_in_a_dead_writers_unsealed_segment(tmp_path: Path) -> None:
    chain = write_chain(tmp_path, n=30, close=False)
    (index,) = {seg for _, seg, _ in chain.records.values()}
    victim = sorted(chain.records)[12]
    flip(chain.segment(tmp_path, index), chain.span(victim)[0] + RECORD_HEADER_SIZE)
    report = check_repair(tmp_path, chain, victim, damaged={victim})
    assert report.repairs[0].removed == ()


def test_damaged_seal_loses_no_record_and_keeps_the_later_segments(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    segment = chain.segment(tmp_path, 1)
    size = segment.stat().st_size
    flip(segment, size - SEAL_BYTES + RECORD_HEADER_SIZE)  # the second seal's payload
    before = snapshot(tmp_path)
    report = repair(tmp_path, accept_loss=True)
    (only,) = report.repairs
    assert only.truncated == ((str(segment), size - 2 * SEAL_BYTES),)
    assert only.removed == ()
    assert only.data_records_dropped == 0
    assert [d.kind for d in only.dropped] == [DropKind.SEAL, DropKind.DAMAGED]
    data, spans = covered(report)
    assert data == set()
    assert spans == {chain.in_segment(1)[-1] + 2}  # the second seal's sequence number
    verify(tmp_path)
    assert read_all(tmp_path) == {(chain.writer_id, s): p for s, (p, _, _) in chain.records.items()}
    after = snapshot(tmp_path)
    assert {name for name in before if before[name] != after.get(name)} == {segment.name}


def test_damage_in_two_chains_is_repaired_in_both(tmp_path: Path) -> None:
    one, two = write_chain(tmp_path, seed=1), write_chain(tmp_path, seed=2)
    flip(one.segment(tmp_path, 1), one.span(one.in_segment(1)[4])[0] + 30)
    flip(two.segment(tmp_path, 3), two.span(two.in_segment(3)[0])[0] + 2)
    report = repair(tmp_path, accept_loss=True)
    assert {r.writer_id for r in report.repairs} == {one.writer_id, two.writer_id}
    verify(tmp_path)
    kept = read_all(tmp_path)
    assert {s for w, s in kept if w == one.writer_id} == {s for s in one.records if s < one.in_segment(1)[4]}
    assert {s for w, s in kept if w == two.writer_id} == {s for s in two.records if s < two.in_segment(3)[0]}


def test_healthy_journal_is_left_alone(tmp_path: Path) -> None:
    write_chain(tmp_path, seed=1)
    torn = write_chain(tmp_path, n=20, seed=2, close=False)
    segment = torn.segment(tmp_path, 0)
    segment.write_bytes(segment.read_bytes()[:-7])  # a torn tail is not corruption
    with JournalWriter(tmp_path) as live:
        live.append(b"live")
        before = snapshot(tmp_path)
        for accept_loss in (False, True):
            report = repair(tmp_path, accept_loss=accept_loss)
            assert report.healthy
            assert not report.applied
            assert report.backup is None
            assert report.dropped == []
            assert report.chains == 3
            assert snapshot(tmp_path) == before
    assert not list(tmp_path.glob(BACKUP_PREFIX + "*"))


def test_progress_counts_every_byte_of_every_segment(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    flip(chain.segment(tmp_path, 1), 200)
    seen: list[int] = []
    report = repair(tmp_path, accept_loss=False, progress=seen.append)
    assert all(n > 0 for n in seen)
    assert sum(seen) == report.bytes_scanned == segment_usage(str(tmp_path))[1]


def test_refuses_while_a_forwarder_holds_the_lock(tmp_path: Path) -> None:
    from hybridq.ledger.checkpoint import LOCK_NAME

    assert LOCK_NAME == FORWARDER_LOCK_NAME  # the journal package spells it out on its own
    chain = write_chain(tmp_path)
    flip(chain.segment(tmp_path, 1), 300)
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"forwarder pid 1 on test\n")
        before = snapshot(tmp_path)
        for accept_loss in (False, True):
            with pytest.raises(JournalLocked, match="forwarder pid 1"):
                repair(tmp_path, accept_loss=accept_loss)
        assert snapshot(tmp_path) == before
    finally:
        os.close(fd)
    assert repair(tmp_path, accept_loss=True).applied


@pytest.mark.parametrize("name", ["ledger", "keys"])
def test_refuses_a_ledger_while_its_journals_forwarder_holds_the_lock(tmp_path: Path, name: str) -> None:
    ledger = tmp_path / name  # the ledger, or the key store
    chain = write_chain(ledger)
    flip(chain.segment(ledger, 1), 300)
    fd = os.open(tmp_path / FORWARDER_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(JournalLocked):
            repair(ledger, accept_loss=True)
    finally:
        os.close(fd)
    assert repair(ledger, accept_loss=True).applied
    verify(ledger)


def test_refuses_to_touch_a_live_writers_segment(tmp_path: Path) -> None:
    dead = write_chain(tmp_path, seed=3)
    flip(dead.segment(tmp_path, 1), 300)
    writer = JournalWriter(tmp_path, max_segment_bytes=4096)
    try:
        ids = [writer.append(b"x" * 50 + b"%d" % i) for i in range(150)]
        assert ids[-1].segment >= 2
        live = writer.writer_id
        sealed = tmp_path / segment_name(live, 1)
        flip(sealed, FILE_HEADER_SIZE + RECORD_HEADER_SIZE + 2)
        before = snapshot(tmp_path)
        for accept_loss in (False, True):
            with pytest.raises(JournalLocked) as caught:
                repair(tmp_path, accept_loss=accept_loss)
            assert caught.value.path == str(tmp_path / segment_name(live, ids[-1].segment))
        assert snapshot(tmp_path) == before  # the dead chain was not repaired either
    finally:
        writer.close()
    report = repair(tmp_path, accept_loss=True)
    assert {r.writer_id for r in report.repairs} == {dead.writer_id, live}
    verify(tmp_path)


def test_damaged_seal_in_a_live_writers_chain_is_repaired_around_its_open_segment(tmp_path: Path) -> None:
    with JournalWriter(tmp_path, max_segment_bytes=4096) as writer:
        ids = [writer.append(b"y" * 40 + b"%d" % i) for i in range(150)]
        open_segment = tmp_path / segment_name(writer.writer_id, ids[-1].segment)
        sealed = tmp_path / segment_name(writer.writer_id, 0)
        flip(sealed, sealed.stat().st_size - 1)  # the second seal's payload: no record is lost
        before = snapshot(tmp_path)
        report = repair(tmp_path, accept_loss=True)
        (only,) = report.repairs
        assert only.removed == ()
        assert only.data_records_dropped == 0
        after = snapshot(tmp_path)
        assert after[open_segment.name] == before[open_segment.name]
        verify(tmp_path)
        more = writer.append(b"after the repair")
    assert read_all(tmp_path)[writer.writer_id, more.seq] == b"after the repair"
    assert len(read_all(tmp_path)) == 151


def test_mid_file_damage_in_a_live_writers_open_segment_is_refused(tmp_path: Path) -> None:
    with JournalWriter(tmp_path) as writer:
        ids = [writer.append(b"record %d" % i) for i in range(20)]
        segment = tmp_path / segment_name(writer.writer_id, 0)
        flip(segment, ids[5].offset + RECORD_HEADER_SIZE)
        before = snapshot(tmp_path)
        with pytest.raises(JournalLocked):
            repair(tmp_path, accept_loss=True)
        assert snapshot(tmp_path) == before


def test_backup_directory_is_not_taken_for_segments(tmp_path: Path) -> None:
    chain = write_chain(tmp_path)
    flip(chain.segment(tmp_path, 0), 500)
    report = repair(tmp_path, accept_loss=True)
    assert report.backup is not None
    assert list_chains(str(tmp_path)) == {chain.writer_id: [0]}
    assert verify(tmp_path).segments == 1
