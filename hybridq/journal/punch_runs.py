"""The runs of consecutive records a punch takes out of a sealed segment (issue 29).

Every puncher of sealed segments (the layers above have more than one) walks a segment's
records in order and punches the runs of those it may: a run ends at a record
kept or at a range punched already (a gap in the offsets), and is kept only if it is at least
``min_bytes`` long or half the segment (a punch frees only the whole 4 KiB blocks inside its
range, and each range costs 40 bytes of map: docs/journal-format.md, *Hole maps*). Here so
that punchers that may not import one another share it.

This module must not import redis or rq.
"""

from __future__ import annotations

from .holes import Hole
from .records import Record

__all__ = ["RunBuilder"]


class RunBuilder:
    """The runs to punch of one segment, fed its records in order (see the module docstring)."""

    def __init__(self, min_bytes: int, size: int) -> None:
        #: A run is kept when at least this long, or half of ``size`` (the segment's data bytes).
        self.min_bytes = min_bytes
        self.size = size
        #: The runs kept so far, in order.
        self.runs: list[Hole] = []
        self._run: list[int] = []  # start, end, first seq, next seq, count of the current run

    def breaks_at(self, rec: Record) -> bool:
        """Whether ``rec`` does not follow the current run (a punched range between)."""
        return bool(self._run) and self._run[1] != rec.offset

    def add(self, rec: Record) -> None:
        """Put ``rec`` in the current run (a new one if none)."""
        run = self._run
        if run:
            run[1], run[3], run[4] = rec.end, rec.seq + 1, run[4] + 1
        else:
            run.extend((rec.offset, rec.end, rec.seq, rec.seq + 1, 1))

    def close(self) -> bool:
        """End the current run; whether it was kept (long enough)."""
        run = self._run
        kept = bool(run) and (run[1] - run[0] >= self.min_bytes or 2 * (run[1] - run[0]) >= self.size)
        if kept:
            self.runs.append(Hole(*run))
        run.clear()
        return kept
