"""The handle ``enqueue`` returns: :class:`Job`, and its status read from durable state.

A job's status comes from the forwarder's checkpoint and the completion ledger on disk, never
from Redis, so it is right while Redis is down. The answers read from the whole ledger are
:mod:`hybridq.job_ledger`'s; this module reads the forwarder's lookup index.

This module must not import redis or rq.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Generator
from typing import Any

from hybridq.cancels import cancel
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import read_result
from hybridq.errors import EnvelopeError, JobFailed, JobWaitTimeout, JournalError, ResultNotKept
from hybridq.job_ledger import call_fingerprint, ledger_dup_of, ledger_status
from hybridq.journal import Record, RecordId
from hybridq.journal.paths import default_journal, existing_journal_dir
from hybridq.journal.reader import read_record_at
from hybridq.ledger.checkpoint import Checkpoint, forwarder_holder, load_checkpoint
from hybridq.lookup import reads as lookup
from hybridq.workflows.canvas import ANCHOR_FUNC, step_id
from hybridq.workflows.store import Step, flow_steps, steps_of

__all__ = ["STATUSES", "Job", "call_fingerprint", "fetch_job"]

#: What :attr:`Job.status` may say.
STATUSES = ("queued", "scheduled", "forwarded", "retrying", "merged", "finished", "failed", "started")
#: :meth:`Job.get_status`'s words that :attr:`Job.status` says otherwise.
_STATUS_OF = {"accepted": "queued"}
#: Terminal outcomes in the ledger, as :attr:`Job.status` says them (another outcome as it is).
_ENDED = {"succeeded": "finished", "failed": "failed", "invalid": "failed"}
#: What :attr:`Job.status` says of a job that has not ended.
_PENDING = frozenset({"queued", "scheduled", "forwarded", "retrying", "started"})
#: :meth:`Job.wait`'s polls: the first after this long, then twice as long, up to the most.
_POLL_FIRST_S, _POLL_MOST_S = 0.002, 0.1


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
        return ledger_status(self.journal, self.record, self.envelope)

    @property
    def duplicate_of(self) -> str | None:
        """The id of the job that owned this job's idempotency key when the forwarder read it.

        Set for a job the forwarder did not push because a pending or finished job had the same
        explicit key (docs/enqueue.md, "Enqueue-if-absent"); ``None`` otherwise, and once the
        ledger entries saying so were compacted away (and the lookup index forgot the job). It
        reads the lookup index, else the ledger (no Redis).
        """
        row = self._row()
        if row is not None:  # the lookup index (it may lag the ledger by a forwarder step)
            return row.dup_of
        return ledger_dup_of(self.journal, self.record)

    def cancel(self) -> str:
        """Cancel this job (every pending record of its id); what :func:`hybridq.cancel` said.

        ``"requested"`` (it had not ended: it never runs, or, running, is asked to stop),
        ``"cancelled"`` (already), ``"succeeded"`` or ``"failed"`` (it ended before: nothing
        done). Durable when it returns; needs neither Redis nor the forwarder (docs/api.md).
        """
        return cancel([self.id], self.journal)[0].state

    def __repr__(self) -> str:
        return f"<hybridq.Job {self.id} {self.envelope.func} queue={self.queue!r}>"

    # -- looked up by id: the forwarder's lookup index (docs/api.md, "Looking a job up") --------

    def _row(self) -> lookup.Row | None:
        """The index's row for this very record (``None``: not indexed, or another record's)."""
        row = lookup.find(self.journal, self.id)
        if row is None or row.loc != (self.record.writer_id, self.record.segment, self.record.offset):
            return None
        return row

    @property
    def status(self) -> str:
        """``queued``, ``scheduled``, ``forwarded``, ``started``, ``retrying``, ``merged``, ``finished``...

        ... or ``failed``: :meth:`get_status`'s answer (``accepted`` is ``queued``), read from the
        forwarder's lookup index instead of the whole ledger: one primary-key read, plus the
        checkpoint for a job with no outcome yet. It may lag the ledger by one forwarder step
        (docs/api.md). ``started``: a worker claimed its run (:attr:`attempt`, :attr:`started_at`)
        and the forwarder heard of it; a job whose worker sends no started event (an older one)
        reads ``forwarded`` until it ends.
        """
        row = self._row()
        if row is None:
            marks = lookup.journal_marks(self.journal)
            mark = marks.get(self.record.writer_id) if marks is not None else None
            if marks is None or (mark is not None and self.record.seq < mark.next_seq):
                # No index (no forwarder ran since this version), or read by it yet not this
                # id's row (merged, or forgotten long after compaction): the ledger says.
                status = self.get_status()
                return _STATUS_OF.get(status, status)
            return self._pending_status(load_checkpoint(self.journal), self.id)
        if row.state == "done":
            return _ENDED.get(row.outcome or "failed", row.outcome or "failed")
        if row.state == "retry":
            return "retrying"
        if row.state == "started":  # a worker claimed its run (a started event): no outcome yet
            return "started"
        if lookup.segment_gone(self.journal, row.loc):
            return "finished"  # only segments whose every job is terminal are compacted
        checkpoint = load_checkpoint(self.journal)
        if row.state == "dup" and row.dup_of is not None:  # never pushed: it follows the key's owner
            held = checkpoint is not None and any(h.job_id == row.dup_of for h in checkpoint.held)
            return "scheduled" if held else "forwarded"
        return self._pending_status(checkpoint, self.id)

    @property
    def steps(self) -> list[Step]:
        """A workflow's steps and their states, in order; ``[]`` for a job that is not one."""
        return steps_of(self.journal, self.id, step_id) if self.envelope.func == ANCHOR_FUNC else []

    def _pending_status(self, checkpoint: Checkpoint | None, job_id: str) -> str:
        if (
            self.envelope.func == ANCHOR_FUNC
            and (flow_steps(self.journal, job_id) or ("", []))[0] == "running"
        ):
            return "started"  # a workflow the forwarder holds: its steps run (docs/workflows.md)
        if checkpoint is None:
            return "queued"
        if any(h.job_id == job_id for h in checkpoint.held):
            return "scheduled"
        position = checkpoint.positions.get(self.record.writer_id)
        return "forwarded" if position is not None and position.next_seq > self.record.seq else "queued"

    @property
    def attempt(self) -> int:
        """The job's attempt (as ``current_job().attempt``) of its latest run reported; 0 before."""
        row = self._row()
        return row.attempt if row is not None else 0

    @property
    def result(self) -> Any:
        """The task's return value (JSON: lists, dicts, ...); ``None`` until it has finished.

        Kept in the ledger, so a Redis wipe does not lose it. A suppressed duplicate gives its
        original's result. ``None`` for a failed job (see :attr:`exc_info`).

        Raises:
            ResultNotKept: it finished, but its result is not held: too large
                (``protocol.RESULT_MAX_BYTES``), or reported by a worker that sends none.
        """
        return _result_of(self.journal, self._row(), self.id)

    @property
    def exc_info(self) -> str | None:
        """The error of its last failed run (the last line of the traceback); ``None`` if none."""
        row = self._row()
        if row is None or (row.state != "retry" and row.outcome != "failed"):
            return None
        if row.error is None and row.dup_of is not None and row.dup_of != self.id:
            original = lookup.find(self.journal, row.dup_of)  # a settled duplicate: its original's
            return original.error if original is not None and original.outcome == "failed" else None
        return row.error

    @property
    def enqueued_at(self) -> float:
        """When it was enqueued (Unix time, the producer's clock)."""
        return self.envelope.created_at

    @property
    def started_at(self) -> float | None:
        """When its latest reported run started (the worker's clock); ``None`` before one reported."""
        row = self._row()
        return row.started if row is not None else None

    @property
    def ended_at(self) -> float | None:
        """When it finished or failed for good (the worker's clock); ``None`` before."""
        row = self._row()
        return row.ended if row is not None and row.state == "done" else None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the job ends; its :attr:`result`.

        Polls the lookup index (a primary-key read) every 2 ms at first, backing off to 100 ms.

        Raises:
            JobFailed: it failed for good (or was merged into another job with its id).
            JobWaitTimeout: still not ended after ``timeout`` seconds (its message says so when
                no forwarder holds the journal: then nothing moves the job on).
            ResultNotKept: it finished, but its result was not kept.
        """
        pauses = self._pauses(timeout)
        try:
            while True:
                time.sleep(next(pauses))
        except StopIteration as ended:
            return ended.value

    async def wait_async(self, timeout: float | None = None) -> Any:  # noqa: ASYNC109 - as wait()
        """:meth:`wait` for a coroutine: polls with ``asyncio.sleep``, never blocking the event loop."""
        pauses = self._pauses(timeout)
        try:
            while True:  # noqa: ASYNC110 - polls an index another process writes
                await asyncio.sleep(next(pauses))
        except StopIteration as ended:
            return ended.value

    def _pauses(self, timeout: float | None) -> Generator[float, None, Any]:
        """The pauses between two looks at the job (2 ms, doubling to 100 ms); returns its result.

        Shared by :meth:`wait` and :meth:`wait_async`, which only sleep differently.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = _POLL_FIRST_S
        while True:
            status = self.status
            if status not in _PENDING:
                return self._ended(status)
            if deadline is not None and time.monotonic() >= deadline:
                unattended = self.journal if forwarder_holder(self.journal) is None else None
                raise JobWaitTimeout(self.id, timeout or 0.0, status, unattended=unattended)
            yield delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic()))
            delay = min(_POLL_MOST_S, delay * 2)

    def _ended(self, status: str) -> Any:
        if status == "finished":
            return self.result
        if status == "merged":
            raise JobFailed(self.id, "merged: another job with this id and a different call ran instead")
        if status != "failed":  # another terminal outcome (a newer version's): it did not succeed
            raise JobFailed(self.id, self.exc_info or status)
        raise JobFailed(self.id, self.exc_info)


