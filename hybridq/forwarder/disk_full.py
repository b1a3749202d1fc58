"""The forwarder's pause on a full disk: a step that failed with ENOSPC (or EDQUOT) is retried.

A checkpoint or ledger write that fails because the disk (or the quota) is full changed nothing
durable (docs/reliability.md): the ledger continues in a new segment, completion events stay in
Redis until the ledger has them, a checkpoint is replaced atomically or not at all. So the loop
(:meth:`hybridq.forwarder.loop.Forwarder.run`) does not stop: it tries the step again, backing off
from the first to the second value of :data:`DISK_FULL_BACKOFF_S`, and logs once when the disk
fills and once when writes succeed again. One :class:`DiskFullPause` lives for one run of the loop.

This module must not import redis or rq.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hybridq.errors import JournalIOError
from hybridq.ledger.sqlite_errors import FULL_ERRNOS

__all__ = ["DISK_FULL", "DISK_FULL_BACKOFF_S", "DiskFullPause"]

log = logging.getLogger("hybridq.forwarder")

#: A full disk (or quota) pauses the forwarder instead of stopping it: it retries, backing off
#: from the first to the second value (seconds), until its writes succeed again.
DISK_FULL_BACKOFF_S = (0.5, 10.0)
#: The errors that mean a full disk (or quota): anything else stops the loop (the same set the
#: key table's SQLite errors are mapped by).
DISK_FULL = FULL_ERRNOS


class DiskFullPause:
    """The backoff between the retries of a step while the disk is full, and its two log lines.

    Args:
        sleep: waits that many seconds, or less when the forwarder is stopped or nudged.
    """

    def __init__(self, sleep: Callable[[float], None]) -> None:
        self._sleep = sleep
        self._full_since: float | None = None
        self._delay = DISK_FULL_BACKOFF_S[0]

    def wait(self, exc: JournalIOError | OSError) -> None:
        """Wait before the step is retried (``exc``: its error, which means a full disk)."""
        if self._full_since is None:
            self._full_since = time.monotonic()
            log.error("disk full (%s): forwarding paused, retrying until writes succeed", exc)
        self._sleep(self._delay)
        self._delay = min(DISK_FULL_BACKOFF_S[1], self._delay * 2)

    @property
    def paused(self) -> bool:
        """Whether a pause is on (a step failed on a full disk, and none showed room since)."""
        return self._full_since is not None

    def over(self) -> None:
        """A step succeeded: log the end of a pause, if one was on, and start the backoff over."""
        if self._full_since is not None:
            log.warning("writing again after %.1f s of a full disk", time.monotonic() - self._full_since)
            self._full_since, self._delay = None, DISK_FULL_BACKOFF_S[0]
