"""What a journal repair drops and does: the report of :func:`~hybridq.journal.repair.repair`.

Written into the backup directory as ``repair-report.json`` before the first change, and printed
by the CLI. This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["ChainRepair", "DropKind", "DroppedRecord", "RepairReport"]


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
    #: A punched range of finished jobs' records (docs/journal-format.md, hole maps): no loss.
    PUNCHED = "punched"
    #: A damaged ids file of a segment, moved into the backup (docs/journal.md): the finished
    #: jobs it named answer as compacted ones (``cancel()`` unknown, no lookup row after a
    #: rebuild); none runs again.
    IDS = "ids"


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
