"""A job's answers read from the whole completion ledger and the journal, not the lookup index.

:meth:`hybridq.job.Job.get_status` (the ledger's word, for an occasional look) and the fallback of
:attr:`hybridq.job.Job.duplicate_of` read here; :mod:`hybridq.job` keeps the handle and its reads
of the forwarder's lookup index (one primary-key read each), so the two ways of answering stay
apart (docs/api.md, "Looking a job up").

This module must not import redis or rq.
"""

from __future__ import annotations

import json

from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError
from hybridq.journal import JournalReader, RecordId
from hybridq.journal.reader import list_chains
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ledger.compacted import Compacted, consistent
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index, read_ledger

__all__ = ["call_fingerprint", "ledger_dup_of", "ledger_status"]


def call_fingerprint(env: Envelope) -> str:
    """The call a job makes (function, queue, arguments): equal for a retried enqueue."""
    return json.dumps([env.func, env.queue, env.args, env.kwargs], sort_keys=True)


def ledger_status(journal: str, record: RecordId, envelope: Envelope) -> str:
    """:meth:`hybridq.job.Job.get_status`'s answer for the job ``envelope`` at ``record``."""
    loc = (record.writer_id, record.segment, record.offset)
    compacted, index = consistent(journal, lambda c: (c, load_index(journal, c, keys=False)))
    if loc in index.failed:
        return "failed"  # listed failures outlive their compacted segment
    if compacted.is_compacted((loc[0], loc[1])):
        return "finished"  # only segments whose every job is terminal are compacted
    present = list_chains(journal).get(loc[0])
    if present is None or loc[1] < present[0]:
        return "finished"  # its segment was compacted, and its chain forgotten since
    done = index.outcome(loc)
    if done is not None:
        if done == "cancelled":
            return "cancelled"
        return "finished" if done == "succeeded" else "failed"
    if loc in index.retries:
        return "retrying"
    checkpoint = load_checkpoint(journal)
    dup = index.duplicates.get(loc)
    if dup is not None:  # never pushed: it follows the job that owns its key
        held = checkpoint is not None and any(h.job_id == dup.dup_of for h in checkpoint.held)
        return "scheduled" if held else "forwarded"
    if checkpoint is None:
        return "accepted"
    if any(h.job_id == envelope.id for h in checkpoint.held):
        return "scheduled"
    position = checkpoint.positions.get(record.writer_id)
    if position is not None and position.next_seq > record.seq:
        return "merged" if _merged(journal, record, envelope, compacted, index) else "forwarded"
    return "accepted"


def ledger_dup_of(journal: str, record: RecordId) -> str | None:
    """The owner of the key the ledger says the job at ``record`` duplicated; ``None`` if none."""
    loc = (record.writer_id, record.segment, record.offset)

    def find(_: Compacted) -> str | None:
        for _record, entry in read_ledger(journal):
            if entry.dup_of is not None and entry.loc == loc:
                return entry.dup_of
        return None

    return consistent(journal, find)  # read again if a compaction got in the way


def _merged(
    journal: str, record: RecordId, envelope: Envelope, compacted: Compacted, index: LedgerIndex
) -> bool:
    """Whether a record that won this job id holds a different call.

    It won if it is earlier in this record's chain (the forwarder pushes a chain in order,
    and Redis keeps the first job under an id) or if it has finished.
    """
    needle = f'"id":"{envelope.id}"'.encode()
    mine = call_fingerprint(envelope)
    for rec in JournalReader(journal).records():
        loc = (rec.writer_id, rec.segment_index, rec.offset)
        if needle not in rec.payload or compacted.is_compacted(loc[:2]):
            continue
        if (rec.writer_id, rec.seq) == (record.writer_id, record.seq):
            continue  # this job's own record
        try:
            other = Envelope.from_bytes(rec.payload)
        except EnvelopeError:
            continue
        if other.id != envelope.id or other.requeue != envelope.requeue or call_fingerprint(other) == mine:
            continue
        if (rec.writer_id == record.writer_id and rec.seq < record.seq) or index.is_terminal(loc):
            return True
    return False
