"""Finding record headers in raw bytes, where the framing cannot be followed.

Owns the header unpacker, the regular expression of where a record header could start, and the
search for valid records after a bad one that the torn-tail policy needs
(:meth:`hybridq.journal.scan.SegmentScan._anomaly`, docs/journal-format.md) and that the repair's
listing of what it drops uses (:mod:`hybridq.journal.repair_dropped`).

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import os
import re

from .format import MAX_PAYLOAD_BYTES, RECORD_HEADER, RECORD_HEADER_SIZE, record_problem
from .records import Later

__all__ = ["candidate_pattern", "later_records", "unpack_header"]

# crc, length, sequence, and one word: type (low byte), unsynced distance (the other 24 bits)
unpack_header = RECORD_HEADER.unpack_from
# Where a record header could start when no sequence number is expected: a valid type byte and
# a non-zero unsynced distance.
_ANY_RECORD = re.compile(b"(?s)(?=.{16}[\\x01-\\x7f\\xff](?!\\x00\\x00\\x00))")


def candidate_pattern(low_seq: int | None, high_seq: int) -> re.Pattern[bytes]:
    """A regex matching where a record header could start: plausible sequence, type, distance.

    Plausible: a sequence number in ``[low_seq, high_seq]`` (any, when ``low_seq`` is ``None``),
    a valid type, a non-zero distance. Each match still has to pass :func:`record_problem`.
    """
    if low_seq is None:
        return _ANY_RECORD
    if low_seq >> 24 == high_seq >> 24:
        # The top five bytes of the little-endian sequence number are fixed by the range.
        seq = b".{3}" + re.escape((low_seq >> 24).to_bytes(5, "little"))
    else:
        seq = b".{8}"
    return re.compile(b"(?s)(?=.{8}" + seq + b"[\\x01-\\x7f\\xff](?!\\x00\\x00\\x00).{3})")


def later_records(fd: int, size: int, chunk: int, seed: int, bad_off: int, expected: int) -> Later | None:
    """Valid records of the segment at ``fd`` (``size`` bytes) after ``bad_off``: first, count, frontier.

    Runs only on an anomaly. Candidate positions are found by a regular expression over the
    header's shape (a plausible sequence number, a valid type, a non-zero distance), at C
    speed, so megabytes of zeros or garbage cost milliseconds; each candidate's checksum is
    then verified (the salted CRC makes a false match about 2**-32 per candidate).
    """
    remaining = size - bad_off
    max_seq = expected + remaining // RECORD_HEADER_SIZE + 1
    pattern = candidate_pattern(expected, max_seq)
    found: Later | None = None
    pos = bad_off + 1
    window, window_at = b"", pos  # a chunk of the file starting at window_at
    while pos + RECORD_HEADER_SIZE <= size:
        if pos < window_at or pos + RECORD_HEADER_SIZE > window_at + len(window):
            window, window_at = os.pread(fd, chunk, pos), pos
        m = pattern.search(window, pos - window_at)
        if m is None:
            if window_at + len(window) >= size:
                break
            pos = window_at + len(window) - RECORD_HEADER_SIZE + 1  # overlap the boundary
            window = b""
            continue
        pos = window_at + m.start()
        stored, length, seq, type_word = unpack_header(window, m.start())
        distance = type_word >> 8
        end = pos + RECORD_HEADER_SIZE + length
        if expected <= seq <= max_seq and length <= MAX_PAYLOAD_BYTES and end <= size:
            rec = os.pread(fd, RECORD_HEADER_SIZE + length, pos)
            if record_problem(stored, length, type_word, memoryview(rec)[4:], seed) is None:
                if found is None:
                    found = Later(pos, seq, seq - distance, 0)
                found.count += 1
                found.max_synced_seq = max(found.max_synced_seq, seq - distance)
                pos = end  # hop to the next record
                continue
        pos += 1
    return found
