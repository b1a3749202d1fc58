"""Streaming reads of a journal directory, with the torn-tail / corruption policy of the format.

Format and policy: ``docs/journal-format.md`` (*Torn tail and corruption*). Memory is bounded by
one read chunk plus one record, however large the journal. This module never writes; repairing a
torn tail is :mod:`hybridq.journal.recovery`'s job.

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import stat
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import crc32c as _crc32c_module

from hybridq.errors import JournalCorruption, JournalPathError

from .fileops import OS_FILEOPS, FileOps
from .format import (
    FILE_HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    SEAL_PAYLOAD_SIZE,
    SEAL_RECORDS,
    HeaderError,
    RecordType,
    SegmentHeader,
    crc32c,
    decode_segment_header,
    parse_segment_name,
    salt_seed,
    segment_name,
)
from .paths import existing_journal_dir

__all__ = ["ChainPosition", "JournalReader", "Record", "SegmentInfo", "TornTail", "list_chains"]

_CHUNK_BYTES = 1 << 20
_SEAL = int(RecordType.SEAL)
# crc, length, sequence, and one word: type (low byte), unsynced distance (the other 24 bits)
_unpack_raw_header = RECORD_HEADER.unpack_from
_crc32c_raw = _crc32c_module.crc32c  # the C function itself: one Python call less per record


class ChainPosition(NamedTuple):
    """Where reading of one chain resumes: just after the last record consumed."""

    segment: int
    offset: int
    next_seq: int

    def to_json(self) -> list[int]:
        """A compact JSON-able form (for checkpoints)."""
        return [self.segment, self.offset, self.next_seq]

    @classmethod
    def from_json(cls, value: list[int]) -> ChainPosition:
        """Inverse of :meth:`to_json`."""
        segment, offset, next_seq = value
        return cls(int(segment), int(offset), int(next_seq))


class Record(NamedTuple):
    """One data record as read back from the journal."""

    writer_id: str
    seq: int
    rtype: int
    payload: bytes
    segment_index: int
    offset: int
    #: Offset just past the record.
    end: int

    @property
    def position(self) -> ChainPosition:
        """Where reading of this chain resumes after this record."""
        return ChainPosition(self.segment_index, self.end, self.seq + 1)


@dataclass(frozen=True, slots=True)
class TornTail:
    """A torn tail found at the end of a dead writer's last segment (not an error)."""

    path: str
    offset: int
    dropped_bytes: int
    next_seq: int
    #: Valid-looking records inside the dropped bytes: written, never durable, out of order.
    unsynced_records: int = 0


@dataclass(slots=True)
class _Later:
    """Valid records found after a bad one (see ``_SegmentScan._later_records``)."""

    offset: int
    seq: int
    max_synced_seq: int
    count: int


@dataclass(slots=True)
class SegmentInfo:
    """What a scan learned about one segment it read to its end."""

    path: str
    writer_id: str
    index: int
    salt: bytes
    first_seq: int
    end_offset: int = FILE_HEADER_SIZE
    next_seq: int = 0
    data_count: int = 0
    last_data_seq: int = 0
    sealed: bool = False
    live: bool = False
    torn: TornTail | None = None


def list_chains(path: str) -> dict[str, list[int]]:
    """Segment indices of every chain in the journal directory, sorted."""
    chains: dict[str, list[int]] = {}
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise JournalPathError(path, exc.strerror or str(exc)) from exc
    for name in names:
        parsed = parse_segment_name(name)
        if parsed is not None:
            chains.setdefault(parsed[0], []).append(parsed[1])
    for indices in chains.values():
        indices.sort()
    return dict(sorted(chains.items()))


