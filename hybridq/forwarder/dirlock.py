"""The journal directory a forwarder holds while it runs: open, locked, and checked at each step.

The forwarder lock (:data:`hybridq.ledger.checkpoint.LOCK_NAME`) is taken in this very directory,
through a descriptor held open until the forwarder closes, and every step checks that the path
still leads there: a journal swapped in under the same path is never forwarded from
(:class:`~hybridq.errors.JournalPathError`). :class:`hybridq.forwarder.loop.Forwarder` holds one.

This module must not import redis or rq.
"""

from __future__ import annotations

import os

from hybridq.journal.ownerlock import take_owner_lock
from hybridq.journal.paths import check_journal_dir, open_journal_dir
from hybridq.ledger.checkpoint import LOCK_NAME

__all__ = ["DirLock"]


class DirLock:
    """The descriptors of one journal directory and of its forwarder lock (see module docstring)."""

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None

    @property
    def locked(self) -> bool:
        """Whether the forwarder lock is held."""
        return self._lock_fd is not None

    def open(self) -> None:
        """Open the directory (held while the forwarder runs)."""
        self._dir_fd = open_journal_dir(self.journal)

    def lock(self) -> None:
        """Take the forwarder lock in the directory opened; :class:`JournalLocked` if it is held."""
        self._lock_fd = take_owner_lock(
            os.path.join(self.journal, LOCK_NAME),
            owner="forwarder",
            busy="one forwarder per journal directory",
            patience_s=1.0,  # `hybridq status` probes it for an instant: not a reason to give up
            dir_fd=self._dir_fd,
        )

    def check(self) -> None:
        """Raise :class:`JournalPathError` if the path no longer leads to the directory opened."""
        if self._dir_fd is not None:
            check_journal_dir(self._dir_fd, self.journal)  # JournalPathError: stop, never forward

    def release(self) -> None:
        """Release the lock, then the directory (idempotent)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
