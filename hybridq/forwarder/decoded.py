"""The envelopes of the rows the forwarder put in its run table, kept decoded for the refill.

A job that waits on disk (the run table, :mod:`hybridq.forwarder.runs`) was read from the journal
and decoded once, its envelope checked; the refill that pushes it reads its record back and
decoded it again: in a burn-down, most of the backlog (docs/benchmarks.md, "The push path, this
stop"). The envelopes of the rows this process put there are kept here, bounded, and the refill
takes them instead. Only a cache: a row not found here (a restart, a full cache) is read back
from the journal as before, so what is pushed is the same either way (the record is immutable,
and only a stopped forwarder's journal is ever repaired).

This module must not import redis or rq.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from hybridq.envelope.model import Envelope
from hybridq.transport.base import Loc

__all__ = ["KEPT_BYTES", "KEPT_JOBS", "KEPT_S", "Decoded", "memory_of"]

#: At most this many envelopes, of at most this many bytes of memory together (estimated by
#: :func:`memory_of`: ~0.9 KB for a small job's): past either, new rows are not kept (the oldest
#: wait to be pushed first).
KEPT_JOBS = 10_000
KEPT_BYTES = 12 << 20
#: An envelope kept longer than this is dropped once the cache is full (its row left another way:
#: cancelled, finished, or its refill read it back after a restart of the table).
KEPT_S = 60.0


class Decoded:
    """Envelopes by their record's location, in the order they were kept."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # Ordered by insertion with O(1) access to the oldest however many were taken before it
        # (a plain dict's iteration skips the slots of deleted entries from its start).
        self._kept: OrderedDict[Loc, tuple[float, Envelope, int]] = OrderedDict()
        self._bytes = 0

    def keep(self, loc: Loc, env: Envelope) -> None:
        """Keep ``env``, read at ``loc`` and now waiting on disk (only one decoded from ASCII JSON)."""
        if env.source is None or loc in self._kept:
            return
        size = memory_of(env.source)
        if len(self._kept) >= KEPT_JOBS or self._bytes + size > KEPT_BYTES:
            self._drop_older(self.clock() - KEPT_S)
            if len(self._kept) >= KEPT_JOBS or self._bytes + size > KEPT_BYTES:
                return
        self._kept[loc] = (self.clock(), env, size)
        self._bytes += size

    def take(self, loc: Loc) -> Envelope | None:
        """The envelope kept for ``loc`` (forgotten here), or ``None``."""
        found = self._kept.pop(loc, None)
        if found is None:
            return None
        self._bytes -= found[2]
        return found[1]

    def _drop_older(self, cutoff: float) -> None:
        """Drop the entries kept before ``cutoff``, oldest first: O(1) per entry, O(1) if none.

        Called at every keep while the cache is full: a scan or a copy of the cache there made a
        long drain quadratic (a million jobs forwarded at a third of the rate).
        """
        while self._kept:
            loc, (at, _, size) = next(iter(self._kept.items()))
            if at >= cutoff:
                return
            del self._kept[loc]
            self._bytes -= size

    def __len__(self) -> int:
        return len(self._kept)


def memory_of(record: bytes) -> int:
    """About the memory the envelope decoded from ``record`` takes (bytes; rather more than less).

    A decoded object costs far more than its bytes when it holds many small containers or items
    (``[{}, {}, ...]``: about 20 times): each ``{``, ``[`` and ``,`` counts 64 bytes more.
    """
    return len(record) + 64 * (record.count(b"{") + record.count(b"[") + record.count(b","))