class JournalReader:
    """Reads every chain of a journal directory from a position, record by record.

    Args:
        path: an existing journal directory.
        fileops: the file-operations seam.
        chunk_bytes: read size; memory use is about one chunk plus one record.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fileops: FileOps = OS_FILEOPS,
        chunk_bytes: int = _CHUNK_BYTES,
    ) -> None:
        self.path = existing_journal_dir(path)
        self._ops = fileops
        self._chunk = max(chunk_bytes, 4096)
        self._positions: dict[str, ChainPosition] = {}  # as of the end of a segment
        self._last: dict[str, Record] = {}  # last record yielded since, per chain
        #: Torn tails seen by the last scan (dead writers' last segments).
        self.torn_tails: list[TornTail] = []
        #: The last segment of each chain as of the last scan.
        self.chain_ends: dict[str, SegmentInfo] = {}
        #: Data records counted by the last :meth:`check`.
        self.records_checked = 0
        #: Called with the number of bytes just read, for progress bars.
        self.on_bytes: Callable[[int], None] | None = None

    def records(self, since: Mapping[str, ChainPosition] | None = None) -> Iterator[Record]:
        """Yield every data record after a position, chain by chain.

        ``since`` replaces the reader's position; without it the scan continues from where the
        last one stopped (from the very start, the first time). Call again to tail the journal.
        Raises :class:`JournalCorruption` on damage; records before it have been yielded, the
        damaged one never is.
        """
        return self._scan(since, emit=True)

    def check(self, since: Mapping[str, ChainPosition] | None = None) -> int:
        """Like :meth:`records`, but only checks and counts them (the fast path of verify)."""
        self.records_checked = 0
        for _ in self._scan(since, emit=False):  # pragma: no cover - yields nothing
            pass
        return self.records_checked

    def _scan(self, since: Mapping[str, ChainPosition] | None, *, emit: bool) -> Iterator[Record]:
        self._positions = dict(since) if since is not None else self.position
        self._last = {}
        self.torn_tails = []
        self.chain_ends = {}
        for writer_id, indices in list_chains(self.path).items():
            yield from self._read_chain(writer_id, indices, emit)

    def seek(self, positions: Mapping[str, ChainPosition]) -> None:
        """Make the next :meth:`records` start at ``positions`` (chains not named: at their start)."""
        self._positions = dict(positions)
        self._last = {}

    @property
    def position(self) -> dict[str, ChainPosition]:
        """Per chain, the position just after the last record yielded (or segment consumed)."""
        merged = dict(self._positions)
        for writer_id, rec in self._last.items():
            merged[writer_id] = rec.position
        return merged

    def _read_chain(self, writer_id: str, indices: list[int], emit: bool) -> Iterator[Record]:
        pos = self._positions.get(writer_id)
        start_index = pos.segment if pos is not None else indices[0]
        todo = [i for i in indices if i >= start_index]
        if not todo:
            return
        for prev, cur in itertools.pairwise(todo):
            if cur != prev + 1:
                missing = os.path.join(self.path, segment_name(writer_id, prev + 1))
                raise JournalCorruption(missing, 0, f"segment index {prev + 1} of the chain is missing")
        prev_salt: bytes | None = None
        expected_seq: int | None = None
        offset = FILE_HEADER_SIZE
        if pos is not None and pos.segment == todo[0]:
            offset, expected_seq = pos.offset, pos.next_seq
        if todo[0] > 0 and (pos is None or pos.segment != todo[0] or offset == FILE_HEADER_SIZE):
            prev_salt = self._previous_salt(writer_id, todo[0] - 1)
        for n, index in enumerate(todo):
            is_last = n == len(todo) - 1
            info = yield from self._read_segment(
                writer_id, index, offset, expected_seq, prev_salt, is_last, emit
            )
            self._last.pop(writer_id, None)
            self.records_checked += info.data_count
            self._positions[writer_id] = ChainPosition(index, info.end_offset, info.next_seq)
            prev_salt, expected_seq, offset = info.salt, info.next_seq, FILE_HEADER_SIZE
            if is_last:
                self.chain_ends[writer_id] = info
                if info.torn is not None:
                    self.torn_tails.append(info.torn)
            if info.sealed:
                # Resume at the next segment's start once this one is fully consumed.
                self._positions[writer_id] = ChainPosition(index + 1, FILE_HEADER_SIZE, info.next_seq)

    def _previous_salt(self, writer_id: str, index: int) -> bytes | None:
        """Salt of an earlier segment if it is still there (it may have been compacted away)."""
        try:
            fd = self._ops.open(os.path.join(self.path, segment_name(writer_id, index)), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return decode_segment_header(self._ops.read(fd, FILE_HEADER_SIZE)).salt
        except HeaderError:
            return None  # reported when that segment itself is read
        finally:
            self._ops.close(fd)

    def _read_segment(
        self,
        writer_id: str,
        index: int,
        offset: int,
        expected_seq: int | None,
        prev_salt: bytes | None,
        is_last: bool,
        emit: bool,
    ) -> Generator[Record, None, SegmentInfo]:
        path = os.path.join(self.path, segment_name(writer_id, index))
        fd = self._ops.open(path, os.O_RDONLY)
        try:
            scan = _SegmentScan(self, fd, path, writer_id, index, is_last, emit)
            header = scan.read_header(prev_salt, expected_seq if offset == FILE_HEADER_SIZE else None)
            info = SegmentInfo(path, writer_id, index, header.salt, header.first_seq)
            yield from scan.run(info, offset, expected_seq or header.first_seq)
            return info
        finally:
            self._ops.close(fd)


class _SegmentScan:
    """Parses one open segment file; the policy of the format spec lives in :meth:`_anomaly`."""

    def __init__(
        self,
        reader: JournalReader,
        fd: int,
        path: str,
        writer_id: str,
        index: int,
        is_last: bool,
        emit: bool,
    ) -> None:
        self.reader = reader
        self.ops = reader._ops
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

    def corruption(
        self, offset: int, reason: str, first: int | None, last: int | None = None
    ) -> JournalCorruption:
        return JournalCorruption(self.path, offset, reason, first_seq=first, last_seq=last)

    def read_header(self, prev_salt: bytes | None, expected_first: int | None) -> SegmentHeader:
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
        fd, ops, seed, chunk = self.fd, self.ops, self.seed, self.reader._chunk
        emit, writer_id, index = self.emit, self.writer_id, self.index
        on_bytes = self.reader.on_bytes
        last = self.reader._last
        unpack = _unpack_raw_header
        crc = _crc32c_raw
        os.lseek(fd, offset, os.SEEK_SET)
        buf = b""
        view = memoryview(buf)
        base = offset  # file offset of buf[0]; the fd's offset is always base + len(buf)
        p = 0  # position in buf
        seals = 0
        seal_off = seal_seq = 0  # where the first seal record starts, and its sequence number
        while True:
            off = base + p
            bad: str | None = None
            if off >= self.size:
                if seals != 1:
                    break
                bad = "seal incomplete"  # one seal, then the end: the writer died while sealing
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
                    if length > MAX_PAYLOAD_BYTES:
                        bad = "impossible record length"
                    elif not type_word >> 8:
                        bad = "unsynced distance is zero"
                    elif rtype != _SEAL and not 1 <= rtype <= 127:
                        bad = "invalid record type"
                    elif crc(view[p + 4 : end], seed) != crc_stored:
                        bad = "checksum mismatch"
                    elif seq != expected:
                        if seq > expected:
                            raise self.corruption(off, "sequence gap", expected, seq - 1)
                        raise self.corruption(
                            off, f"sequence number goes backwards ({seq} after {expected - 1})", seq
                        )
            if bad is not None:
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
                    seal_off, seal_seq = off, seq
                seals += 1
            elif seals:
                raise self.corruption(off, "data record after a seal", seq)
            else:
                info.data_count += 1
                info.last_data_seq = seq
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
            info.sealed = True
            return
        if self.read_only:
            raise self.corruption(
                info.end_offset, "sealed (read-only) segment ends without its seal", expected
            )
        if not self.is_last:
            raise self.corruption(
                info.end_offset, "segment is not sealed but a later segment exists", expected
            )
        info.live = self._writer_alive()

    def _writer_alive(self) -> bool:
        """Whether the chain's writer still holds its flock on this segment."""
        try:
            self.ops.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        self.ops.flock(self.fd, fcntl.LOCK_UN)
        return False

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
        later = self._later_records(off, expected)
        # Tell a writer that is still appending from one that died: hold its lock while we look.
        try:
            self.ops.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
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
        try:
            st = os.fstat(self.fd)
            if st.st_size != self.size or not st.st_mode & stat.S_IWUSR:
                # The writer appended (and maybe sealed) after our snapshot, then let go.
                self.size = st.st_size
                self.read_only = not (st.st_mode & stat.S_IWUSR)
                return True
        finally:
            self.ops.flock(self.fd, fcntl.LOCK_UN)
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

    def _later_records(self, bad_off: int, expected: int) -> _Later | None:
        """Valid records of this segment after ``bad_off``: the first, their count, their frontier.

        Runs only on an anomaly. Byte by byte until a valid record is found (candidates are
        filtered by a plausible sequence number before their checksum is computed; the salted CRC
        makes a false match about 2**-32 per candidate), then record by record.
        """
        remaining = self.size - bad_off
        max_seq = expected + remaining // RECORD_HEADER_SIZE + 1
        found: _Later | None = None
        pos = bad_off + 1
        window, window_at = b"", pos  # a chunk of the file, read ahead, starting at window_at
        while pos + RECORD_HEADER_SIZE <= self.size:
            if pos + RECORD_HEADER_SIZE > window_at + len(window):
                window, window_at = self._read_at(pos, self.reader._chunk), pos
            _, length, seq, type_word = _unpack_raw_header(window, pos - window_at)
            rtype, distance = type_word & 0xFF, type_word >> 8
            end = pos + RECORD_HEADER_SIZE + length
            if (
                expected <= seq <= max_seq
                and distance
                and length <= MAX_PAYLOAD_BYTES
                and (rtype == _SEAL or 1 <= rtype <= 127)
                and end <= self.size
            ):
                rec = self._read_at(pos, RECORD_HEADER_SIZE + length)
                if crc32c(memoryview(rec)[4:], self.seed) == int.from_bytes(rec[:4], "little"):
                    if found is None:
                        found = _Later(pos, seq, seq - distance, 0)
                    found.count += 1
                    found.max_synced_seq = max(found.max_synced_seq, seq - distance)
                    pos = end  # hop to the next record
                    continue
            pos += 1
        return found

    def _read_at(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset)


