"""Whether a hole map fits its segment: the check before a start punches or seals again.

Apart from :mod:`hybridq.journal.holes` because it reads the segment's records as
``SegmentFile`` does (header, salt, record checks: the journal format), while the hole maps
themselves only list ranges; :func:`hybridq.journal.holes.tidy_hole_maps` calls it before it
trusts a map left by a crash (docs/journal-format.md, *Hole maps*). This module must not import
redis, rq, click or the job envelope.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .fileops import OS_FILEOPS, FileOps
from .format import (
    FILE_HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    SEAL_PAYLOAD_SIZE,
    SEAL_RECORDS,
    RecordType,
    decode_segment_header,
    record_problem,
    salt_seed,
)

if TYPE_CHECKING:
    from .holes import Hole


def _misfit(path: str, holes: Iterable[Hole], *, fileops: FileOps = OS_FILEOPS) -> str | None:
    """Why the map ``holes`` does not fit the segment at ``path``; ``None`` when it does.

    It fits when the segment ends with its seals (only sealed segments get a map), each range
    starts at the record due (sequence ``first_seq``, or zeros: punched already) and ends at
    the record of sequence ``next_seq`` (a data or seal record, never punched: the map says
    so). A restored or stale map fails, and is then not punched (docs/journal-format.md).
    Read as ``SegmentFile`` reads a record, not through it: its reads skip these very ranges.
    """
    fd = fileops.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        seed = salt_seed(decode_segment_header(os.pread(fd, FILE_HEADER_SIZE, 0)).salt)

        def seq_at(off: int) -> int | None:
            """The sequence of the valid record at ``off``; ``None`` if there is none."""
            head = os.pread(fd, RECORD_HEADER_SIZE, off)
            if len(head) < RECORD_HEADER_SIZE:
                return None
            crc, length, seq, type_word = RECORD_HEADER.unpack(head)
            payload = os.pread(fd, length, off + RECORD_HEADER_SIZE) if length <= MAX_PAYLOAD_BYTES else b""
            if record_problem(crc, length, type_word, head[4:] + payload, seed) or len(payload) != length:
                return None
            return int(seq)

        seal_at = size - SEAL_RECORDS * (RECORD_HEADER_SIZE + SEAL_PAYLOAD_SIZE)
        if (
            seal_at < FILE_HEADER_SIZE
            or seq_at(seal_at) is None
            or os.pread(fd, RECORD_HEADER_SIZE, seal_at)[16] != RecordType.SEAL  # the type's byte
        ):
            return "the segment does not end with its seals"
        for h in holes:
            first = os.pread(fd, RECORD_HEADER_SIZE, h.start)
            if any(first) and seq_at(h.start) != h.first_seq:
                return f"range {h.start}-{h.end} does not start at record {h.first_seq}"
            if h.end > seal_at or seq_at(h.end) != h.next_seq:
                return f"range {h.start}-{h.end} does not end at record {h.next_seq}"
    finally:
        fileops.close(fd)
    return None
