"""The dashboard's throughput: outcomes the ledger recorded over the last minutes, per queue."""

from __future__ import annotations

import os
import time
from collections import deque

from hybridq.errors import JournalCorruption
from hybridq.journal import JournalReader, RecordType
from hybridq.ledger import Entry, ledger_dir

__all__ = ["RecentOutcomes"]


class RecentOutcomes:
    """Outcomes in the ledger over the last ``window_s`` seconds, per queue (throughput).

    Tails the ledger: each :meth:`counts` reads only what was appended since the last, and starts
    again when compaction deleted a segment under it. Not thread-safe (the caller locks).
    """

    def __init__(self, journal: str, window_s: float = 300.0) -> None:
        self.journal = journal
        self.window_s = window_s
        self._reader: JournalReader | None = None
        self._recent: deque[tuple[float, str, str]] = deque()

    def counts(self, now: float | None = None) -> dict[str, dict[str, int]]:
        """Per queue, ``succeeded``/``failed``/``cancelled`` outcomes in the window."""
        now = time.time() if now is None else now
        directory = ledger_dir(self.journal)
        if os.path.isdir(directory):
            try:
                self._tail(directory, now - self.window_s)
            except (JournalCorruption, FileNotFoundError):
                self._reader, self._recent = None, deque()
                self._tail(directory, now - self.window_s)
        cutoff = now - self.window_s
        recent = sorted(r for r in self._recent if r[0] >= cutoff)
        self._recent = deque(recent)
        out: dict[str, dict[str, int]] = {}
        for _, queue, outcome in recent:
            per = out.setdefault(queue, {"succeeded": 0, "failed": 0, "cancelled": 0})
            per[outcome] = per.get(outcome, 0) + 1
        return out

    def _tail(self, directory: str, cutoff: float) -> None:
        if self._reader is None:
            self._reader = JournalReader(directory)
        for record in self._reader.records():
            if record.rtype != RecordType.DATA or b'"t":"done"' not in record.payload:
                continue
            try:
                entry = Entry.from_bytes(record.payload)
            except (ValueError, KeyError, TypeError):
                continue
            if entry.at >= cutoff and not entry.dup:
                self._recent.append((entry.at, entry.queue or "?", entry.outcome or "failed"))
