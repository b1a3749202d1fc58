"""S6: mid-file corruption is always detected, refused, and never returned.

Damage sealed segments (bit flips, zeroed 512-byte sectors, a deleted record, a record spliced in
from another journal) and the middle of a dead writer's unsealed segment. Every case must make
``verify`` and ``recover`` raise :class:`JournalCorruption` naming the damaged file, leave the
directory untouched, and a streaming read must never return a record that differs from what was
written.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from hybridq.errors import JournalCorruption
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.format import FILE_HEADER_SIZE, RECORD_HEADER_SIZE
from hybridq.journal.recovery import recover, verify

from tests.support.writers import abandon_writer

SEED = 6


def build(path: Path, rng: random.Random) -> dict[tuple[str, int], bytes]:
    """Three closed chains of several sealed segments, plus one dead writer's unsealed segment."""
    written: dict[tuple[str, int], bytes] = {}
    for _ in range(3):
        with JournalWriter(path, max_segment_bytes=4096) as writer:
            for i in range(200):
                payload = rng.randbytes(rng.randint(0, 80)) + b"#%d" % i
                rid = writer.append(payload) if i % 10 else writer.append_many([payload])[0]
                written[rid.writer_id, rid.seq] = payload
    dead = JournalWriter(path)
    for i in range(30):
        rid = dead.append(b"dead-%d" % i)
        written[rid.writer_id, rid.seq] = b"dead-%d" % i
    abandon_writer(dead)
    return written


def record_spans(segment: Path) -> list[tuple[int, int]]:
    """(start, end) of every record in a segment, walking the length fields."""
    raw = segment.read_bytes()
    spans, off = [], FILE_HEADER_SIZE
    while off + RECORD_HEADER_SIZE <= len(raw):
        length = int.from_bytes(raw[off + 4 : off + 8], "little")
        spans.append((off, off + RECORD_HEADER_SIZE + length))
        off += RECORD_HEADER_SIZE + length
    return spans


def rewrite(segment: Path, raw: bytes) -> None:
    mode = segment.stat().st_mode
    segment.chmod(0o600)
    segment.write_bytes(raw)
    segment.chmod(mode)


def test_s6_mid_file_corruption(tmp_path: Path, figures) -> None:
    rng = random.Random(SEED)
    pristine = tmp_path / "pristine"
    written = build(pristine, rng)
    other = tmp_path / "other"
    build(other, random.Random(SEED + 1))
    other_segments = sorted(other.glob("*.wal"))
    segments = sorted(pristine.glob("*.wal"))
    sealed = [s for s in segments if not s.stat().st_mode & 0o200]
    (unsealed,) = [s for s in segments if s.stat().st_mode & 0o200]
    assert len(sealed) >= 9, len(sealed)

    trials = detected = garbled_returned = 0
    missed: list[str] = []

    def trial(label: str, name: str, damage) -> None:
        nonlocal trials, detected, garbled_returned
        trials += 1
        work = tmp_path / "work"
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(pristine, work)
        target = work / name
        damage(target)
        before = {p.name: p.read_bytes() for p in work.iterdir()}
        ok = True
        try:
            verify(work)
            ok = False
        except JournalCorruption as exc:
            ok = exc.path == str(target)
        try:
            recover(work)
            ok = False
        except JournalCorruption:
            pass
        ok = ok and {p.name: p.read_bytes() for p in work.iterdir()} == before
        try:
            for rec in JournalReader(work).records():
                if written.get((rec.writer_id, rec.seq)) != rec.payload:
                    garbled_returned += 1
        except JournalCorruption:
            pass
        if ok:
            detected += 1
        else:
            missed.append(label)

    for i in range(150):  # single bit flips anywhere in a sealed segment, header and seals included
        seg = rng.choice(sealed)
        pos = rng.randrange(seg.stat().st_size)
        bit = 1 << rng.randrange(8)

        def flip(path: Path, pos=pos, bit=bit) -> None:
            raw = bytearray(path.read_bytes())
            raw[pos] ^= bit
            rewrite(path, bytes(raw))

        trial(f"flip #{i} {seg.name}@{pos}", seg.name, flip)

    for i in range(40):  # a zeroed 512-byte sector
        seg = rng.choice(sealed)
        sector = rng.randrange((seg.stat().st_size + 511) // 512)

        def zero(path: Path, sector=sector) -> None:
            raw = bytearray(path.read_bytes())
            end = min(len(raw), sector * 512 + 512)
            raw[sector * 512 : end] = bytes(end - sector * 512)
            rewrite(path, bytes(raw))

        trial(f"zero sector #{i} {seg.name}:{sector}", seg.name, zero)

    for i in range(30):  # one record deleted from the middle of a sealed segment
        seg = rng.choice(sealed)
        start, end = rng.choice(record_spans(seg)[:-2])

        def delete(path: Path, start=start, end=end) -> None:
            raw = path.read_bytes()
            rewrite(path, raw[:start] + raw[end:])

        trial(f"delete #{i} {seg.name}@{start}", seg.name, delete)

    for i in range(30):  # a record spliced in from another journal, byte for byte
        seg = rng.choice(sealed)
        start, end = rng.choice(record_spans(seg))
        donor = rng.choice(other_segments)
        dstart, dend = rng.choice(record_spans(donor))

        def splice(path: Path, start=start, end=end, donor=donor, dstart=dstart, dend=dend) -> None:
            raw = path.read_bytes()
            rewrite(path, raw[:start] + donor.read_bytes()[dstart:dend] + raw[end:])

        trial(f"splice #{i} {seg.name}@{start}", seg.name, splice)

    spans = record_spans(unsealed)
    for i in range(20):  # a bad record followed by good ones in a dead writer's unsealed segment
        start, end = rng.choice(spans[:-1])
        pos = rng.randrange(start, end)

        def flip_mid(path: Path, pos=pos) -> None:
            raw = bytearray(path.read_bytes())
            raw[pos] ^= 0x10
            rewrite(path, bytes(raw))

        trial(f"unsealed flip #{i} @{pos}", unsealed.name, flip_mid)

    percent = 100.0 * detected / trials
    figures(
        f"S6 corruption trials={trials} detected={detected} ({percent:.0f}%) "
        f"garbled_returned={garbled_returned} seed={SEED}"
    )
    assert missed == []
    assert garbled_returned == 0
