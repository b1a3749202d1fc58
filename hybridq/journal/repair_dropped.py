"""What a repair drops from one segment, listed entry by entry, from a point to its end.

The plan (:mod:`hybridq.journal.repair_plan`) decides where a chain is cut and which segments go;
this module lists what that loses, for the report: every intact record, every damaged span
(with the sequence numbers it must have held, when its neighbours bound them), every punched
range (finished jobs, not damage: docs/journal.md, "Finished records punched out of pinned
segments") and every missing sequence number. It only reads, through a read-only map of the
file. This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

from hybridq.errors import StateFileCorrupt

from .fileops import FileOps
from .format import (
    FILE_HEADER_SIZE,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    SEAL_RECORDS,
    HeaderError,
    RecordType,
    SegmentHeader,
    decode_segment_header,
    record_problem,
    salt_seed,
)
from .holes import Hole, holes_of
from .repair_report import DropKind, DroppedRecord
from .scan_search import candidate_pattern

__all__ = ["SegmentBytes", "list_dropped", "list_segment"]

_SEAL = int(RecordType.SEAL)


class SegmentBytes:
    """A segment file opened read-only and mapped, for listing the records in a dropped part."""

    def __init__(self, ops: FileOps, path: str) -> None:
        self.fd = ops.open(path, os.O_RDONLY)
        self.ops = ops
        self.size = os.fstat(self.fd).st_size
        self.map: mmap.mmap | None = None
        if self.size:
            self.map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)

    @property
    def data(self) -> bytes | mmap.mmap:
        """The file's bytes (empty for an empty file, which cannot be mapped)."""
        return self.map if self.map is not None else b""

    def header(self) -> SegmentHeader | None:
        """The segment's header, or ``None`` if it does not decode."""
        try:
            return decode_segment_header(bytes(self.data[:FILE_HEADER_SIZE]))
        except HeaderError:
            return None

    def raw_salt(self) -> bytes | None:
        """The salt bytes of a header that does not decode, if the file is long enough."""
        return bytes(self.data[20:28]) if self.size >= 28 else None

    def close(self) -> None:
        """Unmap and close the file."""
        if self.map is not None:
            self.map.close()
        self.ops.close(self.fd)


def _record_at(data: bytes | mmap.mmap, size: int, pos: int, seed: int) -> tuple[int, int, int, int] | None:
    """``(seq, type, payload length, end)`` of a record that verifies at ``pos``, else ``None``."""
    if pos + RECORD_HEADER_SIZE > size:
        return None
    stored, length, seq, word = RECORD_HEADER.unpack_from(data, pos)
    end = pos + RECORD_HEADER_SIZE + length
    if end > size or record_problem(stored, length, word, data[pos + 4 : end], seed) is not None:
        return None
    return int(seq), word & 0xFF, int(length), end


