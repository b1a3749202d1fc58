"""When the forwarder brings its lookup index (jobs by id, for ``hybridq.fetch_job``) up to date.

After a step that moved something (jobs pushed, outcomes recorded, or the completions side said
so), at every step while the index is on its first build, and at least every
:data:`LOOKUP_IDLE_S` while the forwarder idles: others append records too (a requeue's ledger
entries, jobs the forwarder has not read yet). It reads the journal only up to where the
forwarder's reader stands, so the job of every ledger entry it reads is indexed before it.
:class:`hybridq.forwarder.loop.Forwarder` holds one.

This module must not import redis or rq.
"""

from __future__ import annotations

import time

from hybridq.journal import JournalReader
from hybridq.lookup.index import LookupIndex

__all__ = ["LOOKUP_IDLE_S", "LookupFeed"]

#: How often an idle forwarder brings the lookup index up to date (records appended by others:
#: a requeue's ledger entries, jobs the forwarder has not read yet).
LOOKUP_IDLE_S = 1.0


class LookupFeed:
    """The lookup index's catch-ups: when one is due, and the catch-up itself."""

    def __init__(self, lookup: LookupIndex, reader: JournalReader) -> None:
        self.lookup = lookup
        self._reader = reader
        #: Whether the next step catches up whatever else happened (set by the completions side).
        self.due = True
        self._next = 0.0

    @property
    def idle_due(self) -> bool:
        """Whether :data:`LOOKUP_IDLE_S` passed since the last catch-up."""
        return time.monotonic() >= self._next

    def catch_up(self) -> None:
        """Bring the index up to where the forwarder's reader stands."""
        self.lookup.catch_up(self._reader.position)
        self.due = self.lookup.building  # a first build goes on at every step
        self._next = time.monotonic() + LOOKUP_IDLE_S
