"""Planning a journal repair: scan each chain as the reader does, and list what must go.

At a chain's first damage the plan cuts the damaged segment after its last valid data record
(to be sealed afresh) and, when sequence numbers were lost, removes every later segment; it
lists every record, damaged span and missing sequence number dropped (see
:mod:`hybridq.journal.repair`; the listing is :mod:`hybridq.journal.repair_dropped`'s).
Planning only reads. This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridq.errors import JournalCorruption

from .fileops import FileOps
from .format import FILE_HEADER_SIZE, SEAL_RECORDS, segment_name
from .reader import peek_header
from .records import SegmentInfo
from .repair_dropped import SegmentBytes, list_dropped, list_segment
from .repair_report import ChainRepair, DropKind, DroppedRecord, RepairReport
from .scan import SegmentScan

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
                seg = SegmentBytes(ops, path)
                try:
                    plan.dropped.extend(
                        list_dropped(
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
            entries, seg_st = list_segment(
                ops,
                path,
                writer_id,
                index,
                drop_expected if pos == 0 else None,
                after.first_seq if after is not None else None,
            )
            fid = FileId.of(seg_st)
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
