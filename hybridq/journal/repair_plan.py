"""Planning a journal repair: scan each chain as the reader does, and list what must go.

At a chain's first damage the plan cuts the damaged segment after its last valid data record
(to be sealed afresh) and, when sequence numbers were lost, removes every later segment; it
lists every record, damaged span and missing sequence number dropped (see
:mod:`hybridq.journal.repair`). Planning only reads. This module must not import redis, rq,
click or the job envelope.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hybridq.errors import JournalCorruption, StateFileCorrupt

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
    segment_name,
)
from .holes import Hole, holes_of
from .reader import peek_header
from .records import SegmentInfo
from .repair_report import ChainRepair, DropKind, DroppedRecord, RepairReport
from .scan import SegmentScan, candidate_pattern

__all__ = [
    "CHUNK_BYTES",
    "ChainPlan",
    "Cut",
    "FileId",
    "plan_chain",
    "summarize",
]

#: Read size of the scan.
CHUNK_BYTES = 1 << 20
_SEAL = int(RecordType.SEAL)


@dataclass(frozen=True, slots=True)
class FileId:
    """Enough of a file's stat to notice that it changed between the scan and the repair."""

    ino: int
    size: int
    mtime_ns: int
    mode: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        """The identity of the file ``st`` describes."""
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


@dataclass(slots=True)
class Cut:
    """Cut a segment at ``offset`` and seal it: seals from ``seal_seq``."""

    path: str
    index: int
    offset: int
    fid: FileId
    seed: int
    seal_seq: int
    last_data_seq: int
    data_count: int


@dataclass(slots=True)
class ChainPlan:
    """What a repair does to one chain: its damage, cuts, removals and every dropped entry."""

    writer_id: str
    last_index: int
    damage: JournalCorruption | None = None
    cuts: list[Cut] = field(default_factory=list)
    removals: list[tuple[str, FileId]] = field(default_factory=list)
    dropped: list[DroppedRecord] = field(default_factory=list)
    bytes_dropped: int = 0
    kept_through_seq: int | None = None


class _Meter:
    """Progress for one segment: passes bytes read on, and makes the total the file's size."""

    def __init__(self, progress: Callable[[int], None] | None, size: int, report: RepairReport) -> None:
        self.progress = progress
        self.size = size
        self.done = 0
        self.report = report

    def __call__(self, n: int) -> None:
        n = min(n, self.size - self.done)
        if n > 0:
            self.done += n
            self.report.bytes_scanned += n
            if self.progress is not None:
                self.progress(n)

    def finish(self) -> None:
        self(self.size - self.done)


class _Segment:
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
        return self.map if self.map is not None else b""

    def header(self) -> SegmentHeader | None:
        try:
            return decode_segment_header(bytes(self.data[:FILE_HEADER_SIZE]))
        except HeaderError:
            return None

    def raw_salt(self) -> bytes | None:
        """The salt bytes of a header that does not decode, if the file is long enough."""
        return bytes(self.data[20:28]) if self.size >= 28 else None

    def close(self) -> None:
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