def read_record_at(
    path: str, writer_id: str, segment: int, offset: int, *, fileops: FileOps = OS_FILEOPS
) -> Record:
    """Read back one record by its location, checking its checksum (for held, delayed jobs).

    Raises :class:`JournalCorruption` when the bytes there are not a valid record of that segment.
    """
    seg_path = os.path.join(path, segment_name(writer_id, segment))
    fd = fileops.open(seg_path, os.O_RDONLY)
    try:
        try:
            header = decode_segment_header(os.pread(fd, FILE_HEADER_SIZE, 0))
        except HeaderError as exc:
            raise JournalCorruption(seg_path, 0, str(exc)) from None
        head = os.pread(fd, RECORD_HEADER_SIZE, offset)
        if len(head) < RECORD_HEADER_SIZE:
            raise JournalCorruption(seg_path, offset, "no record at this offset")
        crc, length, seq, type_word = _unpack_raw_header(head)
        if length > MAX_PAYLOAD_BYTES:
            raise JournalCorruption(seg_path, offset, "impossible record length")
        payload = os.pread(fd, length, offset + RECORD_HEADER_SIZE)
        if len(payload) != length or crc32c(payload, crc32c(head[4:], salt_seed(header.salt))) != crc:
            raise JournalCorruption(seg_path, offset, "checksum mismatch", first_seq=seq)
        end = offset + RECORD_HEADER_SIZE + length
        return Record(writer_id, seq, type_word & 0xFF, payload, segment, offset, end)
    finally:
        fileops.close(fd)
