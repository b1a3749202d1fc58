"""The handle ``enqueue`` returns: :class:`Job`, and its status read from durable state.

A job's status comes from the forwarder's checkpoint and the completion ledger on disk, never
from Redis, so it is right while Redis is down.

This module must not import redis or rq.
"""

from __future__ import annotations

import json

from hybridq.cancels import cancel
from hybridq.envelope import Envelope
from hybridq.errors import EnvelopeError
from hybridq.journal import JournalReader, RecordId
from hybridq.journal.reader import list_chains
from hybridq.ledger import Compacted, LedgerIndex, consistent, load_index, read_ledger
from hybridq.state import load_checkpoint

__all__ = ["Job", "call_fingerprint"]


class Job:
    """A job that ``enqueue`` acknowledged: it is in the journal and will run (G1)."""

    __slots__ = ("envelope", "journal", "record")

    def __init__(self, envelope: Envelope, record: RecordId, journal: str) -> None:
        self.envelope = envelope
        self.record = record
        self.journal = journal

    @property
    def id(self) -> str:
        """The job id (also its RQ job id)."""
        return self.envelope.id

    @property
    def idempotency_key(self) -> str:
        """The idempotency key, verbatim."""
        return self.envelope.idempotency_key

    @property
    def queue(self) -> str:
        """The queue name."""
        return self.envelope.queue

    def get_status(self) -> str:
        """``accepted``, ``scheduled``, ``forwarded``, ``retrying``, ``merged``, ``finished``, ``failed``...

        ... or ``cancelled`` (a cancel settled it: docs/api.md, "Cancelling jobs"). Read from the
        forwarder's durable checkpoint and the completion ledger (it reads the
        whole ledger: for an occasional look, not a polling loop), so it works with Redis down.
        ``scheduled``: held until its time. ``retrying``: a run failed with attempts left, or said
        ``RetryLater``, and the next one is waiting for its time (or runs). ``merged``: another
        job with this job id and a different call was delivered first (or finished), so this one
        never runs (docs/enqueue.md, "Job ids"); to tell, a forwarded job reads the journal too. A
        job whose idempotency key another job owned (:attr:`duplicate_of`) reports that job's
        status (``forwarded`` or ``scheduled``) until it ends, then its outcome.
        """
        loc = (self.record.writer_id, self.record.segment, self.record.offset)
        compacted, index = consistent(self.journal, lambda c: (c, load_index(self.journal, c)))
        if loc in index.failed:
            return "failed"  # listed failures outlive their compacted segment
        if compacted.is_compacted((loc[0], loc[1])):
            return "finished"  # only segments whose every job is terminal are compacted
        present = list_chains(self.journal).get(loc[0])
        if present is None or loc[1] < present[0]:
            return "finished"  # its segment was compacted, and its chain forgotten since
        done = index.terminal.get((loc[0], loc[1]), {}).get(loc[2])
        if done is not None:
            if done == "cancelled":
                return "cancelled"
            return "finished" if done == "succeeded" else "failed"
        if loc in index.retries:
            return "retrying"
        checkpoint = load_checkpoint(self.journal)
        dup = index.duplicates.get(loc)
        if dup is not None:  # never pushed: it follows the job that owns its key
            held = checkpoint is not None and any(h.job_id == dup.dup_of for h in checkpoint.held)
            return "scheduled" if held else "forwarded"
        if checkpoint is None:
            return "accepted"
        if any(h.job_id == self.id for h in checkpoint.held):
            return "scheduled"
        position = checkpoint.positions.get(self.record.writer_id)
        if position is not None and position.next_seq > self.record.seq:
            return "merged" if self._merged(compacted, index) else "forwarded"
        return "accepted"

    @property
    def duplicate_of(self) -> str | None:
        """The id of the job that owned this job's idempotency key when the forwarder read it.

        Set for a job the forwarder did not push because a pending or finished job had the same
        explicit key (docs/enqueue.md, "Enqueue-if-absent"); ``None`` otherwise, and once the
        ledger entries saying so were compacted away. It reads the ledger (no Redis).
        """
        loc = (self.record.writer_id, self.record.segment, self.record.offset)

        def find(_: Compacted) -> str | None:
            for _record, entry in read_ledger(self.journal):
                if entry.dup_of is not None and entry.loc == loc:
                    return entry.dup_of
            return None

        return consistent(self.journal, find)  # read again if a compaction got in the way

    def _merged(self, compacted: Compacted, index: LedgerIndex) -> bool:
        """Whether a record that won this job id holds a different call.

        It won if it is earlier in this record's chain (the forwarder pushes a chain in order,
        and Redis keeps the first job under an id) or if it has finished.
        """
        needle = f'"id":"{self.id}"'.encode()
        mine = call_fingerprint(self.envelope)
        for rec in JournalReader(self.journal).records():
            loc = (rec.writer_id, rec.segment_index, rec.offset)
            if needle not in rec.payload or compacted.is_compacted(loc[:2]):
                continue
            if (rec.writer_id, rec.seq) == (self.record.writer_id, self.record.seq):
                continue  # this job's own record
            try:
                other = Envelope.from_bytes(rec.payload)
            except EnvelopeError:
                continue
            if (
                other.id != self.id
                or other.requeue != self.envelope.requeue
                or call_fingerprint(other) == mine
            ):
                continue
            if (rec.writer_id == self.record.writer_id and rec.seq < self.record.seq) or index.is_terminal(
                loc
            ):
                return True
        return False

    def cancel(self) -> str:
        """Cancel this job (every pending record of its id); what :func:`hybridq.cancel` said.

        ``"requested"`` (it had not ended: it never runs, or, running, is asked to stop),
        ``"cancelled"`` (already), ``"succeeded"`` or ``"failed"`` (it ended before: nothing
        done). Durable when it returns; needs neither Redis nor the forwarder (docs/api.md).
        """
        return cancel([self.id], self.journal)[0].state

    def __repr__(self) -> str:
        return f"<hybridq.Job {self.id} {self.envelope.func} queue={self.queue!r}>"


def call_fingerprint(env: Envelope) -> str:
    """The call a job makes (function, queue, arguments): equal for a retried enqueue."""
    return json.dumps([env.func, env.queue, env.args, env.kwargs], sort_keys=True)
