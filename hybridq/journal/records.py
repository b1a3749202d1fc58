"""The values the journal reader hands out: records, positions, torn tails, segment summaries.

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .format import FILE_HEADER_SIZE

__all__ = ["ChainPosition", "Later", "Loc", "Record", "SegmentInfo", "TornTail"]


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


#: Where a record is: ``(writer id, segment index, offset)``. Unique per record, so the layers
#: above use it to name one acceptance of a job.
Loc = tuple[str, int, int]


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

    def consumed_by(self, positions: Mapping[str, ChainPosition]) -> bool:
        """Whether a reader standing at ``positions`` has read past this record."""
        pos = positions.get(self.writer_id)
        return pos is not None and (self.segment_index, self.end) <= (pos.segment, pos.offset)


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
class Later:
    """Valid records found after a bad one (see :func:`hybridq.journal.scan_search.later_records`)."""

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
    #: Data records skipped in punched ranges (hybridq.journal.holes): counted in data_count.
    punched: int = 0
    last_data_seq: int = 0
    sealed: bool = False
    #: Of a sealed segment: where its seal records start.
    seal_offset: int = 0
    #: Of a sealed segment: the last sequence number stated fsynced (*Record*) by its seal, and by
    #: its last data record (``first_seq - 1`` if not known). The records after the smaller were
    #: durable only if a later fsync did not fail: recovery seals again from there. A writer's
    #: frontier only grows, so the last data record's is the smaller but where the seal's distance
    #: was capped and the record's was not; the seal's is kept for that case and because
    #: recovery's and a repair's seals state every record durable (only the record's tells).
    seal_synced_seq: int = 0
    data_synced_seq: int = 0
    live: bool = False
    torn: TornTail | None = None
