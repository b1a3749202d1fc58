"""hybridq: a task queue whose source of truth is a local, fsync'd, append-only journal.

Redis (through RQ) is only a cache and a transport: see ``DESIGN.md``. This package's public
names are listed in ``__all__``.
"""

from .errors import (
    HybridqError,
    JournalClosed,
    JournalCorruption,
    JournalError,
    JournalIOError,
    JournalLocked,
    JournalPathError,
    RecordTooLarge,
    StateFileCorrupt,
)

__version__ = "0.1.0"

__all__ = [
    "HybridqError",
    "JournalClosed",
    "JournalCorruption",
    "JournalError",
    "JournalIOError",
    "JournalLocked",
    "JournalPathError",
    "RecordTooLarge",
    "StateFileCorrupt",
    "__version__",
]
