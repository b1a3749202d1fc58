"""Jobs read back from journal records by the forwarder: decoded, or skipped loudly.

This module must not import redis or rq.
"""

from __future__ import annotations

import logging
from typing import Self

from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, JournalError
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import Record, RecordType
from hybridq.journal.reader import SegmentFile, read_record_at, seal_offset
from hybridq.ledger.checkpoint import Held
from hybridq.lookup.reads import job_row
from hybridq.protocol import Overwrite
from hybridq.transport.base import Delivery, Loc

__all__ = [
    "MAX_OPEN_SEGMENTS",
    "HeldReads",
    "decode_job",
    "envelope_at",
    "first_delivery",
    "read_held",
    "row_delivery",
]

log = logging.getLogger("hybridq.forwarder")

#: The members compared on every job, read once: a member read from its Enum class goes
#: through ``EnumType.__getattr__``'s hook on Python 3.11 (about 900 instructions a read, once
#: per job here: docs/benchmarks.md, "The forwarder's writes per job, again").
_DATA, _EARLIER, _NEVER = RecordType.DATA, Overwrite.EARLIER, Overwrite.NEVER


def decode_job(state: ForwarderState, record: Record) -> Envelope | None:
    """The job ``record`` holds; ``None`` for another record type or a record that is not a job.

    A record that is not a job is made terminal (``invalid``) in the ledger through ``state``.
    """
    if record.rtype != _DATA:
        return None  # a record type this version does not forward
    try:
        return Envelope.from_bytes(record.payload)
    except EnvelopeError as exc:
        # The record passed its checksum, so these are the bytes a producer wrote: a bug or
        # a newer, incompatible producer. Skip it loudly rather than stop every other job,
        # and mark it terminal in the ledger so its segment can be compacted.
        row = job_row(record)  # the id it names, if any: a lookup by id finds it failed
        state.record_invalid((record.writer_id, record.segment_index, record.offset), row[0] if row else "")
        log.error(
            "skipping record %s:%d (segment %d offset %d): not a valid job envelope: %s",
            record.writer_id,
            record.seq,
            record.segment_index,
            record.offset,
            exc,
        )
        return None


def read_held(state: ForwarderState, held: Held) -> Envelope | None:
    """The job a held entry points to, read again now that it is due; ``None`` if it is gone."""
    with HeldReads(state) as reads:
        return reads.read(held)


#: Segments a :class:`HeldReads` keeps open at once (the least recently read is closed first):
#: due delayed jobs can come from as many segments as producer processes wrote them.
MAX_OPEN_SEGMENTS = 16


class HeldReads:
    """:func:`read_held` for many entries: each segment checked, opened and its header read once.

    A refill reads up to a chunk of rows back, most from one or two segments (use as a context
    manager: the segments opened are closed at its end).
    """

    def __init__(self, state: ForwarderState) -> None:
        self.state = state
        #: Per segment read: where its seal starts (``None``: not sealed), and the file if opened.
        self._seals: dict[tuple[str, int], int | None] = {}
        self._files: dict[tuple[str, int], SegmentFile] = {}

    def read(self, held: Held) -> Envelope | None:
        """The job ``held`` points to; ``None`` if it is gone (logged) or not a job.

        One this process decoded as it read it, and kept (:mod:`hybridq.forwarder.decoded`), is
        not read again: its record cannot have changed since (a journal is repaired only while
        no forwarder holds it).
        """
        kept = self.state.decoded.take((held.writer_id, held.segment, held.offset))
        if kept is not None:
            return kept
        journal = self.state.journal
        segment = (held.writer_id, held.segment)
        if segment not in self._seals:
            self._seals[segment] = seal_offset(journal, *segment)
        seal_at = self._seals[segment]
        if seal_at is not None and held.offset >= seal_at:
            # Cut off since it was read: a torn tail recovery dropped (never acknowledged, so
            # never promised), or damage an operator dropped with `journal repair --accept-loss`.
            log.warning("held job %s: its record is gone (dropped by recovery or repair)", held.job_id)
            return None
        try:
            seg = self._files.pop(segment, None)  # back in last: the most recently read
            if seg is None:
                if len(self._files) >= MAX_OPEN_SEGMENTS:
                    self._files.pop(next(iter(self._files))).close()
                seg = SegmentFile(journal, *segment)
            self._files[segment] = seg
            record = seg.read(held.offset)
        except FileNotFoundError:
            log.warning("held job %s: its segment is gone (moved aside by journal repair)", held.job_id)
            return None
        # Decoded when it was held; refused now only by a stricter version: terminal, not lost.
        return decode_job(self.state, record)

    def close(self) -> None:
        """Close every segment opened."""
        for seg in self._files.values():
            seg.close()
        self._files.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def envelope_at(journal: str, loc: Loc) -> Envelope | None:
    """The job recorded at ``loc``; ``None`` (logged) if it cannot be read or decoded."""
    try:
        record = read_record_at(journal, loc[0], loc[1], loc[2])
        return Envelope.from_bytes(record.payload)
    except (JournalError, EnvelopeError, OSError) as exc:
        log.error("cannot read job at %s:%d:%d: %s", *loc, exc)
        return None


def first_delivery(state: ForwarderState, env: Envelope, loc: Loc) -> Delivery:
    """The first delivery of the job read at ``loc`` (pushed as read)."""
    # A requeued job replaces its failed predecessor in RQ (same job id, a later run).
    overwrite = _EARLIER if env.requeue > 0 else _NEVER
    return state.delivery(env, loc, 1, overwrite=overwrite)


def row_delivery(state: ForwarderState, env: Envelope, loc: Loc) -> Delivery:
    """The delivery of the job at ``loc`` that waited in the run table.

    Most rows were never pushed: the first delivery. A row a claim's refusal put back
    (:mod:`hybridq.forwarder.refusals`) is the refused attempt again: its refused copy, which
    RQ ended without a claim, is replaced (``Overwrite.EARLIER``); a copy queued or claimed is kept.
    """
    back = state.runs.backs.get(loc)
    if back is None:
        return first_delivery(state, env, loc)
    return state.delivery(env, loc, back, overwrite=Overwrite.EARLIER)
