"""Reads of one record by its location, and of a segment's seal, without a scan.

A caller that kept a record's location reads it back here, and asks where a sealed segment's
data ends. Apart from :mod:`hybridq.journal.reader` (the streaming scan of every chain), which
re-exports these names. Each read is checked as the scan checks a record
(``docs/journal-format.md``).

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import Self

from hybridq.errors import JournalCorruption

from .fileops import OS_FILEOPS, FileOps
from .format import (
    FILE_HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    RECORD_HEADER_SIZE,
    SEAL_PAYLOAD_SIZE,
    SEAL_RECORDS,
    HeaderError,
    RecordType,
    SegmentHeader,
    decode_segment_header,
    record_problem,
    salt_seed,
    segment_name,
)
from .holes import RecordPunched, hole_within, holes_of
from .records import ChainPosition, Record
from .scan_search import unpack_header

__all__ = ["SegmentFile", "clamp_to_seals", "peek_header", "read_record_at", "read_seal", "seal_offset"]


def peek_header(path: str, *, fileops: FileOps = OS_FILEOPS) -> SegmentHeader | None:
    """The header of segment file ``path``; ``None`` when it is missing or does not decode."""
    try:
        fd = fileops.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return decode_segment_header(fileops.read(fd, FILE_HEADER_SIZE))
    except HeaderError:
        return None
    finally:
        fileops.close(fd)


#: Bytes read past a range's last record's start with the rest (most records are smaller).
_AHEAD = 4096
#: The header of a record cut short by the end of the file (its checksum does not match).
_SHORT = (0, MAX_PAYLOAD_BYTES + 1, 0, 0)


class SegmentFile:
    """One segment open for reads at known offsets, its header checked once.

    A refill reads hundreds of rows back from a few segments: opening the file and decoding its
    header for each cost about as much as checking the record itself. Use as a context manager,
    or :meth:`close` it.

    Raises :class:`JournalCorruption` when the segment's header is not valid.
    """

    def __init__(self, path: str, writer_id: str, segment: int, *, fileops: FileOps = OS_FILEOPS) -> None:
        self.writer_id = writer_id
        self.segment = segment
        self.path = os.path.join(path, segment_name(writer_id, segment))
        self._fileops = fileops
        self._fd = fileops.open(self.path, os.O_RDONLY)
        try:
            header = decode_segment_header(os.pread(self._fd, FILE_HEADER_SIZE, 0))
        except BaseException as exc:
            fileops.close(self._fd)  # an I/O error too: nothing is left open
            if isinstance(exc, HeaderError):
                raise JournalCorruption(self.path, 0, str(exc)) from None
            raise
        self._seed = salt_seed(header.salt)
        try:
            #: Punched ranges: a record in one is gone, as a compacted segment's (hybridq.journal.holes).
            #: Only a sealed (0400) segment has any: an unsealed tail does not look its map up
            #: (a segment read while the punch held it writable reads it on bad bytes, below).
            sealed = not os.fstat(self._fd).st_mode & stat.S_IWUSR
            self._holes = holes_of(self.path, fileops=fileops) if sealed else ()
        except BaseException:
            fileops.close(self._fd)
            raise

    def _punched(self, start: int, end: int) -> None:
        """Raise :class:`RecordPunched` when a punched range holds a record from ``start`` to ``end``."""
        hole = hole_within(self._holes, start, end) if self._holes else None
        if hole is not None:
            raise RecordPunched(self.path, max(start, hole.start))

    def _punched_since(self, start: int, end: int) -> None:
        """Raise :class:`RecordPunched` if the range was punched since the file was opened.

        The layer above may punch a sealed segment while another process reads it; it writes the
        map first, so bad bytes the map now lists are that punch, not damage.
        """
        self._holes = holes_of(self.path, fileops=self._fileops)
        self._punched(start, end)

    def read(self, offset: int) -> Record:
        """The record at ``offset``, checked as the scan checks it.

        Raises :class:`JournalCorruption` when the bytes there are not a valid record of this
        segment (:func:`~hybridq.journal.format.record_problem` says why);
        :class:`~hybridq.journal.holes.RecordPunched` (a ``FileNotFoundError``, as for a deleted
        segment) when the record was punched.
        """
        self._punched(offset, offset)
        head = os.pread(self._fd, RECORD_HEADER_SIZE, offset)
        if len(head) < RECORD_HEADER_SIZE:
            raise JournalCorruption(self.path, offset, "no record at this offset")
        crc, length, seq, type_word = unpack_header(head)
        fits = length <= MAX_PAYLOAD_BYTES
        payload = os.pread(self._fd, length, offset + RECORD_HEADER_SIZE) if fits else b""
        problem = record_problem(crc, length, type_word, head[4:] + payload, self._seed)
        if problem is None and len(payload) != length:
            problem = "checksum mismatch"  # cut short by the end of the file
        if problem is not None:
            self._punched_since(offset, offset)
            raise JournalCorruption(self.path, offset, problem, first_seq=seq)
        end = offset + RECORD_HEADER_SIZE + length
        return Record(self.writer_id, seq, type_word & 0xFF, payload, self.segment, offset, end)

    def read_data(self, start: int, end: int) -> list[tuple[int, bytes]]:
        """The data records from ``start`` to ``end`` (a record's offset; both included): offsets, payloads.

        One read for the whole range plus :data:`_AHEAD` bytes (a record at a time costs two
        system calls each), each record checked as the scan checks it. Raises
        :class:`JournalCorruption` when the bytes there are not valid records of this segment,
        :class:`~hybridq.journal.holes.RecordPunched` when some of them were punched.
        """
        self._punched(start, end)
        out: list[tuple[int, bytes]] = []
        buf = os.pread(self._fd, end - start + _AHEAD, start)
        at = 0
        while start + at <= end:
            crc, length, _, type_word = (
                unpack_header(buf, at) if len(buf) >= at + RECORD_HEADER_SIZE else _SHORT
            )
            stop = at + RECORD_HEADER_SIZE + length
            if len(buf) < stop <= at + RECORD_HEADER_SIZE + MAX_PAYLOAD_BYTES:
                buf += os.pread(self._fd, stop - len(buf), start + len(buf))  # the last record, past the read
            problem = record_problem(crc, length, type_word, memoryview(buf)[at + 4 : stop], self._seed)
            if problem is None and len(buf) < stop:
                problem = "checksum mismatch"  # cut short by the end of the file
            if problem is not None:
                self._punched_since(start, end)
                raise JournalCorruption(self.path, start + at, problem)
            if type_word & 0xFF == RecordType.DATA:
                out.append((start + at, buf[at + RECORD_HEADER_SIZE : stop]))
            at = stop
        return out

    def read_present(self, start: int, end: int) -> tuple[list[tuple[int, bytes]], bool]:
        """:meth:`read_data` of the records from ``start`` to ``end`` that were not punched.

        Returns them and whether a punched range was skipped (its records' jobs all finished:
        a reader that counted the range's records finds fewer).
        """
        out: list[tuple[int, bytes]] = []
        at, skipped = start, False
        for hole in self._holes:
            if hole.end <= start or hole.start > end:
                continue
            skipped = True
            if hole.start > at:
                out += self.read_data(at, hole.start - 1)
            at = max(at, hole.end)
        if at <= end:
            out += self.read_data(at, end)
        return out, skipped

    def close(self) -> None:
        """Close the file (once)."""
        if self._fd >= 0:
            self._fileops.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def read_record_at(
    path: str, writer_id: str, segment: int, offset: int, *, fileops: FileOps = OS_FILEOPS
) -> Record:
    """Read back one record by its location, checked as the scan checks it (for held, delayed jobs).

    Raises :class:`JournalCorruption` when the bytes there are not a valid record of that segment
    (:func:`~hybridq.journal.format.record_problem` says why).
    """
    with SegmentFile(path, writer_id, segment, fileops=fileops) as seg:
        return seg.read(offset)


def seal_offset(path: str, writer_id: str, segment: int) -> int | None:
    """Where the seal records of a sealed segment start (its data end); ``None`` if not sealed."""
    try:
        st = os.stat(os.path.join(path, segment_name(writer_id, segment)), follow_symlinks=False)
    except FileNotFoundError:
        return None
    if st.st_mode & stat.S_IWUSR:
        return None  # still writable: not sealed
    return st.st_size - SEAL_RECORDS * (RECORD_HEADER_SIZE + SEAL_PAYLOAD_SIZE)


def read_seal(path: str, writer_id: str, segment: int, *, fileops: FileOps = OS_FILEOPS) -> Record | None:
    """The first seal record of a sealed segment; ``None`` if it is not sealed (or gone).

    Raises :class:`JournalCorruption` when a sealed (read-only) segment does not end with it.
    """
    seal_at = seal_offset(path, writer_id, segment)
    if seal_at is None:
        return None
    seal = read_record_at(path, writer_id, segment, seal_at, fileops=fileops)
    if seal.rtype != RecordType.SEAL:
        raise JournalCorruption(
            os.path.join(path, segment_name(writer_id, segment)),
            seal_at,
            "sealed segment does not end with its seal",
        )
    return seal


def clamp_to_seals(
    path: str, positions: Mapping[str, ChainPosition], *, fileops: FileOps = OS_FILEOPS
) -> dict[str, ChainPosition]:
    """Positions that point past the data of their (sealed) segment, moved back to its seal.

    A reader can consume records that were never durable: after power loss, or a writer's
    rollback of a failed write, recovery truncates them and seals the segment where they were.
    Such a position would resume in the middle of the seal. Returns the moved positions only.
    """
    moved: dict[str, ChainPosition] = {}
    for writer_id, pos in positions.items():
        seal_at = seal_offset(path, writer_id, pos.segment)
        if seal_at is None or pos.offset <= seal_at:
            continue
        seal = read_seal(path, writer_id, pos.segment, fileops=fileops)
        if seal is not None:  # a moment ago it was sealed; only its removal undoes that
            moved[writer_id] = ChainPosition(pos.segment, seal.offset, seal.seq)
    return moved
