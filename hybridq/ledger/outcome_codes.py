"""How :class:`~hybridq.ledger.outcomes.SegmentOutcomes` stores outcomes: codes, bounds, views.

The outcome names' one-byte codes, the offsets each array type holds, the shared empty arrays
of a map with none merged yet, and the views that decode the arrays back into names
(:meth:`SegmentOutcomes.values`, :meth:`SegmentOutcomes.items`). Apart from
:mod:`hybridq.ledger.outcomes` (house style: small modules), which keeps the map's operations
and the merge thresholds (``MERGE_FLOOR``, ``MERGE_FRACTION``); its docstring says why the map
is laid out so.

This module must not import redis or rq.
"""

from __future__ import annotations

from array import array
from collections.abc import ItemsView, Iterator, ValuesView
from typing import TYPE_CHECKING

from hybridq.ledger.outcome_merge import SUCCEEDED

if TYPE_CHECKING:
    from hybridq.ledger.outcomes import SegmentOutcomes

#: Outcome names by code (0 is not used: ``bytearray`` starts zeroed).
_NAMES = ("", "cancelled", "failed", "succeeded", "invalid")
_CODES = {name: code for code, name in enumerate(_NAMES) if name}
_SUCCEEDED = _CODES["succeeded"]
assert _SUCCEEDED == SUCCEEDED
#: The largest offset of 4-byte items, and the largest any array holds (more stays in ``_odd``).
_NARROW_MAX = 2**32 - 1
_WIDE_MAX = 2**64 - 1
_NONE = float("-inf")
#: The arrays of a map with none merged yet, shared: an array is never resized in place (a merge
#: or a delete builds new ones and swaps them in; only a rank upgrade rewrites a code in place,
#: at an index that exists), so no two maps share an array that holds an offset.
_NO_OFFSETS = array("I")
_NO_CODES = bytearray()


class _Values(ValuesView[str]):
    _mapping: SegmentOutcomes

    def __contains__(self, value: object) -> bool:
        return any(v == value for v in self)

    def __iter__(self) -> Iterator[str]:
        done = self._mapping
        yield from map(_NAMES.__getitem__, done._arrays()[1])
        yield from list(done.recent.values())
        yield from list((done._odd or {}).values())


class _Items(ItemsView[int, str]):
    _mapping: SegmentOutcomes

    def __iter__(self) -> Iterator[tuple[int, str]]:
        done = self._mapping
        offsets, codes = done._arrays()
        yield from zip(offsets, map(_NAMES.__getitem__, codes), strict=True)
        yield from list(done.recent.items())
        yield from list((done._odd or {}).items())
