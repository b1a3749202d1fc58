"""hybridq: a task queue whose source of truth is a local, fsync'd, append-only journal.

Redis (through RQ) is only a cache and a transport: see ``DESIGN.md``. This package's public
names are listed in ``__all__``.
"""

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
from .journal import Durability
from .producer import Job, Queue, Task, task

__version__ = "0.1.0"

__all__ = [
    "Durability",
    "Envelope",
    "EnvelopeError",
    "HybridqError",
    "Job",
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
    "StateFileCorrupt",
    "Task",
    "TransportError",
    "__version__",
    "task",
]
