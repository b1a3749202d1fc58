"""hybridq: a task queue whose source of truth is a local, fsync'd, append-only journal.

Redis (through RQ) is only a cache and a transport: see ``docs/guarantees.md``. This package's public
names are listed in ``__all__``.
"""

from .context import CurrentJob, current_job
from .envelope import Envelope, Retry
from .errors import (
    EnvelopeError,
    HybridqError,
    JournalClosed,
    JournalCorruption,
    JournalError,
    JournalIOError,
    JournalLocked,
    JournalPathError,
    NotSerializable,
    QueueFull,
    RecordTooLarge,
    StateFileCorrupt,
    TransportError,
)
from .failures import FailedJob, JobNotFailed, failed_jobs, requeue
from .journal import Durability
from .producer import Job, Queue, Task, task
from .signing import SignatureError, SigningKeyError

__version__ = "0.1.0"

__all__ = [
    "CurrentJob",
    "Durability",
    "Envelope",
    "EnvelopeError",
    "FailedJob",
    "HybridqError",
    "Job",
    "JobNotFailed",
    "JournalClosed",
    "JournalCorruption",
    "JournalError",
    "JournalIOError",
    "JournalLocked",
    "JournalPathError",
    "NotSerializable",
    "Queue",
    "QueueFull",
    "RecordTooLarge",
    "Retry",
    "SignatureError",
    "SigningKeyError",
    "StateFileCorrupt",
    "Task",
    "TransportError",
    "__version__",
    "current_job",
    "failed_jobs",
    "requeue",
    "task",
]
