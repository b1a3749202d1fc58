"""The key store of one journal (``<journal>/keys/``): the keys of finished jobs, in their window.

A finished job's idempotency key is a ``key`` ledger entry; when the compactor deletes its ledger
segment, the entry is moved here first (fsync'd), with the end of its key window
(docs/enqueue.md, "The key window"). :class:`KeyStore` reads the store into the ledger's index at
start, appends to it (one chain per forwarder that wrote, one fsync per batch), and notes per
segment when its last window ends, so the compactor (:mod:`hybridq.forwarder.dead_segments`)
deletes a segment only once every window in it ended (or far beyond ``key_window_max``).
:class:`~hybridq.forwarder.state.ForwarderState` holds one: it stays the one place durable
writes happen.

This module must not import redis or rq.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from hybridq.journal import JournalWriter
from hybridq.journal.recovery import recover
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import keys_dir, open_keys_writer, read_keys

__all__ = ["KeyStore"]


class KeyStore:
    """Reads and appends ``key`` entries (see module docstring).

    Args:
        journal: the journal directory.
        timed: called with the :func:`time.perf_counter` at which each durable write began.
    """

    def __init__(self, journal: str, timed: Callable[[float], None]) -> None:
        self.journal = journal
        self._timed = timed
        self._keys_writer: JournalWriter | None = None
        #: Per segment of the key store: the latest end of a window in it, and its entries (the
        #: compactor deletes a segment once every window in it ended, or far beyond the bound).
        self.segments: dict[tuple[str, int], tuple[float, int]] = {}

    @property
    def own_chain(self) -> str | None:
        """This forwarder's key store chain, once it wrote to it (its open segment stays)."""
        return self._keys_writer.writer_id if self._keys_writer is not None else None

    def load(self, index: LedgerIndex, *, apply: bool = True) -> None:
        """Apply every entry of the key store to ``index`` (its chains' tails recovered first).

        ``apply=False``: only note its segments. The index's key table, trusted by the saved
        index, holds every entry stored before that save (docs/reliability.md, "The key table");
        one stored since, with its ledger segment still there (a crash between the two), is
        stamped and stored again when that segment goes.
        """
        if os.path.isdir(keys_dir(self.journal)):
            recover(keys_dir(self.journal), tails_only=True)
            with index.keys.bulk():
                for record, entry in read_keys(self.journal):
                    if apply:
                        index.apply(entry)
                    self._note_key_segment((record.writer_id, record.segment_index), entry)

    def store(self, entries: Sequence[Entry], index: LedgerIndex) -> None:
        """Append ``key`` entries with their window (one fsync), then apply them to ``index``."""
        if not entries:
            return
        if self._keys_writer is None:
            self._keys_writer = open_keys_writer(self.journal)
        started = time.perf_counter()
        ids = self._keys_writer.append_many(e.to_bytes() for e in entries)
        self._timed(started)
        for rid, entry in zip(ids, entries, strict=True):
            index.apply(entry)
            self._note_key_segment((rid.writer_id, rid.segment), entry)

    def close(self) -> None:
        """Close this forwarder's chain, if it wrote one (idempotent)."""
        if self._keys_writer is not None:
            self._keys_writer.close()
            self._keys_writer = None

    def _note_key_segment(self, seg: tuple[str, int], entry: Entry) -> None:
        until, count = self.segments.get(seg, (0.0, 0))
        self.segments[seg] = (max(until, entry.until or 0.0), count + 1)
