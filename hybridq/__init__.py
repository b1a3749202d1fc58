"""hybridq: a task queue whose source of truth is a local, fsync'd, append-only journal.

Redis (through RQ) is only a cache and a transport: see ``docs/guarantees.md``. This package's public
names are listed in ``__all__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridq.lazy import lazy_names

if TYPE_CHECKING:
    from .cancels import CancelResult, cancel
    from .client.queue import fetch_job
    from .context import CurrentJob, current_job
    from .envelope.model import Envelope, Retry
    from .errors import (
        Cancelled,
        EnvelopeError,
        HybridqError,
        JobFailed,
        JobNotFailed,
        JobWaitTimeout,
        JournalClosed,
        JournalCorruption,
        JournalError,
        JournalIOError,
        JournalLocked,
        JournalPathError,
        MissingExtra,
        NodeUnavailable,
        NotSerializable,
        OutcomeUnknown,
        QueueFull,
        RecordTooLarge,
        ResultNotKept,
        RetryLater,
        RetryLaterExpired,
        SignatureError,
        SigningKeyError,
        StateFileCorrupt,
        TransportError,
    )
    from .job import Job
    from .journal import Durability
    from .ops.failures import FailedJob, failed_jobs, requeue
    from .ops.status import stats
    from .producer.queue import Queue
    from .producer.task import Task, task
    from .schedules import schedule
    from .workflows.canvas import Signature, chain, chord, group, sig

__version__ = "0.1.0"

__all__ = [
    "CancelResult",
    "Cancelled",
    "CurrentJob",
    "Durability",
    "Envelope",
    "EnvelopeError",
    "FailedJob",
    "HybridqError",
    "Job",
    "JobFailed",
    "JobNotFailed",
    "JobWaitTimeout",
    "JournalClosed",
    "JournalCorruption",
    "JournalError",
    "JournalIOError",
    "JournalLocked",
    "JournalPathError",
    "MissingExtra",
    "NodeUnavailable",
    "NotSerializable",
    "OutcomeUnknown",
    "Queue",
    "QueueFull",
    "RecordTooLarge",
    "ResultNotKept",
    "Retry",
    "RetryLater",
    "RetryLaterExpired",
    "Signature",
    "SignatureError",
    "SigningKeyError",
    "StateFileCorrupt",
    "Task",
    "TransportError",
    "__version__",
    "cancel",
    "chain",
    "chord",
    "current_job",
    "failed_jobs",
    "fetch_job",
    "group",
    "requeue",
    "schedule",
    "sig",
    "stats",
    "task",
]

# Where each public name lives. They load on first use (PEP 562), so that importing one part of the
# package (``hybridq.worker`` in a worker process) does not load the others (the producer, the
# journal writer): a module imports what it uses from its own module, never through this one.
_LAZY = {
    "CancelResult": ".cancels",
    "Cancelled": ".errors",
    "CurrentJob": ".context",
    "cancel": ".cancels",
    "Durability": ".journal",
    "Envelope": ".envelope.model",
    "EnvelopeError": ".errors",
    "FailedJob": ".ops.failures",
    "HybridqError": ".errors",
    "Job": ".job",
    "JobFailed": ".errors",
    "JobNotFailed": ".ops.failures",
    "JobWaitTimeout": ".errors",
    "JournalClosed": ".errors",
    "JournalCorruption": ".errors",
    "JournalError": ".errors",
    "JournalIOError": ".errors",
    "JournalLocked": ".errors",
    "JournalPathError": ".errors",
    "MissingExtra": ".errors",
    "NodeUnavailable": ".errors",
    "NotSerializable": ".errors",
    "OutcomeUnknown": ".errors",
    "Queue": ".producer.queue",
    "QueueFull": ".errors",
    "RecordTooLarge": ".errors",
    "ResultNotKept": ".errors",
    "Retry": ".envelope.model",
    "RetryLater": ".errors",
    "RetryLaterExpired": ".errors",
    "SignatureError": ".security.signing",
    "SigningKeyError": ".security.signing",
    "StateFileCorrupt": ".errors",
    "Task": ".producer.task",
    "TransportError": ".errors",
    "current_job": ".context",
    "failed_jobs": ".ops.failures",
    "fetch_job": ".client.queue",
    "requeue": ".ops.failures",
    "schedule": ".schedules",
    "stats": ".ops.status",
    "task": ".producer.task",
    "Signature": ".workflows.canvas",
    "chain": ".workflows.canvas",
    "chord": ".workflows.canvas",
    "group": ".workflows.canvas",
    "sig": ".workflows.canvas",
}


__getattr__, __dir__ = lazy_names(globals(), _LAZY)
