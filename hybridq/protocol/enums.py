"""The enums of the wire contract (part of :mod:`hybridq.protocol`).

How a run ended, ledger entry kinds, the backend's verdicts, the Lua scripts' replies and the
push's overwrite modes.

They are ``str`` (or ``int``) enums whose values are the very strings (numbers) on the wire, so
the JSON, the Lua scripts' replies and the ledger records are what they were.
"""

from __future__ import annotations

import enum

__all__ = ["ClaimStatus", "EntryKind", "FinishReply", "Outcome", "Overwrite", "Verdict"]


class Outcome(enum.StrEnum):
    """How a run ended, as stored under the key, sent in events and kept in the ledger."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    #: Ledger only: a journal record that is not a job (it never reaches a worker).
    INVALID = "invalid"
    #: Stored and sent only: the task raised ``hybridq.RetryLater``; it runs again after a delay,
    #: with no attempt used (the ledger makes it a ``retry`` entry).
    LATER = "later"
    #: The job was cancelled (``hybridq cancel``): it never ran, or its run was stopped.
    CANCELLED = "cancelled"


class EntryKind(enum.StrEnum):
    """The kind of a ledger entry (its ``t`` field)."""

    #: The job finished: succeeded, or failed for good.
    DONE = "done"
    #: The job failed and runs again after a delay.
    RETRY = "retry"
    #: The worker running the job vanished: the next attempt is delivered.
    LOST = "lost"
    #: A job that failed for good was queued again (``hybridq failed requeue``).
    REQUEUED = "requeued"
    #: The forwarder pushed a job with an explicit idempotency key: it owns the key (enqueue-if-absent).
    KEY = "key"
    #: A job whose idempotency key was pending or finished: never pushed, settled (a ``done``
    #: entry with ``dup_of``) with its original's outcome once that one is terminal.
    DUPLICATE = "duplicate"
    #: A cancel was asked for the job (``hybridq cancel``): never delivered again; settled by a
    #: ``done`` entry with the outcome ``cancelled`` (or the outcome its run reported).
    CANCEL = "cancel"


class Verdict(enum.StrEnum):
    """What the backend says about a forwarded job (see ``Transport.probe``)."""

    MISSING = "missing"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ORPHANED = "orphaned"
    STRANDED = "stranded"


class ClaimStatus(enum.IntEnum):
    """The first element of the claim script's reply."""

    #: The lease is this delivery's: run the task.
    CLAIMED = 0
    #: The key holds a success, or a final failure: report it, run nothing (a duplicate).
    SUPPRESSED = 1
    #: This attempt, or a later one, of this job already failed: report that, run nothing.
    STALE = 2
    #: Another delivery holds the lease: wait, then claim again.
    BUSY = 3
    #: The delivery is from before the forwarder's current epoch: run nothing, report nothing.
    FENCED = 4
    #: The job was cancelled (its RQ job hash carries ``hybridq_cancel``): run nothing, report nothing.
    CANCELLED = 5


class FinishReply(enum.IntEnum):
    """The outcome script's reply."""

    #: This run's outcome is stored.
    STORED = 0
    #: An earlier success was kept (this run had lost its lease): the task ran twice.
    KEPT = 1
    #: This run's outcome was already stored (a retry after a lost reply).
    ALREADY_STORED = 2
    #: A later attempt of this job already succeeded: this run's outcome is superseded.
    SUPERSEDED = 3


class Overwrite(enum.Enum):
    """What a push does with a job the backend already holds (the value the push script reads)."""

    #: Nothing: a push is idempotent per job id (the first run of a job).
    NEVER = "0"
    #: Replace a copy of an earlier run (a retry, a redelivery after a lost worker, a requeue);
    #: a push of the run it already holds does nothing, unless RQ ended that run without a
    #: worker ever claiming it (then it is queued again).
    EARLIER = "1"
    #: Replace whatever it holds (it holds a copy no worker will ever take).
    ALWAYS = "2"
