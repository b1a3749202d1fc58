"""The check of the sealed segments that start-up skips, in a background thread.

Start-up checks only each chain's last segment (``recover(tails_only=True)``): torn tails and
dead chains are all it must repair before the first record is read, and reading every segment
made the first job wait for the whole journal (seconds at a million jobs). The sealed segments
before the tails are checked here, every record's CRC as :func:`~hybridq.journal.recovery.verify`
does, throttled so that the check never competes with the consumer for long. Corruption stays
loud (docs/reliability.md rule 11): it is logged at once and kept; the owner raises it
(:meth:`BackgroundCheck.raise_if_failed`) and stops as start-up would have refused to start.
A segment deleted meanwhile (compacted: every job in it finished) is skipped.

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from hybridq.errors import JournalCorruption, JournalError, JournalIOError

from .fileops import OS_FILEOPS, FileOps
from .reader import JournalReader, list_chains, seal_offset

__all__ = ["BackgroundCheck", "sealed_segments"]

log = logging.getLogger("hybridq.journal")

#: Bytes per second the background check reads, at most (a 64 MiB segment in about a second).
CHECK_BYTES_PER_S = 64 << 20


def sealed_segments(path: str) -> list[tuple[str, int]]:
    """The sealed segments: every one but each chain's last, and the last if sealed.

    The ones a tails-only start-up did not read (:meth:`JournalReader.check`).
    """
    sealed = []
    for writer, indices in list_chains(path).items():
        sealed += [(writer, index) for index in indices[:-1]]
        if seal_offset(path, writer, indices[-1]) is not None:
            sealed.append((writer, indices[-1]))
    return sealed


class BackgroundCheck:
    """Check ``segments`` of the journal at ``path`` in a daemon thread (see the module docstring).

    Args:
        path: the journal directory.
        segments: ``(writer id, segment index)`` to check, usually :func:`sealed_segments`.
        fileops: the file-operations seam (tests count what is read).
        bytes_per_s: the throttle (0: as fast as it reads).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        segments: list[tuple[str, int]],
        *,
        fileops: FileOps = OS_FILEOPS,
        bytes_per_s: int = CHECK_BYTES_PER_S,
    ) -> None:
        self._reader = JournalReader(path, fileops=fileops)
        self._segments = segments
        self._bytes_per_s = bytes_per_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The corruption found, if any (raised by :meth:`raise_if_failed`).
        self.failure: JournalError | None = None
        #: Segments and data records checked so far; whether the check is over.
        self.checked = 0
        self.records = 0
        self.finished = threading.Event()

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="hybridq-journal-check", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread between two chunks and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def raise_if_failed(self) -> None:
        """Raise the corruption the check found, if it found any."""
        if self.failure is not None:
            raise self.failure

    def run(self) -> None:
        """Check every segment (called by the thread; callable directly, e.g. in tests)."""
        started = time.monotonic()
        self._reader.on_bytes = self._throttle
        try:
            for writer_id, index in self._segments:
                if self._stop.is_set():
                    return
                try:
                    self.records += self._reader.check_segment(writer_id, index)
                except FileNotFoundError:
                    continue  # compacted since start-up: every job in it had finished
                except JournalCorruption as exc:
                    self.failure = exc
                    log.error("journal: background check found corruption: %s", exc)
                    return
                except (OSError, JournalError) as exc:  # a failing disk: as loud as damage, never silent
                    self.failure = (
                        exc if isinstance(exc, JournalError) else JournalIOError(str(writer_id), "read", exc)
                    )
                    log.error(
                        "journal: background check cannot read %s segment %d: %s", writer_id, index, exc
                    )
                    return
                self.checked += 1
            log.info(
                "journal: %d sealed segments checked in the background (%d records, %.1f s)",
                self.checked,
                self.records,
                time.monotonic() - started,
            )
        finally:
            self.finished.set()

    def _throttle(self, nbytes: int) -> None:
        if self._bytes_per_s > 0:
            self._stop.wait(nbytes / self._bytes_per_s)
