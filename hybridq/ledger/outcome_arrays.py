"""New sorted arrays for :class:`~hybridq.ledger.outcomes.SegmentOutcomes`: a merge of its latest additions.

Split out of :mod:`hybridq.ledger.outcomes` (house style: small modules); see its docstring for
the arrays and why a merge is mostly a sort of the new offsets and an append. The arrays are
built aside and returned: the map swaps them in at once, so a merge that fails halfway
(``MemoryError``) leaves it as it was, every finished job in it (a job missing from it would be
pushed and run again, docs/reliability.md).

This module must not import redis or rq.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right

from hybridq.ledger.outcome_codes import _CODES, _NARROW_MAX, _SUCCEEDED, _WIDE_MAX
from hybridq.ledger.outcome_merge import merged_inside

__all__ = ["merged"]


def merged(
    offsets: array[int], old: bytearray, last: float, recent: dict[int, str], odd: dict[int, str] | None
) -> tuple[array[int], bytearray, dict[int, str] | None]:
    """``offsets`` and their codes ``old`` (the largest ``last``) with ``recent`` merged in.

    Returns the new arrays and the offsets no array can hold (``odd``, with those of ``recent``
    that are negative or past :data:`_WIDE_MAX`); ``recent`` holds offsets not in the arrays.
    """
    keys = sorted(recent)
    if list(recent.values()).count("succeeded") == len(keys):  # nearly always: no lookups
        codes = bytes((_SUCCEEDED,)) * len(keys)
    else:
        codes = bytes(map(_CODES.__getitem__, map(recent.__getitem__, keys)))
    if keys and (keys[0] < 0 or keys[-1] > _WIDE_MAX):
        lo, hi = bisect_left(keys, 0), bisect_right(keys, _WIDE_MAX)
        odd = dict(odd or {})
        for offset in (*keys[:lo], *keys[hi:]):
            odd[offset] = recent[offset]
        keys, codes = keys[lo:hi], codes[lo:hi]
    if keys:
        if keys[-1] > _NARROW_MAX and offsets.typecode == "I":
            offsets = array("Q", offsets)
        # Those past the arrays' end (nearly all, when jobs finish in order) are appended.
        inside = bisect_right(keys, last)
        if inside:
            offsets, old = merged_inside(offsets, old, keys[:inside], codes[:inside])
            keys, codes = keys[inside:], codes[inside:]
        if keys:
            offsets = offsets + array(offsets.typecode, keys)
            old = old + codes
    return offsets, old, odd
