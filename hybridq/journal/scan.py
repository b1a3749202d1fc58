"""Parsing one segment file: framing, checksums, sequence numbers and the torn-tail policy.

The policy is ``docs/journal-format.md`` (*Torn tail and corruption*); it lives in
:meth:`SegmentScan._anomaly`; the search for valid records after a bad one is
:mod:`hybridq.journal.scan_search`'s. Used by :class:`~hybridq.journal.reader.JournalReader`.

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable, Generator

from hybridq.errors import JournalCorruption

from .fileops import FileOps
from .format import (
    FILE_HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    MAX_UNSYNCED_DISTANCE,
    RECORD_HEADER_SIZE,
    SEAL_PAYLOAD_SIZE,
    SEAL_RECORDS,
    HeaderError,
    RecordType,
    SegmentHeader,
    decode_segment_header,
    record_problem,
    salt_seed,
)
from .holes import Hole, hole_at, holes_of
from .records import Record, SegmentInfo, TornTail
from .scan_search import later_records, unpack_header

__all__ = ["SegmentScan"]

_SEAL = int(RecordType.SEAL)


class SegmentScan:
    """Parses one open segment file; the policy of the format spec lives in :meth:`_anomaly`."""

    def __init__(
        self,
        ops: FileOps,
        fd: int,
        path: str,
        writer_id: str,
        index: int,
        is_last: bool,
        emit: bool,
        *,
        chunk: int,
        last: dict[str, Record],
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        self.ops = ops
        self.chunk = chunk
        self.last = last  # the reader's "last record yielded, per chain"
        self.on_bytes = on_bytes
        self.fd = fd
        self.path = path
        self.writer_id = writer_id
        self.index = index
        self.is_last = is_last
        self.emit = emit
        st = os.fstat(fd)
        self.size = st.st_size
        self.read_only = not (st.st_mode & stat.S_IWUSR)
        self.seed = 0
        #: Punched ranges of finished records, skipped as compacted ones (hybridq.journal.holes).
        #: Only a sealed segment has any: a chain's unsealed tail (read on every forward step)
        #: does not look its map up (a segment that is not its chain's last is sealed).
        self.holes = holes_of(path, fileops=ops) if self._sealed() else ()

    def corruption(
        self, offset: int, reason: str, first: int | None, last: int | None = None
    ) -> JournalCorruption:
        """A :class:`JournalCorruption` about this segment."""
        return JournalCorruption(self.path, offset, reason, first_seq=first, last_seq=last)

    def read_header(self, prev_salt: bytes | None, expected_first: int | None) -> SegmentHeader:
        """Read and check the file header against the name, the previous salt and sequence."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        raw = self.ops.read(self.fd, FILE_HEADER_SIZE)
        try:
            header = decode_segment_header(raw)
        except HeaderError as exc:
            raise self.corruption(0, str(exc), expected_first) from None
        if header.writer_id != self.writer_id or header.index != self.index:
            raise self.corruption(0, "file header does not match the file name", expected_first)
        if prev_salt is not None and header.prev_salt != prev_salt:
            raise self.corruption(0, "salt mismatch with the previous segment of the chain", expected_first)
        if expected_first is not None and header.first_seq != expected_first:
            first, last = sorted((expected_first, header.first_seq - 1))
            raise self.corruption(0, "sequence gap between segments", first, last)
        self.seed = salt_seed(header.salt)
        return header

    def run(self, info: SegmentInfo, offset: int, expected: int) -> Generator[Record, None, None]:
        """Yield the segment's data records from ``offset``; fill in ``info`` at the end."""
        fd, ops, seed, chunk = self.fd, self.ops, self.seed, self.chunk
        emit, writer_id, index = self.emit, self.writer_id, self.index
        on_bytes = self.on_bytes
        last = self.last
        unpack = unpack_header
        problem = record_problem
        os.lseek(fd, offset, os.SEEK_SET)
        buf = b""
        view = memoryview(buf)
        base = offset  # file offset of buf[0]; the fd's offset is always base + len(buf)
        p = 0  # position in buf
        seals = 0
        # Where the first seal record starts, its sequence number, and the chain's sequence it
        # states durable (from its unsynced distance); the type word of the last data record.
        seal_off = seal_seq = seal_synced = data_word = 0
        holes = [h for h in self.holes if h.end > offset]
        if holes and holes[0].start < offset:  # resuming inside a punched range: after it
            expected, offset = self._skip(info, holes.pop(0), expected)
            base = offset
            os.lseek(fd, offset, os.SEEK_SET)
        next_hole = holes[0].start if holes else -1
        while True:
            off = base + p
            bad: str | None = None
            if off >= next_hole >= 0:
                hole = holes.pop(0)
                self._check_hole(hole, off, expected)
                expected, base = self._skip(info, hole, expected)
                buf, p = b"", 0
                view = memoryview(buf)
                os.lseek(fd, base, os.SEEK_SET)
                next_hole = holes[0].start if holes else -1
                continue
            if off >= self.size:
                if seals == 1:
                    bad = "seal incomplete"  # one seal, then the end: the writer died while sealing
                elif seals >= SEAL_RECORDS or self.read_only or not self.is_last:
                    break
                else:
                    # A clean end of the last, unsealed segment: is its writer still there?
                    state = self._settle()
                    if state == "changed":
                        continue  # it appended (or sealed) after our snapshot: read on
                    info.live = state == "live"
                    break
            else:
                avail = len(buf) - p
                if avail >= RECORD_HEADER_SIZE:
                    crc_stored, length, seq, type_word = unpack(buf, p)
                    need = RECORD_HEADER_SIZE + length if length <= MAX_PAYLOAD_BYTES else RECORD_HEADER_SIZE
                else:
                    need = RECORD_HEADER_SIZE
                if avail < need:
                    # Refill: keep the unread tail, read at least what this record needs.
                    want = min(max(chunk, need), self.size - off)
                    data = ops.read(fd, max(0, want - avail))
                    if on_bytes is not None:
                        on_bytes(len(data))
                    buf, base, p = buf[p:] + data, off, 0
                    view = memoryview(buf)
                    if len(buf) >= need:
                        continue
                    # Cut off by the end of the file (as far as our snapshot of its size goes).
                    bad = "record runs past the end of the file"
                else:
                    end = p + need
                    rtype = type_word & 0xFF
                    bad = problem(crc_stored, length, type_word, view[p + 4 : end], seed)
                    if bad is None and seq != expected:
                        if seq > expected:
                            raise self.corruption(off, "sequence gap", expected, seq - 1)
                        raise self.corruption(
                            off, f"sequence number goes backwards ({seq} after {expected - 1})", seq
                        )
            if bad is not None:
                late = self._punched_since(off) if not seals else None
                if late is not None:
                    # Punched while we read (its map was written first): skip the rest of it.
                    holes = [h for h in self.holes if h.start > off]
                    next_hole = holes[0].start if holes else -1
                    expected, base = self._skip(info, late, expected)
                    buf, p = b"", 0
                    view = memoryview(buf)
                    os.lseek(fd, base, os.SEEK_SET)
                    continue
                if seals >= SEAL_RECORDS:
                    raise self.corruption(off, f"bytes after the seal ({bad})", expected)
                # A partial seal is torn as a whole: recovery truncates it and seals afresh.
                if seals == 1:
                    off, expected = seal_off, seal_seq
                if not self._anomaly(info, off, expected, bad):
                    return
                # The writer appended after our snapshot and let go: read on from ``off``.
                buf, base, p, seals = b"", off, 0, 0
                view = memoryview(buf)
                os.lseek(fd, off, os.SEEK_SET)
                continue
            if seals >= SEAL_RECORDS:
                raise self.corruption(off, "bytes after the seal", seq)
            if rtype == _SEAL:
                if length != SEAL_PAYLOAD_SIZE:
                    raise self.corruption(off, "malformed seal record", expected)
                if not seals:
                    seal_off, seal_seq, seal_synced = off, seq, _frontier(seq, type_word, info)
                seals += 1
            elif seals:
                raise self.corruption(off, "data record after a seal", seq)
            else:
                info.data_count += 1
                info.last_data_seq = seq
                data_word = type_word
                if emit:
                    rec = Record(
                        writer_id, seq, rtype, buf[p + RECORD_HEADER_SIZE : end], index, off, base + end
                    )
                    last[writer_id] = rec
                    yield rec
            expected = seq + 1
            p = end
        info.end_offset = base + p
        info.next_seq = expected
        if seals >= SEAL_RECORDS:
            if holes:  # a range past the seal: a map written by hand, or restored (a punch refuses it)
                raise self.corruption(
                    seal_off, "hole map range past the segment's seal", seal_seq, seal_seq + SEAL_RECORDS - 1
                )
            info.sealed = True
            info.seal_offset, info.seal_synced_seq = seal_off, seal_synced
            info.data_synced_seq = _frontier(info.last_data_seq, data_word, info)
            return
        if self.read_only:
            raise self.corruption(
                info.end_offset, "sealed (read-only) segment ends without its seal", expected
            )
        if not self.is_last:
            raise self.corruption(
                info.end_offset, "segment is not sealed but a later segment exists", expected
            )

    @staticmethod
    def _skip(info: SegmentInfo, hole: Hole, expected: int) -> tuple[int, int]:
        """Skip the rest of ``hole`` from sequence ``expected``: count its records, return where to read on.

        The one place a scan skips punched records (before a range, resuming inside one, or one
        punched while we read): they count as data records, as the seal does
        (docs/journal-format.md, hole maps). Returns the next sequence and the offset after the range.
        """
        skipped = hole.next_seq - expected
        info.data_count += skipped
        info.punched += skipped
        info.last_data_seq = hole.next_seq - 1
        return hole.next_seq, hole.end

    def _punched_since(self, off: int) -> Hole | None:
        """The range punched since this scan started that holds the record at ``off``, if any.

        Another process (the layer above) may punch a sealed segment while we read it; it writes
        the map first, so bad bytes at a record the map now lists are that punch, not damage.
        """
        # Whatever the mode: a scan that opened the segment while the punch held it writable
        # (hybridq.journal.holes._writable) did not look the map up. Only on bad bytes: rare.
        self.holes = holes_of(self.path, fileops=self.ops)
        return hole_at(self.holes, off)

    def _sealed(self) -> bool:
        """Whether this segment may have a hole map: read-only, or followed by another segment.

        Not only read-only: the punch opens a sealed segment after a ``chmod u+w`` and puts 0400
        back at once (hybridq.journal.holes); a scan that looked in between and meets a punched
        range reads the map then (:meth:`_punched_since`).
        """
        return self.read_only or not self.is_last

    def _check_hole(self, hole: Hole, off: int, expected: int) -> None:
        """Raise unless ``hole`` starts at the record at ``off``, the one due (``expected``)."""
        if hole.start != off:
            raise self.corruption(
                off, f"hole map range at offset {hole.start} does not start at a record", expected
            )
        if hole.first_seq != expected:
            raise self.corruption(
                off, f"hole map range at offset {off} starts at sequence {hole.first_seq}", expected
            )
        if hole.end > self.size:
            raise self.corruption(off, "hole map range runs past the end of the file", expected)

    def _settle(self) -> str:
        """Whether the segment's writer is ``live``, ``dead``, or the file ``changed`` meanwhile.

        ``live``: the writer holds its flock. ``changed``: it appended or sealed after our
        snapshot of the size, then let go (read on). ``dead``: unlocked and unchanged.
        """
        try:
            self.ops.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "live"
        try:
            st = os.fstat(self.fd)
            if st.st_size != self.size or not st.st_mode & stat.S_IWUSR:
                self.size = st.st_size
                self.read_only = not (st.st_mode & stat.S_IWUSR)
                return "changed"
        finally:
            self.ops.flock(self.fd, fcntl.LOCK_UN)
        return "dead"

    def _anomaly(self, info: SegmentInfo, off: int, expected: int, reason: str) -> bool:
        """Decide what a bad or cut-off record at ``off`` is. Returns True to re-read from ``off``.

        The policy of ``docs/journal-format.md``: in a sealed or non-last segment it is
        corruption. In the last segment it is corruption if any valid record of the chain comes
        after it. Otherwise it is a torn tail: a live writer is mid-append (stop here, read it
        next time); a dead writer crashed mid-append (report it; recovery truncates it).
        """
        info.end_offset, info.next_seq = off, expected
        if self.read_only or not self.is_last:
            raise self.corruption(off, f"{reason} in a sealed segment", expected)
        later = later_records(self.fd, self.size, self.chunk, self.seed, off, expected)
        # Tell a writer that is still appending from one that died.
        state = self._settle()
        if state == "live":
            if later is not None:
                # A live writer appends in order: valid records after a bad one are damage.
                raise self.corruption(
                    off,
                    f"{reason}, followed by a valid record at offset {later.offset}",
                    expected,
                    later.seq - 1 if later.seq > expected else None,
                ) from None
            info.live = True
            return False  # a record still being written; picked up by the next scan
        if state == "changed":
            return True  # the writer appended (and maybe sealed) after our snapshot, then let go
        if later is not None and later.max_synced_seq >= expected:
            # A later record was written when this one was already durable: real damage.
            raise self.corruption(
                off,
                f"{reason}, followed by a valid record at offset {later.offset} "
                "written after this one was durable",
                expected,
                later.seq - 1 if later.seq > expected else None,
            )
        # Either nothing valid follows (a crash mid-append), or everything valid that follows
        # was written before this record was durable: power loss persisted unsynced pages out
        # of order. Nothing from here on was ever acknowledged.
        info.torn = TornTail(
            self.path, off, self.size - off, expected, later.count if later is not None else 0
        )
        return False


def _frontier(seq: int, type_word: int, info: SegmentInfo) -> int:
    """The last sequence number the record ``seq`` states its writer had fsynced (*Record*).

    ``first_seq - 1`` when that is not known: no such record (a type word of 0), or a distance
    stored at its cap (the real one may be larger). The writer's own frontier starts there.
    """
    distance = type_word >> 8
    return seq - distance if 0 < distance < MAX_UNSYNCED_DISTANCE else info.first_seq - 1
