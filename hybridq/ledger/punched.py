"""The punched ranges of one journal segment, as the ledger index keeps them (issue 29).

A range of a sealed segment listed in its hole map (:mod:`hybridq.journal.holes`, durable before
the punch) holds only jobs that were durably terminal when it was mapped, and a terminal job
stays terminal: so :class:`~hybridq.ledger.outcomes.SegmentOutcomes` needs no offset of those
that ``succeeded`` in it, only the range -- any offset inside answers "terminal, succeeded",
as a job of a compacted segment does (docs/forwarder.md, "Memory: the bound that holds now").
The jobs of other outcomes in it (cancelled, invalid, failed and requeued: the forwarder does
not punch failures still listed) keep their offset, so that no answer changes.

:class:`PunchedRanges` holds the ranges as three sorted arrays (24 bytes a range, a range is at
least 16 KiB of records) and how many jobs they hold whose offset is not listed (:attr:`implicit`).
:func:`hybridq.ledger.punched_maps.collapse_punched` applies the hole maps on disk to an index at
start.

This module must not import redis or rq.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator

__all__ = ["PunchedRanges"]


class PunchedRanges:
    """Sorted, disjoint byte ranges ``[start, end)`` of a segment and how many jobs each holds."""

    __slots__ = ("counts", "ends", "implicit", "starts")

    def __init__(self) -> None:
        self.starts = array("Q")
        self.ends = array("Q")
        #: Jobs (data records) in each range, listed or not.
        self.counts = array("Q")
        #: Jobs in the ranges whose offset the map does not list (all ``succeeded``).
        self.implicit = 0

    def __len__(self) -> int:
        return len(self.starts)

    def covers(self, offset: int) -> bool:
        """Whether ``offset`` lies in a punched range (one ``bisect``, in C)."""
        i = bisect_right(self.starts, offset) - 1
        return i >= 0 and offset < self.ends[i]

    def spans(self) -> Iterator[tuple[int, int, int]]:
        """``(start, end, jobs)`` of each range, in order."""
        return zip(self.starts, self.ends, self.counts, strict=True)

    def jobs(self) -> int:
        """Jobs in all the ranges."""
        return sum(self.counts)

    def with_span(self, start: int, end: int, count: int) -> PunchedRanges:
        """A copy with ``[start, end)`` added; the ranges inside it are replaced by it.

        A hole map's ranges only grow (adjacent ones merge): one that crosses an end of the new
        range raises ``ValueError`` (the maps do not agree; the caller keeps the old ranges).
        """
        if not 0 <= start < end or count < 1:
            raise ValueError(f"punched range {start}-{end} of {count} jobs is not valid")
        a = bisect_left(self.starts, start)
        b = bisect_left(self.starts, end)
        if (a and self.ends[a - 1] > start) or (b > a and self.ends[b - 1] > end):
            raise ValueError(f"punched range {start}-{end} crosses one already punched")
        out = PunchedRanges()
        out.starts = self.starts[:a] + array("Q", (start,)) + self.starts[b:]
        out.ends = self.ends[:a] + array("Q", (end,)) + self.ends[b:]
        out.counts = self.counts[:a] + array("Q", (count,)) + self.counts[b:]
        return out
