"""Which entries of a sealed ledger segment no replay needs any more (issue 29, the ledger punched).

A ledger segment is deleted only once every journal segment its entries name is compacted
(``hybridq.forwarder.dead_segments``), so one waiting job keeps its ledger segment and every
later one (about 190 bytes a job). The forwarder punches runs of entries out of such segments
instead (``hybridq.forwarder.ledger_punch``, the same hole maps as the journal's:
``hybridq.journal.holes``). An entry may go when a replay of the ledger without it (and the
start's collapse of the journal's punched ranges, ``hybridq.ledger.punched_maps``) builds the
same index (docs/reliability.md, "The ledger punched"):

* its job's journal segment was **compacted**: the replay counts nothing of it (``Compacted``
  holds its counts) and keeps only failures, requeue marks and ``key`` entries -- so any
  ``retry``, ``lost``, ``duplicate``, ``cancel`` entry, and a ``done`` entry that did not fail;
* its job's journal record lies in a **punched range** of a live segment (a durable hole map:
  the job was terminal when the range was mapped): its ``retry`` and ``lost`` entries
  (:meth:`LedgerIndex.collapse` drops what they leave of a job in a range), and, only if asked
  (``done_in_ranges``, see :func:`punchable`), a ``done`` entry that ``succeeded`` and is not a
  duplicate delivery's or a settled duplicate's (the range counts it: the index keeps the range,
  any offset in it answers "succeeded"; every reader's index applies the ranges,
  ``load_index``). By default (:func:`kept_by_id`) only a success whose result is ``None``
  or not kept, once its id is kept in the segment's ids file (``hybridq.ledger.punched_ids``):
  ``cancel()`` and a rebuilt lookup index answer "succeeded" from it, as from the entry.

Never: a ``failed`` outcome (listed or not: ``failed list``, requeue), a ``requeued`` mark, a
success that outranked a failure (its ``over`` mark keeps the failure off the list), a kind this
module does not know (a newer entry kind is kept), a ``done`` entry of another outcome or a
duplicate delivery's in a live segment (the index lists those offsets, and counts ``dups``),
``cancel`` and ``duplicate`` entries of a live segment, a ``key`` entry of a job whose journal
segment is on disk (a finished job's key is remembered while it is). A ``key`` entry of a
compacted segment goes once it is in the key store, stamped with its outcome and window as
compaction moves it (the caller's to do first).

This module must not import redis or rq.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridq.journal.records import Loc
from hybridq.ledger.entries import Entry, Seg

__all__ = ["kept_by_id", "punchable"]

#: Kinds that, once their job's journal segment is compacted, no replay applies.
_GONE_KINDS = frozenset({"retry", "lost", "duplicate", "cancel", "key"})
#: Kinds that, once their job's record is in a punched range, leave nothing the collapse keeps.
#: Not ``key``: moved to the key store it would get its window (docs/enqueue.md), and a finished
#: job's key is remembered for as long as its journal segment is on disk; it goes once that does.
_PUNCHED_KINDS = frozenset({"retry", "lost"})


def punchable(
    entry: Entry,
    gone: Callable[[Seg], bool],
    punched: Callable[[Loc], bool],
    *,
    done_in_ranges: bool = False,
) -> bool:
    """Whether a replay without ``entry`` builds the same index (see the module docstring).

    ``gone(seg)``: whether journal segment ``seg`` was compacted. ``punched(loc)``: whether the
    journal record at ``loc`` lies in a range of its segment's durable hole map.
    ``done_in_ranges``: whether the ``done`` entry of a job in a punched range may go too. Off
    by default: it is the only place left that names such a job's id, and ``cancel()`` and a
    rebuilt lookup index (hence ``fetch_job`` and ``depends_on``) answer "finished" for a
    punched job from it (docs/journal.md); without it they answer as for a compacted job.
    """
    kind = entry.kind
    if kind == "done":
        # A success that outranked a failure (``over``: docs/reliability.md, "A success outranks
        # a failure") is kept as a requeue mark is.
        if entry.outcome == "failed" or entry.is_mark():
            return False
        if gone((entry.loc[0], entry.loc[1])):
            return True
        return (
            done_in_ranges
            and entry.outcome == "succeeded"
            and not entry.dup
            and entry.dup_of is None
            and punched(entry.loc)
        )
    if kind in _GONE_KINDS and gone((entry.loc[0], entry.loc[1])):
        return True
    return kind in _PUNCHED_KINDS and punched(entry.loc)


def kept_by_id(entry: Entry, punched: Callable[[Loc], bool]) -> bool:
    """Whether ``entry`` may go once its id is in its segment's ids file (``punched_ids``).

    A ``done`` entry of a success in a punched range (as ``done_in_ranges`` allows) whose
    result is ``None`` or not kept: the ids file keeps what ``cancel()`` and a rebuilt lookup
    index answer from (its id, its record's place, its queue, whether a ``None`` result was
    kept); a result of another value is answered from the entry, which stays.
    """
    return (
        entry.kind == "done"
        and entry.outcome == "succeeded"
        and not entry.is_mark()
        and not entry.dup
        and entry.dup_of is None
        and entry.result is None
        and entry.result_bytes is None
        and punched(entry.loc)
    )
