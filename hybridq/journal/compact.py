"""Deleting segments the layer above no longer needs (docs/reliability.md rule 8).

The journal does not decide *which* segments may go (that needs to know which jobs are durably
terminal, which only the layer above knows); it offers the two safe primitives: how many data
records a sealed segment holds (from its seal, without reading it), and deleting the oldest
segment of a chain durably. Only a chain's oldest segment may go: a gap in the middle of a chain
is corruption (rule 11), a missing head is compaction.

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import os

from hybridq import crashpoints

from .fileops import OS_FILEOPS, FileOps
from .format import decode_seal, segment_name
from .holes import remove_holes
from .reader import list_chains, read_seal

__all__ = ["remove_oldest_segment", "sealed_data_count"]


def sealed_data_count(path: str, writer_id: str, segment: int) -> int | None:
    """The number of data records in a sealed segment; ``None`` if it is not sealed (or gone)."""
    seal = read_seal(path, writer_id, segment)
    return decode_seal(seal.payload)[1] if seal is not None else None


def remove_oldest_segment(path: str, writer_id: str, segment: int, *, fileops: FileOps = OS_FILEOPS) -> None:
    """Durably delete ``segment``, which must be the oldest remaining segment of its chain.

    The caller has already made durable the state that makes the segment unnecessary (rule 8).
    """
    indices = list_chains(path).get(writer_id, [])
    if not indices or indices[0] != segment:
        raise ValueError(f"segment {segment} of chain {writer_id} is not the chain's oldest: {indices[:3]}")
    fileops.unlink(os.path.join(path, segment_name(writer_id, segment)))
    crashpoints.reached("compact_after_unlink")
    fileops.fsync_dir(path)
    # Its hole map after it (hybridq.journal.holes): a map left alone by a crash is removed at
    # the next start (tidy_hole_maps); a segment never stands without the map it was punched by.
    if remove_holes(path, writer_id, segment, fileops=fileops):
        fileops.fsync_dir(path)
