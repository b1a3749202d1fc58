"""The forwarder state's writes to the ledger, the key store and the compaction counters.

:class:`LedgerWrites` holds the methods of :class:`~hybridq.forwarder.state.ForwarderState`
that append to the completion ledger (and fold what they append into its index), store keys,
save the index when due or now, and commit compaction counters, each durable write timed for
``on_durable_write``. Apart from :mod:`hybridq.forwarder.state` (house style: small modules),
which keeps the loading, the closing and the checkpoint; :class:`ForwarderState` inherits these,
so it stays the one place that changes what the forwarder keeps on disk (its docstring says
why), and they are called as before.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.keystore import KeyStore
from hybridq.forwarder.pushed import PushedJobs
from hybridq.forwarder.snapshot import StatsSnapshot
from hybridq.journal import ChainPosition, JournalWriter
from hybridq.journal.format import RECORD_HEADER_SIZE
from hybridq.ledger.checkpoint import Checkpoint
from hybridq.ledger.compacted import Compacted, save_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.saved_index import IndexSaver
from hybridq.ledger.store import open_ledger_writer
from hybridq.lookup.pending_file import DeferredCount
from hybridq.transport.base import Loc

__all__ = ["LedgerWrites"]


class LedgerWrites:
    """The ledger's, key store's and compaction counters' writes of a :class:`ForwarderState`.

    (See the module docstring.) Its state is :class:`~hybridq.forwarder.state.ForwarderState`'s.
    """

    journal: str
    config: ForwarderConfig
    on_durable_write: Callable[[float], None] | None
    durable_writes: int
    checkpoint: Checkpoint
    compacted: Compacted
    index: LedgerIndex
    pushed: PushedJobs
    keys: KeyStore
    on_append: Callable[[Sequence[Entry], str, ChainPosition], None] | None
    _writer: JournalWriter | None
    _saver: IndexSaver
    _pending: DeferredCount
    _stats: StatsSnapshot

    def append(self, entries: Sequence[Entry], *, apply: bool = True) -> list[Entry]:
        """Append entries to the ledger with one fsync, then (``apply``) fold them into the index.

        Returns the applied entries that changed nothing (their job was terminal already).
        """
        if not entries:
            return []
        if self._writer is None:
            self._writer = open_ledger_writer(self.journal)
        if apply:  # a success over a failure marked (what compaction re-appends is as it was)
            entries = self.index.outranking(entries)
        started = time.perf_counter()
        payloads = [e.to_bytes() for e in entries]
        self._saver.begin()  # an error before appended(): the index is not saved again this run
        ids = self._writer.append_many(payloads)
        self._timed(started)
        last = ids[-1]
        end = ChainPosition(last.segment, last.offset + RECORD_HEADER_SIZE + len(payloads[-1]), last.seq + 1)
        if self.on_append is not None:
            self.on_append(entries, last.writer_id, end)
        # The payloads too: a failure is listed as its JSON (hybridq.ledger.failtable), not encoded again.
        unchanged = (
            [e for e, raw in zip(entries, payloads, strict=True) if not self.index.apply(e, raw)]
            if apply
            else []
        )
        self._saver.appended(last.writer_id, end, len(entries))
        if not apply:
            return []
        self.index.check_spill()  # past its cap, finished jobs' offsets to disk (issue 29)
        self._stats.stale = True
        for entry in entries:
            if entry.kind == "done" and self.index.is_terminal(entry.loc):
                self._pending.done_logged(entry.loc)  # a stats cache: its error fails nothing
                self.pushed.done(entry.loc)
        return unchanged

    def record_invalid(self, loc: Loc, job_id: str = "") -> None:
        """Make the record at ``loc`` (of ``job_id``) terminal ``invalid``: not a job Redis can hold."""
        self.append([Entry("done", job_id, loc, outcome="invalid", at=self.config.clock())])
        self.checkpoint.invalid += 1

    def store_keys(self, entries: Sequence[Entry]) -> None:
        """Append ``key`` entries with their window to the key store (one fsync), then apply them."""
        self.keys.store(entries, self.index)

    def save_index_now(self) -> bool:
        """Save the ledger index and commit the key table now; returns whether it was saved.

        The ledger puncher's step before a hole map: a start from an older saved index expects
        every ``key`` entry after its mark in the ledger (docs/reliability.md, rule 8).
        """
        return self._saver.save(self.index, self.compacted)

    def index_savable(self) -> bool:
        """Whether the ledger index can still be saved this run (the puncher waits for a restart if not)."""
        return self._saver.savable(self.index)

    def save_index_soon(self) -> None:
        """Save the ledger index at the end of this step: compaction deleted ledger segments."""
        self._saver.soon()

    def forget_keys(self) -> None:
        """Forget keys of finished jobs past their window, or beyond ``key_window_max``."""
        self.index.forget_keys(self.config.clock(), self.config.key_window_max)

    def commit_compacted(self, new: Compacted) -> None:
        """Save ``new`` compaction counters, then (only once durable) make them the ones in memory.

        Changing them in memory first would leave them changed after a failed save (a full
        disk): the retried step would then count the same segment again.
        """
        save_compacted(self.journal, new)
        self._stats.stale = True
        for f in dataclasses.fields(Compacted):  # in place: readers may hold the same object
            setattr(self.compacted, f.name, getattr(new, f.name))

    def _timed(self, started: float) -> None:
        self.durable_writes += 1
        if self.on_durable_write is not None:
            self.on_durable_write(time.perf_counter() - started)
