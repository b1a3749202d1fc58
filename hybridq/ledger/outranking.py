"""Which outcomes of a batch of ledger entries outrank, or are outranked by, a job's other one.

:meth:`LedgerIndex.outranking <hybridq.ledger.index.LedgerIndex.outranking>`'s work, split out
of :mod:`hybridq.ledger.index` (house style: small modules): a success of a job recorded
``failed`` is marked ``over``, a failure of a job recorded ``succeeded`` ``under``, in the
entry's own record (docs/reliability.md, "A success outranks a failure").

This module must not import redis or rq.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter, itemgetter

from hybridq.journal.records import Loc
from hybridq.ledger.entries import Entry, Seg
from hybridq.ledger.outcomes import SegmentOutcomes
from hybridq.protocol import EntryKind

__all__ = ["has_failed", "outranking"]

_SUCCEEDED = "succeeded"
#: A module constant: an enum member read from its class costs about 900 instructions on 3.11
#: (docs/benchmarks.md, "The forwarder's writes per job, again").
_DONE = EntryKind.DONE
#: An entry's ``loc``, and a loc's journal segment (mapped in C).
_LOC_OF = attrgetter("loc")
_SEG_OF = itemgetter(0, 1)


def has_failed(terminal: Mapping[Seg, SegmentOutcomes], seg: Seg) -> bool:
    """Whether a job of ``seg`` is ``failed`` in ``terminal`` (a search of its outcomes, in C)."""
    done = terminal.get(seg)
    return done is not None and done.holds("failed")


def outranking(
    entries: Sequence[Entry],
    terminal: Mapping[Seg, SegmentOutcomes],
    any_failed: bool,
    outcome: Callable[[Loc], str | None],
) -> Sequence[Entry]:
    """``entries`` to append, each outcome ranked against the job's other one in its record.

    ``terminal``, ``any_failed`` and ``outcome``: the index's outcomes, whether any is
    ``failed``, and its lookup of one job's. A success of a job recorded ``failed`` (there, or
    earlier in ``entries``: read before it in its chain) is marked ``over``; a failure of a job
    recorded ``succeeded`` is marked ``under``, without its envelope. No failure live and none
    in ``entries`` (a drain): one pass over them; failures live in other segments only (a batch
    without a failure): the batch's segments collected in C and each searched once, no loop;
    else a loop, each segment searched once when one of its successes is met, and a lookup for
    each success of a segment that has a failure.
    """
    batch_failures = any(e.outcome == "failed" for e in entries)
    if not batch_failures:
        if not any_failed:
            return entries
        segments = set(map(_SEG_OF, map(_LOC_OF, entries)))  # in C: no Python step per entry
        if not any(has_failed(terminal, seg) for seg in segments):
            return entries  # failures live only in other segments: no loop over the batch
    # Each segment searched once, when a success of it is met: its outcomes if one failed.
    failing: dict[Seg, SegmentOutcomes | None] = {}
    failed: set[Loc] = set()
    succeeded: set[Loc] = set()
    out = list(entries)
    for i, e in enumerate(out):
        if e.kind != _DONE:
            continue
        loc = e.loc
        if e.outcome == "failed":
            if e.under is None and (loc in succeeded or outcome(loc) == _SUCCEEDED):
                out[i] = dataclasses.replace(e, under=_SUCCEEDED, job=None)
            else:
                failed.add(loc)
        elif e.outcome == _SUCCEEDED and e.over is None:
            if batch_failures:
                succeeded.add(loc)
                if loc in failed:
                    out[i] = dataclasses.replace(e, over="failed")
                    continue
            seg = loc[:2]
            if seg in failing:
                done = failing[seg]
            else:
                done = failing[seg] = terminal.get(seg) if has_failed(terminal, seg) else None
            if done is not None and done.get(loc[2]) == "failed":
                out[i] = dataclasses.replace(e, over="failed")
    return out