def list_dropped(
    seg: SegmentBytes,
    writer_id: str,
    index: int,
    start: int,
    seed: int | None,
    expected: int | None,
    next_first_seq: int | None,
    holes: tuple[Hole, ...] = (),
) -> Iterator[DroppedRecord]:
    """Everything from ``start`` to the end of a segment: intact records, damaged spans, gaps.

    ``expected`` is the sequence number due at ``start`` (``None``: unknown) and
    ``next_first_seq`` the first one of the chain's next segment, when known: together they
    bound the sequence numbers a damaged span must have held. ``holes``: the segment's punched
    ranges, each listed as one ``punched`` entry (finished jobs, not damage).
    """
    data, size = seg.data, seg.size
    pos, seals = start, 0
    ahead = sorted((h for h in holes if h.start >= start), key=lambda h: h.start)

    def span(begin: int, end: int, following: int | None) -> DroppedRecord:
        last: int | None
        if seals >= SEAL_RECORDS and expected is not None:
            last = expected - 1  # nothing has a sequence number after the seal
        elif following is not None and expected is not None and following >= expected:
            last = following - 1
        elif seals and expected is not None:
            last = expected  # after one seal, only the second one can follow
        else:
            last = None
        return DroppedRecord(writer_id, index, begin, end - begin, DropKind.DAMAGED, expected, last)

    while pos < size:
        while ahead and ahead[0].start < pos:
            ahead.pop(0)
        if ahead and ahead[0].start == pos:
            hole = ahead.pop(0)
            yield DroppedRecord(
                writer_id, index, pos, hole.end - pos, DropKind.PUNCHED, hole.first_seq, hole.next_seq - 1
            )
            expected, pos = hole.next_seq, hole.end
            continue
        rec = _record_at(data, size, pos, seed) if seed is not None else None
        if rec is None:
            found = _next_valid(data, size, pos, seed, expected)
            if ahead and (found is None or found[0] > ahead[0].start):
                yield span(pos, ahead[0].start, ahead[0].first_seq)  # damage stops at a punched range
                pos = ahead[0].start
                continue
            if found is None:
                yield span(pos, size, next_first_seq)
                return
            yield span(pos, found[0], found[1][0])
            pos = found[0]
            continue
        seq, rtype, length, end = rec
        if expected is not None and seq > expected:
            yield DroppedRecord(writer_id, index, pos, 0, DropKind.MISSING, expected, seq - 1)
        kind = DropKind.SEAL if rtype == _SEAL else DropKind.DATA
        seals = seals + 1 if kind is DropKind.SEAL else 0
        yield DroppedRecord(writer_id, index, pos, end - pos, kind, seq, seq, length, rtype)
        if expected is None or seq >= expected:
            expected = seq + 1
        pos = end
    if next_first_seq is not None and expected is not None and next_first_seq > expected:
        yield DroppedRecord(writer_id, index, size, 0, DropKind.MISSING, expected, next_first_seq - 1)


def _next_valid(
    data: bytes | mmap.mmap, size: int, pos: int, seed: int | None, expected: int | None
) -> tuple[int, tuple[int, int, int, int]] | None:
    """The first record after ``pos`` that verifies, and where it is; ``None`` if none does."""
    if seed is None:
        return None
    pattern = candidate_pattern(expected, (expected or 0) + (size - pos) // RECORD_HEADER_SIZE + 1)
    probe = pos + 1
    while True:
        m = pattern.search(data, probe)
        if m is None:
            return None
        hit = _record_at(data, size, m.start(), seed)
        if hit is not None:
            return m.start(), hit
        probe = m.start() + 1


def list_segment(
    ops: FileOps, path: str, writer_id: str, index: int, expected: int | None, next_first_seq: int | None
) -> tuple[list[DroppedRecord], os.stat_result]:
    """Every entry of a whole segment that is dropped, and its stat (taken on the fd read).

    Its header decides where records start.
    """
    seg = SegmentBytes(ops, path)
    try:
        st = os.fstat(seg.fd)
        header = seg.header()
        if header is not None:
            seed: int | None = salt_seed(header.salt)
            expected = header.first_seq
        else:
            if index == 0:
                expected = 1  # a chain's first segment starts at sequence number 1
            # A bad header: records that verify with its salt bytes prove those bytes intact.
            raw = seg.raw_salt()
            seed = salt_seed(raw) if raw is not None else None
        if seg.size < FILE_HEADER_SIZE:
            end = next_first_seq - 1 if next_first_seq is not None and expected is not None else None
            entry = DroppedRecord(writer_id, index, 0, seg.size, DropKind.DAMAGED, expected, end)
            return [entry], st
        try:
            holes = holes_of(path, fileops=ops)
        except StateFileCorrupt:
            holes = ()  # its ranges read as damage: the map says nothing trustworthy
        entries = list_dropped(seg, writer_id, index, FILE_HEADER_SIZE, seed, expected, next_first_seq, holes)
        return list(entries), st
    finally:
        seg.close()
