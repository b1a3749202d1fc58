"""The answers of a :class:`~hybridq.ledger.outcomes.SegmentOutcomes` about all its jobs at once.

:class:`OutcomeCounts` holds the map's reads over the whole of it: how many jobs ended with each
outcome, whether any did with one, how many lie below an offset, the punched ranges and the
offsets by outcome (what a saved index writes). Apart from :mod:`hybridq.ledger.outcomes`
(house style: small modules), which keeps the per-offset operations and the merge;
:class:`SegmentOutcomes` inherits these, so they are called as before. A base without
``__dict__`` (``__slots__ = ()``): the map's memory per job (``tests/unit/test_index_memory.py``)
stays as it was.

This module must not import redis or rq.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right

from hybridq.ledger.outcome_codes import _CODES, _NAMES, _NARROW_MAX, _SUCCEEDED
from hybridq.ledger.outcome_spill import SpilledArrays
from hybridq.ledger.punched import PunchedRanges, listed_in

__all__ = ["OutcomeCounts"]


class OutcomeCounts:
    """The whole-map reads of :class:`~hybridq.ledger.outcomes.SegmentOutcomes` (see module docstring)."""

    __slots__ = ()

    # The map's state, set by SegmentOutcomes (hybridq.ledger.outcomes).
    _offsets: array[int]
    _codes: bytearray
    _odd: dict[int, str] | None
    _punched: PunchedRanges | None
    recent: dict[int, str]
    _spill: SpilledArrays | None

    def tally(self) -> dict[str, int]:
        """How many jobs ended with each outcome (counted in C)."""
        spill = self._spill
        if spill is None:
            out = {name: self._codes.count(code) for name, code in _CODES.items()}
        else:
            out = {name: spill.tally[code] for name, code in _CODES.items()}
        if self._punched is not None:
            out[_NAMES[_SUCCEEDED]] += self._punched.implicit
        for outcome in (*self.recent.values(), *(self._odd or {}).values()):
            out[outcome] = out.get(outcome, 0) + 1
        return {name: n for name, n in out.items() if n}

    def holds(self, outcome: str) -> bool:
        """Whether a job here ended with ``outcome`` (stops at the first; memchr over the codes)."""
        code = _CODES.get(outcome)
        if code is not None and (code in self._codes if self._spill is None else self._spill.tally[code]):
            return True
        if outcome in self.recent.values() or (self._odd is not None and outcome in self._odd.values()):
            return True
        return code == _SUCCEEDED and self._punched is not None and self._punched.implicit > 0

    def count_below(self, end: int) -> int:
        """How many of the offsets are less than ``end`` (a punched range's jobs: if all are).

        A range that ``end`` cuts counts only its listed jobs: never more than there are (the
        compactor deletes a segment when all its jobs are counted).
        """
        listed = (
            (bisect_left(self._offsets, end) if self._spill is None else self._spill.below(end))
            + sum(1 for offset in self.recent if offset < end)
            + sum(1 for offset in self._odd or () if offset < end)
        )
        punched = self._punched
        if punched is None:
            return listed
        if not punched.ends or punched.ends[-1] <= end:
            return listed + punched.implicit
        below = bisect_right(punched.ends, end)
        offsets = self._arrays()[0]  # read back whole if spilled
        return listed + sum(punched.counts[:below]) - listed_in(punched, offsets, self._others(), below)

    def punched(self) -> list[tuple[int, int, int]]:
        """The punched ranges: ``(start, end, jobs)`` each, in order."""
        return [] if self._punched is None else list(self._punched.spans())

    def groups(self) -> dict[str, list[int]]:
        """The offsets (sorted) under each outcome: the inverse of :meth:`from_groups`."""
        out: dict[str, list[int]] = {}
        merged, codes = self._arrays()  # read back whole if spilled
        for name, code in _CODES.items():
            n = codes.count(code)
            if n == len(codes):
                out[name] = merged.tolist()
            elif n:
                out[name] = [offset for offset, c in zip(merged, codes, strict=True) if c == code]
        for offset, outcome in sorted((*self.recent.items(), *(self._odd or {}).items())):
            out.setdefault(outcome, []).append(offset)
        for offsets in out.values():
            offsets.sort()
        return {name: offsets for name, offsets in out.items() if offsets}

    def _arrays(self) -> tuple[array[int], bytearray]:
        """The merged arrays, read back whole from the file if spilled (for reads of the whole map)."""
        spill = self._spill
        if spill is None:
            return self._offsets, self._codes
        return spill.read("I" if spill.last <= _NARROW_MAX else "Q")

    def _others(self) -> list[int]:
        """The listed offsets not in the arrays (few: :attr:`recent` and :attr:`_odd`)."""
        return [*self.recent, *(self._odd or ())]
