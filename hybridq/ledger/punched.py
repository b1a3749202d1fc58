"""The punched ranges of one journal segment, as the ledger index keeps them (issue 29).

A range of a sealed segment listed in its hole map (:mod:`hybridq.journal.holes`, durable before
the punch) holds only jobs that were durably terminal when it was mapped, and a terminal job
stays terminal: so :class:`~hybridq.ledger.outcomes.SegmentOutcomes` needs no offset of those
that ``succeeded`` in it, only the range -- any offset inside answers "terminal, succeeded",
as a job of a compacted segment does (docs/forwarder.md, "Memory: the bound that holds now").
The jobs of other outcomes in it (cancelled, invalid, failed and requeued: the forwarder does
not punch failures still listed) keep their offset, so that no answer changes.

:class:`PunchedRanges` holds the ranges as three sorted arrays (24 bytes a range, a range is at
least 16 KiB of records or half its segment: ``hybridq.forwarder.punch``) and how many jobs they
hold whose offset is not listed (:attr:`implicit`).
:func:`hybridq.ledger.punched_maps.collapse_punched` applies the hole maps on disk to an index at
start.

This module must not import redis or rq.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from itertools import repeat

__all__ = ["PunchedRanges", "listed_in", "without"]


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

    def with_spans(self, spans: Iterable[tuple[int, int, int]]) -> PunchedRanges:
        """A copy with ``spans`` (``(start, end, jobs)``) added; the ranges inside one are replaced by it.

        A hole map's ranges only grow (adjacent ones merge): spans that overlap one another, or
        one that crosses a range kept, raise ``ValueError`` (the maps do not agree; the caller
        keeps the old ranges). One sort of the ranges, old and new.
        """
        new = sorted(spans)
        at = 0
        for start, end, count in new:
            if start < at or end <= start or count < 1:
                raise ValueError(
                    f"punched range {start}-{end} of {count} jobs is not valid or overlaps another"
                )
            at = end
        starts = [span[0] for span in new]
        kept = []
        for start, end, count in self.spans():
            k = bisect_right(starts, start) - 1
            if k >= 0 and new[k][1] >= end:
                continue  # inside a new one: replaced
            if (k >= 0 and new[k][1] > start) or (k + 1 < len(new) and new[k + 1][0] < end):
                raise ValueError(f"punched range {start}-{end} crosses a new one")
            kept.append((start, end, count))
        merged = sorted([*kept, *new])
        out = PunchedRanges()
        out.starts = array("Q", [span[0] for span in merged])
        out.ends = array("Q", [span[1] for span in merged])
        out.counts = array("Q", [span[2] for span in merged])
        return out


def listed_in(
    ranges: PunchedRanges, offsets: array[int], others: Iterable[int], upto: int | None = None
) -> int:
    """How many of the sorted ``offsets`` and of ``others`` lie in the first ``upto`` ranges (all)."""
    starts, ends = (
        (ranges.starts, ranges.ends) if upto is None else (ranges.starts[:upto], ranges.ends[:upto])
    )
    n = sum(map(bisect_left, repeat(offsets), ends)) - sum(map(bisect_left, repeat(offsets), starts))
    for offset in others:
        i = bisect_right(starts, offset) - 1
        n += i >= 0 and offset < ends[i]
    return n


def without(
    offsets: array[int], codes: bytearray, ranges: PunchedRanges, code: int
) -> tuple[array[int], bytearray]:
    """New arrays: the sorted ``offsets`` and their ``codes``, less those in ``ranges`` of ``code``."""
    kept, kept_codes = array(offsets.typecode), bytearray()
    prev = 0
    for start, end in zip(ranges.starts, ranges.ends, strict=True):
        a = bisect_left(offsets, start, prev)
        b = bisect_left(offsets, end, a)
        kept += offsets[prev:a]
        kept_codes += codes[prev:a]
        if codes.count(code, a, b) != b - a:
            for i in range(a, b):
                if codes[i] != code:
                    kept.append(offsets[i])
                    kept_codes.append(codes[i])
        prev = b
    kept += offsets[prev:]
    kept_codes += codes[prev:]
    return kept, kept_codes