def _result_of(journal: str, row: lookup.Row | None, job_id: str) -> Any:
    """The result a row holds (its original's, for a settled duplicate)."""
    if row is None or row.state != "done" or row.outcome != "succeeded":
        return None
    if row.rkept:
        return read_result(row.result) if row.result is not None else None
    if row.dup_of is not None and row.dup_of != job_id:
        original = lookup.find(journal, row.dup_of)
        if original is not None and original.state == "done":
            return _result_of(journal, original, row.dup_of)
    if row.rbytes is not None:
        raise ResultNotKept(job_id, "too_large", row.rbytes)
    raise ResultNotKept(job_id, "not_reported")


def fetch_job(job_id: str, journal: str | os.PathLike[str] | None = None) -> Job | None:
    """The job with id ``job_id`` in ``journal``; ``None`` if the journal holds none.

    One read of the forwarder's lookup index (and one of the journal, for the job's envelope);
    a job the index has not read yet (just enqueued, or the forwarder is behind) is looked for
    in the journal past the index. A job whose segment was compacted stays found for
    ``lookup.RETENTION_S`` after it ended, with its status and result, and an envelope without
    its arguments. With several records under one id, the job is the first (or its latest
    requeue). Creates nothing.

    Args:
        job_id: the id ``enqueue`` gave (``job.id``).
        journal: the journal directory; default ``$HYBRIDQ_JOURNAL``.

    Raises:
        ConfigError: no ``journal`` and no ``$HYBRIDQ_JOURNAL``.
        JournalPathError: ``journal`` is not a usable journal directory.
    """
    path = existing_journal_dir(default_journal() if journal is None else journal)
    row = lookup.find(path, job_id)
    if row is not None and row.outcome == "failed":
        # A failure may have been requeued since the index read the journal: a newer record.
        newer = lookup.scan_tail(path, job_id, lookup.journal_marks(path))
        if newer is not None:
            return _job_at(path, newer)
    if row is not None:
        try:
            record = read_record_at(path, row.writer, row.seg, row.off)
            env = Envelope.from_bytes(record.payload)
        except (OSError, JournalError, EnvelopeError, ValueError):
            env = _bare_envelope(row)  # its segment was compacted: its arguments are gone
        return Job(env, RecordId(row.writer, row.seq, row.seg, row.off), path)
    found = lookup.scan_tail(path, job_id, lookup.journal_marks(path))
    return _job_at(path, found) if found is not None else None


def _job_at(journal: str, record: Record) -> Job | None:
    try:
        env = Envelope.from_bytes(record.payload)
    except EnvelopeError:
        return None
    return Job(env, RecordId(record.writer_id, record.seq, record.segment_index, record.offset), journal)


def _bare_envelope(row: lookup.Row) -> Envelope:
    """The envelope of a compacted job: its id, function, queue and key, without its arguments."""
    return Envelope(
        row.id, row.func or "", row.queue or "", row.ikey or "", row.enq or 0.0, requeue=row.requeue
    )
