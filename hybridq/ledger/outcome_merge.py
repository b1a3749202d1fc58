"""Sorting late offsets into :class:`~hybridq.ledger.outcomes.SegmentOutcomes`'s arrays.

Split out of :mod:`hybridq.ledger.outcomes` (house style: small modules); see its docstring for
why a merge is mostly an append and what it does with jobs that finish out of order.

This module must not import redis or rq.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

__all__ = ["SUCCEEDED", "merged_inside"]

#: The outcome code of ``succeeded`` (:data:`hybridq.ledger.outcome_codes._NAMES`).
SUCCEEDED = 3
#: Past how many times as many offsets of the arrays' tail as there are offsets to merge into
#: it these are put in place one by one rather than sorted with it (the two cost about the same
#: there, in instructions; the sort is in C when all are ``succeeded``).
_PLAIN_SORT_PAST = 24
_SORT_PAST = 8
_SUCCEEDED = SUCCEEDED


def merged_inside(
    offsets: array[int], old: bytearray, keys: list[int], codes: bytes
) -> tuple[array[int], bytearray]:
    """New arrays with sorted offsets (none in ``offsets``, none past its end) put in place.

    The arrays' tail from the first of them is sorted anew with them (C, for nearly all of it
    when all are ``succeeded``), unless they are few in a long tail: then each is put in place
    by ``bisect`` and slices (a job that finished late, in a drain). ``offsets`` and ``old`` are
    not changed.
    """
    start = bisect_left(offsets, keys[0])
    tail = len(offsets) - start
    plain = old.count(_SUCCEEDED, start) == tail and codes.count(_SUCCEEDED) == len(codes)
    if tail > (_PLAIN_SORT_PAST if plain else _SORT_PAST) * len(keys):
        return _merged_each(offsets, old, start, keys, codes)
    if plain:
        merged = offsets[start:].tolist()
        merged += keys
        merged.sort()
        return offsets[:start] + array(offsets.typecode, merged), old[:start] + bytes((_SUCCEEDED,)) * len(
            merged
        )
    packed = [offset << 3 | code for offset, code in zip(offsets[start:], old[start:], strict=True)]
    packed += [offset << 3 | code for offset, code in zip(keys, codes, strict=True)]
    packed.sort()
    return offsets[:start] + array(offsets.typecode, [p >> 3 for p in packed]), old[:start] + bytes(
        [p & 7 for p in packed]
    )


def _merged_each(
    offsets: array[int], old: bytearray, start: int, keys: list[int], codes: bytes
) -> tuple[array[int], bytearray]:
    """Each of ``keys`` put in place from ``start`` on, in new arrays (see :func:`merged_inside`)."""
    prev = start
    tail, tail_codes = offsets[:start], old[:start]
    for offset, code in zip(keys, codes, strict=True):
        i = bisect_left(offsets, offset, prev)
        if i > prev:
            tail += offsets[prev:i]
            tail_codes += old[prev:i]
        tail.append(offset)
        tail_codes.append(code)
        prev = i
    tail += offsets[prev:]
    tail_codes += old[prev:]
    return tail, tail_codes
