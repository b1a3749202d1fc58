"""Explicit, loss-accepting repair of mid-file corruption (``hybridq journal repair --accept-loss``).

Policy: ``docs/journal-format.md`` (*Torn tail and corruption*) and docs/reliability.md rule 11:
corruption is refused on open; this module is the one way past it, and only when asked. It
reports exactly what it drops (etcd's ``Repair``, ``redis-check-aof --fix``), keeps a backup of
every file it changes or removes, and never skips a damaged record silently (LevelDB).

What a repair does, per chain, at the **first** damage found by the same scan the reader uses:

* The damaged segment is cut at the end of its last valid data record and sealed afresh. The
  records before the damage stay exactly where they were (same offsets, same sequence numbers).
* Sequence numbers must stay contiguous across a chain (the reader refuses a gap between
  segments), so the chain's later segments can stay only when nothing with a sequence number
  was lost (damage confined to the seal, or bytes after it). Otherwise they are moved into the
  backup and reported as dropped, record by record.
* A segment whose header is bad (or does not follow on from the previous one) cannot be
  checked at all: it and every later segment of its chain are moved into the backup. So are
  the segments after a missing middle segment.

Torn tails are not corruption: :func:`~hybridq.journal.recovery.recover` repairs them and this
module leaves them alone. A dry run (``accept_loss=False``) reads only and reports the same
plan. This module must not import redis, rq, click, the forwarder or the job envelope.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hybridq.errors import JournalCorruption, JournalIOError, JournalLocked

from .fileops import OS_FILEOPS, FileOps, write_all
from .format import (
    FILE_HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    SEAL_RECORDS,
    SEGMENT_SUFFIX,
    TMP_SUFFIX,
    HeaderError,
    RecordType,
    SegmentHeader,
    crc32c,
    decode_segment_header,
    salt_seed,
    segment_name,
)
from .paths import existing_journal_dir
from .reader import list_chains
from .records import SegmentInfo
from .recovery import STALE_TMP_S
from .scan import SegmentScan
from .segment import SealError, seal_fd

__all__ = [
    "BACKUP_PREFIX",
    "FORWARDER_LOCK_NAME",
    "REPORT_NAME",
    "ChainRepair",
    "DropKind",
    "DroppedRecord",
    "RepairReport",
    "repair",
]

#: The forwarder's lock file. The same literal as ``hybridq.forwarder.LOCK_NAME``, which the
#: journal package may not import (import-linter): the two must stay equal.
FORWARDER_LOCK_NAME = "forwarder.lock"
#: The completion ledger's directory inside a journal (``hybridq.ledger.LEDGER_DIR``): the ledger
#: is written by its journal's forwarder, so repairing it needs the parent's forwarder lock too.
_LEDGER_DIR = "ledger"
#: Backups go into ``<journal>/repair-backup-<UTC timestamp>/``: a subdirectory, so the names in
#: it are never taken for segments (``list_chains`` reads only the journal directory itself).
BACKUP_PREFIX = "repair-backup-"
#: The report written into the backup directory.
REPORT_NAME = "repair-report.json"

log = logging.getLogger("hybridq.journal")

_CHUNK_BYTES = 1 << 20
_SEAL = int(RecordType.SEAL)
# A loose pattern for where a record header could start when no sequence number is expected:
# a valid type byte and a non-zero unsynced distance.
_ANY_RECORD = re.compile(b"(?s)(?=.{16}[\\x01-\\x7f\\xff](?!\\x00\\x00\\x00))")


class DropKind(StrEnum):
    """What a dropped entry is."""

    #: An intact data record (its checksum verifies; its bytes are in the backup).
    DATA = "data"
    #: An intact seal record (no payload for the layer above; re-created when a segment is cut).
    SEAL = "seal"
    #: Bytes that do not verify as records: the damage itself. ``seq``/``last_seq`` give the
    #: sequence numbers they must have held, as far as the neighbours tell.
    DAMAGED = "damaged"
    #: Sequence numbers absent from the file (a deleted record, a missing segment): no bytes.
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class DroppedRecord:
    """One record (or damaged span, or run of missing sequence numbers) a repair drops.

    Attributes:
        writer_id: the chain.
        segment: the segment index.
        offset: byte offset in that segment (``0`` for a missing segment).
        size: bytes it occupies in the segment (``0`` for missing ones).
        kind: see :class:`DropKind`.
        seq: its sequence number; for a damaged or missing span the first one it held.
            ``None`` when unknown.
        last_seq: the last sequence number (``seq`` for a record). ``None`` when unknown;
            below ``seq`` when the span held no record (e.g. garbage after a seal).
        length: the payload length of an intact record, else ``None``.
        rtype: the record type of an intact record, else ``None``.
    """

    writer_id: str
    segment: int
    offset: int
    size: int
    kind: DropKind
    seq: int | None
    last_seq: int | None
    length: int | None = None
    rtype: int | None = None

    @property
    def seq_count(self) -> int | None:
        """How many sequence numbers it covers; ``None`` when unknown."""
        if self.seq is None or self.last_seq is None:
            return None
        return max(0, self.last_seq - self.seq + 1)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "writer": self.writer_id,
            "segment": self.segment,
            "offset": self.offset,
            "size": self.size,
            "kind": str(self.kind),
            "seq": self.seq,
            "last_seq": self.last_seq,
            "length": self.length,
            "type": self.rtype,
        }


@dataclass(frozen=True, slots=True)
class ChainRepair:
    """What a repair does (or would do) to one damaged chain.

    Attributes:
        writer_id: the chain.
        path: the file where the damage was found (a missing segment's would-be path).
        offset: byte offset of the damage in it.
        reason: what the scan found, as :class:`~hybridq.errors.JournalCorruption` says it.
        truncated: ``(segment path, offset)`` of each segment cut and sealed afresh.
        removed: segment paths moved into the backup (the chain now ends before them).
        dropped: every record, damaged span and missing sequence number dropped, in order.
        bytes_dropped: bytes of the journal removed (the cut tails and the removed files).
        kept_through_seq: the chain's last sequence number still in the journal, after the
            repair (``None`` when the whole chain goes).
    """

    writer_id: str
    path: str
    offset: int
    reason: str
    truncated: tuple[tuple[str, int], ...]
    removed: tuple[str, ...]
    dropped: tuple[DroppedRecord, ...]
    bytes_dropped: int
    kept_through_seq: int | None

    @property
    def data_records_dropped(self) -> int:
        """Intact data records dropped (damaged spans come on top: see :attr:`dropped`)."""
        return sum(1 for d in self.dropped if d.kind is DropKind.DATA)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "writer": self.writer_id,
            "path": self.path,
            "offset": self.offset,
            "reason": self.reason,
            "truncated": [{"path": p, "offset": o} for p, o in self.truncated],
            "removed": list(self.removed),
            "bytes_dropped": self.bytes_dropped,
            "kept_through_seq": self.kept_through_seq,
            "data_records_dropped": self.data_records_dropped,
            "dropped": [d.to_dict() for d in self.dropped],
        }


@dataclass
class RepairReport:
    """The result of :func:`repair`.

    Attributes:
        path: the journal directory.
        accept_loss: whether changes were allowed (``False``: a dry run, nothing changed).
        applied: whether the journal was changed.
        chains: chains checked.
        segments: segment files checked.
        bytes_scanned: bytes of segment files read.
        repairs: one entry per damaged chain (empty: the journal needs no repair).
        backup: the backup directory holding every file changed or removed (``None`` when
            nothing was changed).
    """

    path: str
    accept_loss: bool
    applied: bool = False
    chains: int = 0
    segments: int = 0
    bytes_scanned: int = 0
    repairs: list[ChainRepair] = field(default_factory=list)
    backup: str | None = None

    @property
    def healthy(self) -> bool:
        """Whether no corruption was found (torn tails are not corruption)."""
        return not self.repairs

    @property
    def dropped(self) -> list[DroppedRecord]:
        """Every dropped entry of every chain."""
        return [d for r in self.repairs for d in r.dropped]

    @property
    def bytes_dropped(self) -> int:
        """Bytes removed from the journal in total."""
        return sum(r.bytes_dropped for r in self.repairs)

    @property
    def data_records_dropped(self) -> int:
        """Intact data records dropped in total."""
        return sum(r.data_records_dropped for r in self.repairs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (also written into the backup directory)."""
        return {
            "path": self.path,
            "accept_loss": self.accept_loss,
            "applied": self.applied,
            "healthy": self.healthy,
            "chains": self.chains,
            "segments": self.segments,
            "bytes_scanned": self.bytes_scanned,
            "bytes_dropped": self.bytes_dropped,
            "data_records_dropped": self.data_records_dropped,
            "backup": self.backup,
            "repairs": [r.to_dict() for r in self.repairs],
        }


# -- planning ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _FileId:
    """Enough of a file's stat to notice that it changed between the scan and the repair."""

    ino: int
    size: int
    mtime_ns: int
    mode: int

    @classmethod
    def of(cls, st: os.stat_result) -> _FileId:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


@dataclass(slots=True)
class _Cut:
    """Cut a segment at ``offset`` and seal it: seals from ``seal_seq``."""

    path: str
    index: int
    offset: int
    fid: _FileId
    seed: int
    seal_seq: int
    last_data_seq: int
    data_count: int


@dataclass(slots=True)
class _ChainPlan:
    writer_id: str
    last_index: int
    damage: JournalCorruption | None = None
    cuts: list[_Cut] = field(default_factory=list)
    removals: list[tuple[str, _FileId]] = field(default_factory=list)
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


def _peek_header(ops: FileOps, path: str) -> SegmentHeader | None:
    try:
        fd = ops.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return decode_segment_header(os.pread(fd, FILE_HEADER_SIZE, 0))
    except HeaderError:
        return None
    finally:
        ops.close(fd)


def _candidates(low_seq: int | None, high_seq: int) -> re.Pattern[bytes]:
    """Where a record header could start (see ``scan._candidate_pattern``)."""
    if low_seq is None:
        return _ANY_RECORD
    if low_seq >> 24 == high_seq >> 24:
        seq = b".{3}" + re.escape((low_seq >> 24).to_bytes(5, "little"))
    else:
        seq = b".{8}"
    return re.compile(b"(?s)(?=.{8}" + seq + b"[\\x01-\\x7f\\xff](?!\\x00\\x00\\x00).{3})")


def _record_at(data: bytes | mmap.mmap, size: int, pos: int, seed: int) -> tuple[int, int, int, int] | None:
    """``(seq, type, payload length, end)`` of a record that verifies at ``pos``, else ``None``."""
    if pos + RECORD_HEADER_SIZE > size:
        return None
    stored, length, seq, word = RECORD_HEADER.unpack_from(data, pos)
    end = pos + RECORD_HEADER_SIZE + length
    rtype = word & 0xFF
    if length > MAX_PAYLOAD_BYTES or end > size or not word >> 8:
        return None
    if rtype != _SEAL and not RecordType.is_data(rtype):
        return None
    if crc32c(data[pos + 4 : end], seed) != stored:
        return None
    return int(seq), rtype, int(length), end


def _list_dropped(
    seg: _Segment,
    writer_id: str,
    index: int,
    start: int,
    seed: int | None,
    expected: int | None,
    next_first_seq: int | None,
) -> Iterator[DroppedRecord]:
    """Everything from ``start`` to the end of a segment: intact records, damaged spans, gaps.

    ``expected`` is the sequence number due at ``start`` (``None``: unknown) and
    ``next_first_seq`` the first one of the chain's next segment, when known: together they
    bound the sequence numbers a damaged span must have held.
    """
    data, size = seg.data, seg.size
    pos, seals = start, 0

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
        rec = _record_at(data, size, pos, seed) if seed is not None else None
        if rec is None:
            found: tuple[int, tuple[int, int, int, int]] | None = None
            if seed is not None:
                pattern = _candidates(expected, (expected or 0) + (size - pos) // RECORD_HEADER_SIZE + 1)
                probe = pos + 1
                while found is None:
                    m = pattern.search(data, probe)
                    if m is None:
                        break
                    hit = _record_at(data, size, m.start(), seed)
                    if hit is not None:
                        found = m.start(), hit
                    probe = m.start() + 1
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


def _list_segment(
    ops: FileOps, path: str, writer_id: str, index: int, expected: int | None, next_first_seq: int | None
) -> tuple[list[DroppedRecord], _FileId]:
    """Every entry of a whole segment that is dropped; its header decides where records start."""
    seg = _Segment(ops, path)
    try:
        fid = _FileId.of(os.fstat(seg.fd))
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
        entries = _list_dropped(seg, writer_id, index, FILE_HEADER_SIZE, seed, expected, next_first_seq)
        return list(entries), fid
    finally:
        seg.close()


def _plan_chain(
    ops: FileOps,
    directory: str,
    writer_id: str,
    indices: list[int],
    report: RepairReport,
    progress: Callable[[int], None] | None,
) -> _ChainPlan:
    """Scan one chain as the reader does; at its first damage, plan the cut and what goes."""
    plan = _ChainPlan(writer_id, indices[-1])
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
            after = _peek_header(ops, path)
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
                chunk=_CHUNK_BYTES,
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
                has_next = not is_last and indices[n + 1] == index + 1
                nxt = os.path.join(directory, segment_name(writer_id, index + 1))
                after = _peek_header(ops, nxt) if has_next else None
                seg = _Segment(ops, path)
                try:
                    plan.dropped.extend(
                        _list_dropped(
                            seg, writer_id, index, cut, scan.seed, due, after.first_seq if after else None
                        )
                    )
                finally:
                    seg.close()
                plan.cuts.append(_Cut(path, index, cut, _FileId.of(st), scan.seed, due, last_data, count))
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
                _peek_header(ops, os.path.join(directory, segment_name(writer_id, index + 1)))
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


def _chain_is_live(ops: FileOps, directory: str, writer_id: str, last_index: int) -> bool:
    """Whether a writer still appends to this chain (how recovery tells, ``scan._settle``).

    Live: its last segment is flock'ed, or a segment temp file of the chain is locked or young
    (a writer between creating it and locking it, or rotating right now).
    """
    candidates = [os.path.join(directory, segment_name(writer_id, last_index))]
    candidates.extend(
        os.path.join(directory, name)
        for name in os.listdir(directory)
        if name.startswith(writer_id + "-") and name.endswith(SEGMENT_SUFFIX + TMP_SUFFIX)
    )
    for path in candidates:
        try:
            fd = ops.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            if path.endswith(TMP_SUFFIX) and time.time() - os.fstat(fd).st_mtime < STALE_TMP_S:
                return True
            try:
                ops.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            ops.flock(fd, fcntl.LOCK_UN)
        finally:
            ops.close(fd)
    return False


_LIVE_WRITER = "a live journal writer (a running producer); stop it, then run the repair again"


def _check_not_live(ops: FileOps, directory: str, plan: _ChainPlan) -> None:
    """Refuse a plan that would touch a live writer's segment, or its chain's end."""
    touches_end = bool(plan.removals) or any(c.index == plan.last_index for c in plan.cuts)
    if touches_end and _chain_is_live(ops, directory, plan.writer_id, plan.last_index):
        last = os.path.join(directory, segment_name(plan.writer_id, plan.last_index))
        raise JournalLocked(last, _LIVE_WRITER)


# -- applying ---------------------------------------------------------------------------------


def _fail(path: str, op: str, exc: OSError) -> JournalIOError:
    return JournalIOError(path, op, exc)


def _make_backup_dir(ops: FileOps, directory: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for attempt in range(1000):
        name = BACKUP_PREFIX + stamp + (f"-{attempt}" if attempt else "")
        backup = os.path.join(directory, name)
        try:
            os.mkdir(backup, 0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _fail(backup, "mkdir", exc) from exc
        try:
            ops.fsync_dir(directory)  # rule 5: the new directory entry is durable
        except OSError as exc:
            raise _fail(directory, "directory fsync", exc) from exc
        return backup
    raise JournalIOError(directory, "mkdir", FileExistsError(17, "too many repair backups this second"))


def _copy(ops: FileOps, src_fd: int, dest: str, size: int, *, mode: int | None) -> int:
    """Copy ``size`` bytes of ``src_fd`` into a new file ``dest``; returns its (open, append) fd.

    The copy is fsync'd, and made ``mode`` first when given. The caller closes the fd.
    """
    op = "create"
    try:
        out = ops.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
    except OSError as exc:
        raise _fail(dest, op, exc) from exc
    try:
        op = "write"
        done = 0
        while done < size:
            chunk = os.pread(src_fd, min(_CHUNK_BYTES, size - done), done) or _shrank()
            write_all(ops, out, chunk)
            done += len(chunk)
        if mode is not None:
            op = "chmod"
            ops.fchmod(out, mode)
        op = "fsync"
        ops.fsync(out)
    except OSError as exc:
        ops.close(out)
        raise _fail(dest, op, exc) from exc
    return out


def _shrank() -> bytes:
    # The source is locked and was checked unchanged: only damage can make it shrink now.
    raise OSError(5, "file shrank while being copied")


def _check_unchanged(ops: FileOps, path: str, fd: int, fid: _FileId) -> None:
    try:
        ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise JournalLocked(path, _LIVE_WRITER) from None
    if _FileId.of(os.fstat(fd)) != fid:
        raise JournalLocked(path, "a process that changed it during the repair; run the repair again")


def _lock_unchanged(ops: FileOps, path: str, fid: _FileId) -> int:
    """Open and exclusively lock a segment that must be as the scan saw it; returns the fd."""
    try:
        fd = ops.open(path, os.O_RDONLY)
    except OSError as exc:
        raise _fail(path, "open", exc) from exc
    try:
        _check_unchanged(ops, path, fd, fid)
    except BaseException:
        ops.close(fd)
        raise
    return fd


def _apply_chain(ops: FileOps, directory: str, backup: str, plan: _ChainPlan) -> None:
    """Move the chain's dropped segments into the backup, last first, then cut and seal.

    Every step leaves a journal that is either repaired or still refused (never one that hides
    a loss): segments go from the chain's end, and a cut segment is replaced atomically by a
    sealed copy of its good prefix (temp file, fsync, rename, directory fsync; docs/reliability.md
    rules 5 and 6) after the original is copied into the backup.
    """
    indices = list_chains(directory).get(plan.writer_id, [])
    if not indices or indices[-1] != plan.last_index:
        raise JournalLocked(
            os.path.join(directory, segment_name(plan.writer_id, plan.last_index)),
            "a writer that changed the chain during the repair; run the repair again",
        )
    fds: dict[str, int] = {}
    try:
        for path, fid in [*plan.removals, *((c.path, c.fid) for c in plan.cuts)]:
            fds[path] = _lock_unchanged(ops, path, fid)
        for path, _ in reversed(plan.removals):
            dest = os.path.join(backup, os.path.basename(path))
            op = "rename"
            try:
                ops.replace(path, dest)
                op = "directory fsync"
                ops.fsync_dir(backup)
                ops.fsync_dir(directory)
            except OSError as exc:
                raise _fail(path, op, exc) from exc
        for cut in reversed(plan.cuts):
            src = fds[cut.path]
            name = os.path.basename(cut.path)
            original = os.path.join(backup, name)
            ops.close(_copy(ops, src, original, cut.fid.size, mode=stat.S_IMODE(cut.fid.mode)))
            tmp = os.path.join(backup, name + ".new")
            out = _copy(ops, src, tmp, cut.offset, mode=None)
            try:
                seal_fd(ops, out, cut.seed, cut.seal_seq, cut.last_data_seq, cut.data_count)
            except SealError as exc:
                raise _fail(tmp, exc.op, exc.cause) from exc.cause
            finally:
                ops.close(out)
            op = "directory fsync"
            try:
                ops.fsync_dir(backup)  # the original's copy is durable before it is replaced
                op = "rename"
                ops.replace(tmp, cut.path)
                op = "directory fsync"
                ops.fsync_dir(directory)
                ops.fsync_dir(backup)
            except OSError as exc:
                raise _fail(cut.path, op, exc) from exc
    finally:
        for fd in fds.values():
            with contextlib.suppress(OSError):
                ops.close(fd)


def _write_report(ops: FileOps, backup: str, report: RepairReport) -> None:
    path = os.path.join(backup, REPORT_NAME)
    op = "create"
    try:
        fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            op = "write"
            write_all(ops, fd, json.dumps(report.to_dict(), indent=1).encode() + b"\n")
            op = "fsync"
            ops.fsync(fd)
        finally:
            ops.close(fd)
        op = "directory fsync"
        ops.fsync_dir(backup)
    except OSError as exc:
        raise _fail(path, op, exc) from exc


@contextlib.contextmanager
def _forwarder_lock(ops: FileOps, directory: str, *, create: bool) -> Iterator[None]:
    """Hold the journal's forwarder lock (and its parent's, for a ledger) for the repair.

    ``create``: create the lock file when missing (a forwarder would). A dry run does not: with
    no lock file there is no forwarder to keep out, and a dry run must not add a file.
    """
    locks = [os.path.join(directory, FORWARDER_LOCK_NAME)]
    if os.path.basename(directory) == _LEDGER_DIR:
        locks.append(os.path.join(os.path.dirname(directory), FORWARDER_LOCK_NAME))
    fds: list[int] = []
    try:
        for n, lock in enumerate(locks):
            mine = create and n == 0
            try:
                fd = ops.open(lock, os.O_RDWR | os.O_CREAT if mine else os.O_RDONLY, 0o600)
            except FileNotFoundError:
                continue
            fds.append(fd)
            try:
                ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
                raise JournalLocked(lock, f"{holder} (stop the forwarder before repairing)") from None
            if mine:
                # Who holds it, for `hybridq status` and a forwarder that tries to start.
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"journal repair pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                ops.close(fd)


def _summary(plan: _ChainPlan) -> ChainRepair:
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


def repair(
    path: str | os.PathLike[str],
    *,
    accept_loss: bool,
    progress: Callable[[int], None] | None = None,
    fileops: FileOps = OS_FILEOPS,
) -> RepairReport:
    """Find mid-file corruption and, with ``accept_loss``, cut it out; report exactly what goes.

    Holds the journal's forwarder lock throughout (no forwarder reads while it runs) and never
    touches a segment a live writer holds. Without ``accept_loss`` it only reads: the report says
    what a repair would drop. With it, every file changed or removed is first copied or moved
    into ``<journal>/repair-backup-<timestamp>/`` (``repair-report.json`` in it is written before
    the first change), and the journal is left so that :func:`~hybridq.journal.recovery.verify`
    accepts it. A journal without corruption is left as it is (torn tails are
    :func:`~hybridq.journal.recovery.recover`'s job).

    Args:
        path: the journal directory (or a ledger directory inside one).
        accept_loss: make the changes (``False``: a dry run).
        progress: called with the number of bytes just scanned (for a progress bar over the
            total size of the segment files).
        fileops: the file-operations seam.

    Raises:
        JournalLocked: a forwarder holds the journal, or a damaged chain's writer is live (or
            changed the chain during the repair). Nothing was changed for that chain.
        JournalPathError: the path is not a usable journal directory.
        JournalIOError: a file operation failed; the journal is either repaired or still
            refused, and the backup holds every original already touched.
    """
    directory = existing_journal_dir(path)
    report = RepairReport(directory, accept_loss)
    with _forwarder_lock(fileops, directory, create=accept_loss):
        chains = list_chains(directory)
        report.chains = len(chains)
        plans = []
        for writer_id, indices in chains.items():
            plan = _plan_chain(fileops, directory, writer_id, indices, report, progress)
            if plan.damage is not None:
                plans.append(plan)
        for plan in plans:
            _check_not_live(fileops, directory, plan)
        report.repairs = [_summary(plan) for plan in plans]
        if not accept_loss or not plans:
            return report
        report.backup = _make_backup_dir(fileops, directory)
        # Written first, so that the backup says what it holds even if the repair is cut short.
        _write_report(fileops, report.backup, report)
        for plan, summary in zip(plans, report.repairs, strict=True):
            _apply_chain(fileops, directory, report.backup, plan)
            report.applied = True
            log.warning(
                "journal repair: chain %s: %s at offset %d (%s): %d data records and %d bytes dropped; "
                "backup in %s",
                plan.writer_id,
                summary.path,
                summary.offset,
                summary.reason,
                summary.data_records_dropped,
                summary.bytes_dropped,
                report.backup,
            )
    return report
