"""The hole maps on disk applied to the ledger index at start (issue 29, :mod:`hybridq.ledger.punched`).

This module must not import redis or rq.
"""

from __future__ import annotations

import logging

from hybridq.errors import StateFileCorrupt
from hybridq.journal.holes import read_holes
from hybridq.journal.reader import list_chains
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.index import LedgerIndex

__all__ = ["collapse_punched"]

log = logging.getLogger("hybridq.ledger")


def collapse_punched(journal: str, index: LedgerIndex, compacted: Compacted) -> int:
    """Apply the hole maps of the live segments of ``journal`` to ``index``; returns ranges applied.

    Called at start once the saved index is loaded and the ledger replayed: every job of a
    mapped range is then in the index (its outcome was durable before the map, docs/reliability.md
    rule 8), with the outcome it had, so a range adds no job and changes no answer. A map that
    cannot be read or does not agree with the ranges the saved index kept is logged and left
    out: the index keeps those jobs' offsets (more memory, the same answers).
    """
    applied = 0
    for writer_id, indices in list_chains(journal).items():
        for segment in indices:
            seg = (writer_id, segment)
            if compacted.is_compacted(seg):
                continue
            try:
                holes = read_holes(journal, writer_id, segment)
                if holes:
                    index.collapse(seg, [(h.start, h.end, h.count) for h in holes])
                    applied += len(holes)
            except (StateFileCorrupt, ValueError) as exc:
                log.warning(
                    "the ranges punched of segment %d of chain %s stay listed: %s", segment, writer_id, exc
                )
    return applied