def _list_dropped(
    seg: _Segment,
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


def _list_segment(
    ops: FileOps, path: str, writer_id: str, index: int, expected: int | None, next_first_seq: int | None
) -> tuple[list[DroppedRecord], FileId]:
    """Every entry of a whole segment that is dropped; its header decides where records start."""
    seg = _Segment(ops, path)
    try:
        fid = FileId.of(os.fstat(seg.fd))
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
            return [entry], fid
        try:
            holes = holes_of(path, fileops=ops)
        except StateFileCorrupt:
            holes = ()  # its ranges read as damage: the map says nothing trustworthy
        entries = _list_dropped(
            seg, writer_id, index, FILE_HEADER_SIZE, seed, expected, next_first_seq, holes
        )
        return list(entries), fid
    finally:
        seg.close()


def plan_chain(
    ops: FileOps,
    directory: str,
    writer_id: str,
    indices: list[int],
    report: RepairReport,
    progress: Callable[[int], None] | None,
) -> ChainPlan:
    """Scan one chain as the reader does; at its first damage, plan the cut and what goes."""
    plan = ChainPlan(writer_id, indices[-1])
    report.segments += len(indices)
    prev_salt: bytes | None = None
    expected: int | None = None  # the sequence number due at the next segment's start
    n = 0
    drop_from: int | None = None  # position in ``indices`` from which every segment goes
    drop_expected: int | None = None  # the sequence number due at the first of them, if known
    kept_through: int | None = None  # the last sequence number the chain keeps
    while n < len(indices):
        index = indices[n]
        path = os.path.join(directory, segment_name(writer_id, index))
        if n and index != indices[n - 1] + 1:
            missing = indices[n - 1] + 1
            plan.damage = JournalCorruption(
                os.path.join(directory, segment_name(writer_id, missing)),
                0,
                f"segment index {missing} of the chain is missing",
                first_seq=expected,
            )
            after = peek_header(path, fileops=ops)
            for absent in range(missing, index):
                first = expected if absent == missing else None
                last = after.first_seq - 1 if after is not None and absent == index - 1 else None
                plan.dropped.append(DroppedRecord(writer_id, absent, 0, 0, DropKind.MISSING, first, last))
            drop_from = n
            break
        fd = ops.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            meter = _Meter(progress, st.st_size, report)
            is_last = n == len(indices) - 1
            scan = SegmentScan(
                ops,
                fd,
                path,
                writer_id,
                index,
                is_last,
                emit=True,
                chunk=CHUNK_BYTES,
                last={},
                on_bytes=meter,
            )
            try:
                header = scan.read_header(prev_salt, expected)
            except JournalCorruption as exc:
                # Nothing in it can be checked against its chain: it goes, with all after it.
                plan.damage = exc
                drop_from, drop_expected = n, expected
                break
            info = SegmentInfo(path, writer_id, index, header.salt, header.first_seq)
            due = expected if expected is not None else header.first_seq
            cut, count, last_data = FILE_HEADER_SIZE, 0, 0
            try:
                for rec in scan.run(info, FILE_HEADER_SIZE, due):
                    cut, count, last_data, due = rec.end, count + 1, rec.seq, rec.seq + 1
            except JournalCorruption as exc:
                if plan.damage is None:
                    plan.damage = exc
                # Punched ranges passed before the damage stay (their jobs finished): the cut is
                # after them and the new seals count their records (hybridq.journal.holes).
                for hole in scan.holes:
                    if cut <= hole.start and hole.end <= exc.offset:
                        cut, due, last_data = hole.end, hole.next_seq, hole.next_seq - 1
                count = info.data_count
                has_next = not is_last and indices[n + 1] == index + 1
                nxt = os.path.join(directory, segment_name(writer_id, index + 1))
                after = peek_header(nxt, fileops=ops) if has_next else None
                seg = _Segment(ops, path)
                try:
                    plan.dropped.extend(
                        _list_dropped(
                            seg,
                            writer_id,
                            index,
                            cut,
                            scan.seed,
                            due,
                            after.first_seq if after else None,
                            scan.holes,
                        )
                    )
                finally:
                    seg.close()
                plan.cuts.append(Cut(path, index, cut, FileId.of(st), scan.seed, due, last_data, count))
                plan.bytes_dropped += st.st_size - cut
                # The chain goes on past this segment only if the next one follows on from the
                # new seals: then nothing with a sequence number was lost here.
                next_seq = due + SEAL_RECORDS
                kept_through = next_seq - 1
                if has_next and (
                    after is None or after.first_seq != next_seq or after.prev_salt != header.salt
                ):
                    drop_from = n + 1
                    break
                prev_salt, expected = header.salt, next_seq
                continue
            finally:
                meter.finish()
            prev_salt, expected = header.salt, info.next_seq
            kept_through = expected - 1
        finally:
            ops.close(fd)
            n += 1
    if drop_from is not None:
        gone = indices[drop_from:]
        for pos, index in enumerate(gone):
            path = os.path.join(directory, segment_name(writer_id, index))
            next_index = gone[pos + 1] if pos + 1 < len(gone) else None
            after = (
                peek_header(os.path.join(directory, segment_name(writer_id, index + 1)), fileops=ops)
                if next_index == index + 1
                else None
            )
            entries, fid = _list_segment(
                ops,
                path,
                writer_id,
                index,
                drop_expected if pos == 0 else None,
                after.first_seq if after is not None else None,
            )
            _Meter(progress, fid.size, report).finish()
            plan.dropped.extend(entries)
            plan.removals.append((path, fid))
            plan.bytes_dropped += fid.size
    plan.kept_through_seq = kept_through
    return plan


def summarize(plan: ChainPlan) -> ChainRepair:
    """What the plan drops, as the report tells it."""
    damage = plan.damage
    assert damage is not None
    return ChainRepair(
        writer_id=plan.writer_id,
        path=damage.path,
        offset=damage.offset,
        reason=damage.reason,
        truncated=tuple((c.path, c.offset) for c in plan.cuts),
        removed=tuple(p for p, _ in plan.removals),
        dropped=tuple(plan.dropped),
        bytes_dropped=plan.bytes_dropped,
        kept_through_seq=plan.kept_through_seq,
    )
