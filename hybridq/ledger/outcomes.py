"""The outcomes of one journal segment's finished jobs, compact: :class:`SegmentOutcomes`.

:attr:`LedgerIndex.terminal <hybridq.ledger.index.LedgerIndex.terminal>` keeps one per journal
segment not compacted yet, so its size is the forwarder's memory per finished job of the live
journal (issue 29; docs/forwarder.md, "Memory: the bound that holds now"). A ``dict`` took 57
bytes a job (a slot and the offset's ``int``); this keeps about 6
(``tests/unit/test_index_memory.py``):

* the offsets in a sorted ``array`` (4 bytes each; 8 once an offset passes ``2**32``, which a
  segment larger than the default 64 MiB may reach) with a parallel ``bytearray`` of outcome
  codes (``cancelled``, ``failed``, ``succeeded``, ``invalid``), found by one ``bisect`` (C);
  a map with none merged yet shares two empty ones;
* the latest additions in a small ``dict`` (:attr:`recent`), merged into the arrays when it
  holds more than ``max(MERGE_FLOOR, len / MERGE_FRACTION)``: jobs mostly finish in the order
  they were written, so a merge is mostly a sort of the new offsets and an append; those that
  finish out of order are sorted in with the arrays' tail from the first of them (C when all
  succeeded), or, few in a long tail, each put in place by ``bisect`` and slices;
* any other outcome name (none is written today; an entry's is not checked) in a plain ``dict``
  (:attr:`_odd`), never merged, so that nothing read back differs from what was put in;
* the ranges punched out of the segment (:mod:`hybridq.ledger.punched`, :meth:`drop_ranges`):
  any offset inside one is a job that ``succeeded`` unless another outcome is listed for it.
  Their jobs are counted (``len``, :meth:`tally`, :meth:`count_below`) but not listed:
  iterating, :meth:`items` and :meth:`groups` give the listed offsets only, and
  :meth:`punched` the ranges (the saved index keeps both).

Past the forwarder's cap on the offsets its index holds in memory, the arrays move to a file
in the journal's ``.index-spill`` (:meth:`spill`, :mod:`hybridq.ledger.outcome_disk`,
:mod:`hybridq.ledger.outcome_spill` and :mod:`hybridq.ledger.spill_files`): a lookup then reads
one block of it, the rest stays as above.

The first three hold disjoint offsets. An offset is in the map if it is in any of them or in a
range: a lookup that answered ``False`` for a finished job would let it run again
(docs/reliability.md), so ``tests/unit/test_segment_outcomes.py`` checks every operation
against a plain ``dict``, and ``tests/unit/test_punched_outcomes.py`` the ranges. The codes, the
arrays' bounds and the views that decode them are :mod:`hybridq.ledger.outcome_codes`.

This module must not import redis or rq.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import ItemsView, Iterable, Iterator, Mapping, MutableMapping, ValuesView
from typing import TypeVar, overload

from hybridq.ledger.outcome_arrays import merged
from hybridq.ledger.outcome_codes import (
    _CODES,
    _NAMES,
    _NARROW_MAX,
    _NO_CODES,
    _NO_OFFSETS,
    _NONE,
    _SUCCEEDED,
    _WIDE_MAX,
    _Items,
    _Values,
)
from hybridq.ledger.outcome_disk import SpillableOutcomes
from hybridq.ledger.outcome_spill import SpilledArrays
from hybridq.ledger.punched import PunchedRanges, listed_in, without

_T = TypeVar("_T")

#: The least :attr:`SegmentOutcomes.recent` holds before it is merged into the arrays, and the
#: fraction of the arrays it may reach past that (the memory it costs against the merges' copies).
#: The floor is low so that a segment with few finished jobs soon leaves the ``dict`` (about
#: 90 bytes a job) for the arrays: a merge of a small array is cheap.
MERGE_FLOOR = 8
MERGE_FRACTION = 64


class SegmentOutcomes(SpillableOutcomes, MutableMapping[int, str]):
    """Offset -> outcome of the finished jobs of one journal segment (see the module docstring)."""

    __slots__ = ()  # the state's slots are SpillableOutcomes's (hybridq.ledger.outcome_disk)

    def __init__(self, items: Mapping[int, str] | Iterable[tuple[int, str]] = ()) -> None:
        #: Sorted offsets, and the outcome code of each (the shared empty ones until a merge).
        self._offsets = _NO_OFFSETS
        self._codes = _NO_CODES
        #: The largest offset in :attr:`_offsets` (minus infinity: none, so that no offset is
        #: looked for in an empty array); a larger one is not there.
        self._last: float = _NONE
        #: Offsets added since the last merge, with their outcome.
        self.recent: dict[int, str] = {}
        self._merge_at = MERGE_FLOOR
        #: Where :meth:`has_merged` looks first: the slot after its last answer's (only a hint:
        #: an answer from it is checked against the offsets on both sides).
        self._at = 0
        #: Offsets whose outcome has no code (or that no array holds): never merged (``None``
        #: while there is none, which is nearly always: an empty ``dict`` costs 64 bytes).
        self._odd: dict[int, str] | None = None
        #: The punched ranges (``None`` while there is none).
        self._punched: PunchedRanges | None = None
        #: The arrays on disk (:meth:`spill`), ``None`` while in memory; then :attr:`_offsets`
        #: and :attr:`_codes` are the shared empty ones and :attr:`_last` is the file's.
        self._spill: SpilledArrays | None = None
        self.update(items)

    @classmethod
    def from_groups(cls, groups: Mapping[str, Iterable[int]]) -> SegmentOutcomes:
        """The map of the offsets listed under each outcome (how a saved index holds it).

        An offset listed twice keeps the outcome listed last (as ``dict.update`` did).
        """
        done = cls()
        if len(groups) == 1:
            ((name, listed),) = groups.items()
            offsets = sorted(set(listed))  # a set: the arrays must not hold an offset twice
            if name in _CODES and offsets and offsets[0] >= 0 and offsets[-1] <= _WIDE_MAX:
                # All of one outcome (a drain's segment: succeeded), in C.
                done._offsets = array("I" if offsets[-1] <= _NARROW_MAX else "Q", offsets)
                done._codes = bytearray((_CODES[name],)) * len(offsets)
                done._last = offsets[-1]
                done._merge_at = max(MERGE_FLOOR, len(offsets) // MERGE_FRACTION)
                return done
        recent, odd = done.recent, dict[int, str]()
        for name, listed in groups.items():
            offsets = list(listed)
            into, other = (recent, odd) if name in _CODES else (odd, recent)
            into.update(dict.fromkeys(offsets, name))
            if other:
                for offset in offsets:
                    other.pop(offset, None)
        done._odd = odd or None
        done._merge()
        return done

    def __eq__(self, other: object) -> bool:
        """As a ``Mapping`` of the listed offsets, and, against another map, the same ranges."""
        if isinstance(other, SegmentOutcomes) and self.punched() != other.punched():
            return False
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dict (defining __eq__ says so too)

    def __len__(self) -> int:
        n = len(self._offsets) + len(self.recent) + (len(self._odd) if self._odd else 0)
        if self._spill is not None:
            n += self._spill.n
        return n if self._punched is None else n + self._punched.implicit

    def __contains__(self, offset: object) -> bool:
        return isinstance(offset, int) and self.has(offset)

    def has(self, offset: int) -> bool:
        """Whether the job at ``offset`` finished (``in``, as a plain call).

        Asked first of :attr:`recent`: the harvest asks it of a job it has just added.
        """
        return offset in self.recent or self.has_merged(offset)

    def has_merged(self, offset: int) -> bool:
        """Whether the job at ``offset`` finished, if it is not in :attr:`recent`.

        :meth:`LedgerIndex.is_terminal <hybridq.ledger.index.LedgerIndex.is_terminal>` looks in
        :attr:`recent` itself, without a call. The array is tried first at the slot after the
        last answer's (the pushes and the reconcile pass ask in offset order), then by one
        ``bisect`` (C): ``offset <= _last``, so it ends on an offset.
        """
        if offset <= self._last:
            if self._spill is not None:
                return bool(self._spill.code_of(offset)) or self._unlisted(offset)
            offsets = self._offsets
            i = self._at
            if i < len(offsets):
                found = offsets[i]
                if found == offset:
                    self._at = i + 1
                    return True
                if found > offset and (i == 0 or offsets[i - 1] < offset):  # between two: not there
                    return (offset in self._odd if self._odd else False) or (
                        self._punched is not None and self._punched.covers(offset)
                    )
            i = bisect_left(offsets, offset)
            if offsets[i] == offset:
                self._at = i + 1
                return True
            self._at = i
        return (offset in self._odd if self._odd else False) or (
            self._punched is not None and self._punched.covers(offset)
        )

    @overload
    def get(self, offset: int, /) -> str | None: ...
    @overload
    def get(self, offset: int, default: str | _T, /) -> str | _T: ...
    def get(self, offset: int, default: str | _T | None = None) -> str | _T | None:
        """The outcome of the job at ``offset``, ``default`` if it is not finished."""
        found = self.recent.get(offset)
        if found is not None:
            return found
        if offset <= self._last:
            if self._spill is not None:
                code = self._spill.code_of(offset)
                if code:
                    return _NAMES[code]
            else:
                offsets = self._offsets
                i = bisect_left(offsets, offset)
                if offsets[i] == offset:
                    return _NAMES[self._codes[i]]
        if self._odd:
            found = self._odd.get(offset)
            if found is not None:
                return found
        return _NAMES[_SUCCEEDED] if self._punched is not None and self._punched.covers(offset) else default

    def __getitem__(self, offset: int) -> str:
        found = self.get(offset)
        if found is None:
            raise KeyError(offset)
        return found

    def insert(self, offset: int, outcome: str) -> str | None:
        """Add the job at ``offset`` with ``outcome`` unless it is there; returns the outcome it had.

        ``None``: it was not there (added). One lookup for what :meth:`LedgerIndex.apply
        <hybridq.ledger.index.LedgerIndex.apply>` asks of every finished job.
        """
        recent = self.recent
        if offset in recent:
            return recent[offset]
        if offset <= self._last:
            if self._spill is not None:
                code = self._spill.code_of(offset)
                if code:
                    return _NAMES[code]
            else:
                offsets = self._offsets
                i = bisect_left(offsets, offset)
                if offsets[i] == offset:
                    return _NAMES[self._codes[i]]
        if self._odd:
            found = self._odd.get(offset)
            if found is not None:
                return found
        if self._punched is not None and self._punched.covers(offset):
            return _NAMES[_SUCCEEDED]  # punched: it succeeded (another outcome would be listed)
        if outcome in _CODES:
            recent[offset] = outcome
            if len(recent) > self._merge_at:
                self._merge()
        else:
            self._set_odd(offset, outcome)
        return None

    def __setitem__(self, offset: int, outcome: str) -> None:
        spill = self._spill
        if spill is not None and offset <= self._last and spill.code_of(offset):
            self._set_spilled(spill, offset, outcome)
            return
        i = self._find(offset)
        code = _CODES.get(outcome)
        punched = self._punched
        if i < 0 and punched is not None and self._implicit(offset, punched):
            if outcome == _NAMES[_SUCCEEDED]:
                return  # it is that already
            # Listed below before it leaves the count: no moment with the job counted in neither.
            if code is None:
                self._set_odd(offset, outcome)
            else:
                self.recent[offset] = outcome
            punched.implicit -= 1
            if len(self.recent) > self._merge_at:
                self._merge()
            return
        if i >= 0 and code is not None:
            self._codes[i] = code  # in place (a merged array, never a shared empty one): a rank upgrade
            return
        if code is None:
            # In its new place before it leaves the old one: no moment with the job in neither.
            if i >= 0:
                self._set_odd(offset, outcome)
                self._discard(offset, i)
            else:
                self.recent.pop(offset, None)
                self._set_odd(offset, outcome)
            return
        self._discard(offset, i)
        self.recent[offset] = outcome
        if len(self.recent) > self._merge_at:
            self._merge()

    def __delitem__(self, offset: int) -> None:
        if offset not in self:
            raise KeyError(offset)
        if self._punched is not None and self._punched.covers(offset):
            raise ValueError(f"the job at offset {offset} was punched: it stays finished")
        spill = self._spill
        if spill is not None and offset <= self._last and spill.code_of(offset):
            self._in_memory(lambda: self._discard(offset, self._find(offset)))  # read back, out again
            return
        self._discard(offset, self._find(offset))

    def __iter__(self) -> Iterator[int]:
        yield from self._arrays()[0]
        yield from list(self.recent)
        yield from list(self._odd or ())

    def values(self) -> ValuesView[str]:
        """The outcomes (one per finished job), without a lookup per offset."""
        return _Values(self)

    def items(self) -> ItemsView[int, str]:
        """The (offset, outcome) pairs, without a lookup per offset."""
        return _Items(self)

    def drop_ranges(self, spans: Iterable[tuple[int, int, int]]) -> None:
        """Keep the punched ranges ``spans`` (``(start, end, jobs)``) instead of their jobs' offsets.

        Every job in them must be finished (the caller's to know: a durable hole map says so);
        those listed as ``succeeded`` leave the arrays (any offset in a range answers so), the
        others stay listed. The ranges may repeat or contain ones dropped before (a hole map
        only grows); one that crosses a range kept raises ``ValueError``, the map unchanged. New
        arrays are built aside and swapped in at once (as :meth:`_merge` does).
        """
        spans = list(spans)
        punched = (self._punched or PunchedRanges()).with_spans(spans)
        if not len(punched):
            return
        if self._spill is not None:
            self._in_memory(lambda: self.drop_ranges(spans))  # rare: once a punch
            return
        self._merge()  # recent into the arrays: what is listed is in the arrays or _odd
        kept, kept_codes = without(self._offsets, self._codes, punched, _SUCCEEDED)
        listed = listed_in(punched, kept, self._others())  # before the swap: a MemoryError changes nothing
        if listed > punched.jobs():
            raise ValueError(f"punched ranges of {punched.jobs()} jobs list {listed}")
        punched.implicit = punched.jobs() - listed
        self._offsets, self._codes, self._last = kept, kept_codes, kept[-1] if kept else _NONE
        self._punched, self._at = punched, 0

    def _implicit(self, offset: int, punched: PunchedRanges) -> bool:
        """Whether ``offset`` (not in the arrays) is a punched job that is not listed."""
        listed = offset in self.recent or (self._odd is not None and offset in self._odd)
        return not listed and punched.covers(offset)

    def _find(self, offset: int) -> int:
        """Where ``offset`` is in :attr:`_offsets`, -1 if it is not there (nor when spilled)."""
        if offset > self._last or self._spill is not None:
            return -1
        offsets = self._offsets
        i = bisect_left(offsets, offset)
        return i if offsets[i] == offset else -1

    def _set_odd(self, offset: int, outcome: str) -> None:
        if self._odd is None:
            self._odd = {}
        self._odd[offset] = outcome

    def _discard(self, offset: int, i: int) -> None:
        """Remove ``offset`` from wherever it is (``i``: its index in :attr:`_offsets`, or -1)."""
        if i >= 0:
            # New arrays swapped in at once (see _merge).
            offsets = self._offsets[:i] + self._offsets[i + 1 :]
            codes = self._codes[:i] + self._codes[i + 1 :]
            last = offsets[-1] if offsets else _NONE
            self._offsets, self._codes, self._last = offsets, codes, last
            return
        self.recent.pop(offset, None)
        if self._odd:
            self._odd.pop(offset, None)

    def _merge(self) -> None:
        """Move :attr:`recent` into the arrays (an offset no array can hold into :attr:`_odd`).

        New arrays are built aside and swapped in at once, :attr:`recent` emptied last: a merge
        that fails halfway (``MemoryError``) leaves the map as it was, every finished job in it
        (a job missing from it would be pushed and run again, docs/reliability.md).
        """
        if self._spill is not None:
            self._merge_spilled()
            return
        recent = self.recent
        offsets, old, odd = merged(self._offsets, self._codes, self._last, recent, self._odd)
        last = offsets[-1] if offsets else _NONE
        merge_at = max(MERGE_FLOOR, len(offsets) // MERGE_FRACTION)
        self._offsets, self._codes, self._last, self._merge_at, self._odd = offsets, old, last, merge_at, odd
        recent.clear()

    def _merge_at_for(self, n: int) -> int:
        """How many :attr:`recent` may hold past ``n`` merged offsets (the rule above)."""
        return max(MERGE_FLOOR, n // MERGE_FRACTION)
