"""The forwarder's settings and its durable state, in one place each.

:class:`ForwarderConfig` holds every option (frozen, checked once, before anything is created);
it lives in :mod:`hybridq.forwarder.config`, and every name of that module is importable from
here too. :class:`ForwarderState` owns what the forwarder keeps on disk: the checkpoint
(:mod:`hybridq.ledger.checkpoint`), the completion ledger and its index (:mod:`hybridq.ledger.store`) and the
compaction counters. It is the one place that changes them and writes them: the forwarding loop,
the harvest, the reconcile passes and the compactor all go through its methods, so each durable
write happens (and is timed for ``on_durable_write``) in one spot. Two parts it holds do their
share: the key store of enqueue-if-absent (:mod:`hybridq.forwarder.keystore`) and the stats
snapshot (:mod:`hybridq.forwarder.snapshot`), which it tells when to write. Its writes to the
ledger, the key store and the compaction counters are :mod:`hybridq.forwarder.ledger_writes`'s,
which it inherits.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import JournalError, JournalIOError
from hybridq.forwarder.config import (
    DEFAULT_KEY_WINDOW_MAX,
    DEFAULT_KEY_WINDOW_S,
    DONE_GRACE_LEASES,
    ForwarderConfig,
    check_key_ttl,
)
from hybridq.forwarder.decoded import Decoded
from hybridq.forwarder.keystore import KeyStore
from hybridq.forwarder.ledger_writes import LedgerWrites
from hybridq.forwarder.pushed import PushedJobs
from hybridq.forwarder.runs import RunTable
from hybridq.forwarder.snapshot import StatsSnapshot
from hybridq.journal import ChainPosition, JournalWriter, Record
from hybridq.journal.recovery import recover
from hybridq.ledger.checkpoint import (
    EPOCHS_KEPT,
    Checkpoint,
    Held,
    clamp_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hybridq.ledger.compacted import Compacted, load_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.punched_maps import collapse_punched
from hybridq.ledger.saved_index import IndexSaver, resume
from hybridq.ledger.store import ledger_dir
from hybridq.lookup.pending import PendingTracker
from hybridq.lookup.pending_file import DeferredCount, count_key, load_count, save_count
from hybridq.lookup.stats import ledger_chains
from hybridq.protocol import Overwrite
from hybridq.protocol.keylimits import limit_key_of
from hybridq.transport.base import Delivery, Loc

__all__ = [
    "DEFAULT_KEY_WINDOW_MAX",
    "DEFAULT_KEY_WINDOW_S",
    "DONE_GRACE_LEASES",
    "ForwarderConfig",
    "ForwarderState",
    "check_key_ttl",
]

log = logging.getLogger("hybridq.forwarder")

#: How long each step spends counting the jobs read before a start (seconds), until it is done.
PENDING_SLICE_S = 0.02


class ForwarderState(LedgerWrites):
    """The checkpoint, the ledger and the compaction counters of one journal (see module docstring).

    Empty until :meth:`load`; the forwarder's lock must be held before it is loaded.
    """

    def __init__(self, journal: str, config: ForwarderConfig) -> None:
        self.journal = journal
        self.config = config
        #: Called with the seconds each durable write took (replaceable after start, for metrics).
        self.on_durable_write = config.on_durable_write
        #: Durable writes that succeeded: a full disk's pause ends only after one (Forwarder.run).
        self.durable_writes = 0
        self.checkpoint = Checkpoint()
        self.compacted = Compacted()
        self.index = LedgerIndex()
        #: The jobs read and indexed but not pushed (the backlog beyond the window), on disk.
        self.runs = RunTable(journal)
        self.decoded = Decoded()  # the envelopes of the rows put in it, for the refill
        #: The jobs in Redis (pushed, not terminal), on disk in the run table's file: what a
        #: refill or a reconcile pass reads (hybridq.forwarder.pushed).
        self.pushed = PushedJobs(self.runs, config.window_max)
        self._writer: JournalWriter | None = None
        #: Saves the index, so the next start replays only the ledger after it (issue 29).
        self._saver = IndexSaver(journal, {})
        #: The key store of enqueue-if-absent (hybridq.forwarder.keystore).
        self.keys = KeyStore(journal, self._timed)
        #: Called with the entries of each ledger append, once durable, and where its chain ends
        #: (the lookup index).
        self.on_append: Callable[[Sequence[Entry], str, ChainPosition], None] | None = None
        #: The jobs read and not terminal yet, for ``hybridq.stats`` (saved with each checkpoint):
        #: those read before this start are counted after the first push, a slice per step
        #: (:meth:`count_pending`), so the first job does not wait for a reading of the live journal.
        self._pending = DeferredCount()
        #: The figures hybridq.stats reads: written when stale (hybridq.forwarder.snapshot).
        self._stats = StatsSnapshot(journal)
        #: The window's figures for the stats snapshot (the forwarder's backlog sets it).
        self.figures: Callable[[], tuple[dict[str, dict[str, Any]], dict[str, Any] | None]] | None = None
        #: The limit keys' figures for the snapshot (the forwarder's key gate sets it).
        self.limit_figures: Callable[[], dict[str, dict[str, Any]]] | None = None

    # -- loading ------------------------------------------------------------------------------

    def load(self) -> None:
        """Load the checkpoint (made and saved when missing), then the ledger and its index."""
        saved = load_checkpoint(self.journal)
        if saved is None:
            log.info("no checkpoint in %s: forwarding the journal from its start", self.journal)
        self.checkpoint = saved or Checkpoint()
        if saved is None:
            save_checkpoint(self.journal, self.checkpoint)  # its owner id must not change
        clamp_checkpoint(self.journal, self.checkpoint)
        self.compacted = load_compacted(self.journal)
        # Tails only: load_index and read_keys read every record after, each checked as read.
        if os.path.isdir(ledger_dir(self.journal)):
            recover(ledger_dir(self.journal), tails_only=True)
        # The index saved at the last stop (or the last save before a crash), then what follows;
        # the key owners in their table on disk (hybridq.ledger.keytable).
        self.index.keys.close()
        keys = KeyTable.in_journal(self.journal)
        cap = self.config.index_offsets_max  # held from the load on (issue 29)
        try:
            self.index, read, resumed = resume(self.journal, self.compacted, keys, cap)
        except JournalIOError:
            if not keys.damaged:
                raise
            # The replay after the saved index met damage its check then confirmed (the file
            # is deleted): replay the whole ledger into a new table, as the loop's reopen does
            # (docs/reliability.md, the key table).
            keys.close()
            keys = KeyTable.in_journal(self.journal)
            self.index, read, resumed = resume(self.journal, self.compacted, keys, cap)
        # The punched ranges instead of their finished jobs' offsets (issue 29): after the replay,
        # which gave every job in them its outcome (hybridq.ledger.punched_maps).
        collapse_punched(self.journal, self.index, self.compacted)
        # Past the cap, the finished jobs of the segments holding most on disk (issue 29).
        self.index.spill_past(self.journal, self.config.index_offsets_max)
        self._saver = IndexSaver(self.journal, read)
        self.keys.load(self.index, apply=resumed == 0)  # a table the saved index trusts has them
        self.forget_keys()
        self._stats.known = set(ledger_chains(ledger_dir(self.journal)))
        self._stats.stale = True  # the first step writes the snapshot of what was just loaded
        at = self.checkpoint.positions
        key = count_key(self.journal, at, self.compacted)  # before any write
        counted = functools.partial(load_count, self.journal, key)  # a clean stop's count, if it fits
        self._pending.start(self.journal, at, self.index, self.compacted, saved=counted)
        self.runs.open()
        self.pushed.open(self.journal, self.checkpoint.positions, self.index)

    @property
    def key_segments(self) -> dict[tuple[str, int], tuple[float, int]]:
        """Per segment of the key store: the latest end of a window in it, and its entries.

        The key store's own dict (a property, not a second name: the compactor deletes from it).
        """
        return self.keys.segments

    @property
    def pending(self) -> PendingTracker:
        """The jobs read and not terminal: per queue, the oldest (complete once :attr:`pending_ready`)."""
        return self._pending.live

    @property
    def pending_ready(self) -> bool:
        """Whether :attr:`pending` counts every job read, this start's and before (stats are due)."""
        return self._pending.ready

    def count_pending(self, budget_s: float = PENDING_SLICE_S) -> None:
        """Count the jobs read before this start for about ``budget_s`` (joined once all are)."""
        if self._pending.advance(budget_s):
            self._stats.stale = True

    def flush_pushed(self, *, force: bool = False) -> None:
        """Write the jobs pushed as read to the run table, when due (``force``: now)."""
        if force or self.pushed.due(self.checkpoint.positions):
            self.pushed.flush(self.checkpoint.positions)

    def close(self, by_path: bool = True) -> None:
        """Close the ledger and key store writers and the run table.

        Each is closed even when one before it fails (a full disk: the forwarder opens again
        in the same process, docs/operations.md "Disk full"); the error is raised after.
        ``by_path=False``: the journal's path no longer leads to its directory (or the lock was
        released: a second close); the caches written by path (the pending count, the saved
        index, the stats snapshot's sealed ledger tail) are not, nor the pushed jobs' flush (its
        open file is the old directory's, but a start rebuilds it anyway: a cache too).
        """
        with contextlib.ExitStack() as closing:  # the callbacks run last registered first
            if by_path:
                closing.callback(self._save_count)
            closing.callback(self.index.keys.close)
            closing.callback(self.keys.close)
            closing.callback(self._close_writer, by_path)
            closing.callback(self.runs.close)
            if self.runs.is_open and by_path:  # loaded: the index is the ledger's, saved for the next start
                self._saver.save(self.index, self.compacted)
                with contextlib.suppress(JournalIOError):  # not written: the next start reads them again
                    self.flush_pushed(force=True)

    def _close_writer(self, by_path: bool = True) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
            if by_path:
                self._stats.sealed_ledger()

    def _save_count(self) -> None:
        with contextlib.suppress(OSError, ValueError, JournalError):  # a cache: the next start counts
            save_count(self.journal, self._pending, self.checkpoint.positions, self.compacted)

    # -- reading ------------------------------------------------------------------------------

    @property
    def terminal_total(self) -> int:
        """Jobs durably terminal: in compacted segments plus in the ledger's index."""
        return self.compacted.terminal + self.index.terminal_count

    @property
    def own_chain(self) -> str | None:
        """This forwarder's ledger chain, once it wrote to the ledger (its open segment stays)."""
        return self._writer.writer_id if self._writer is not None else None

    @property
    def own_keys_chain(self) -> str | None:
        """This forwarder's key store chain, once it wrote to it (its open segment stays)."""
        return self.keys.own_chain

    def outcome_counts(self) -> dict[str, int]:
        """Outcomes ever recorded (ledger plus compacted segments), by name (``dups``, ``cancelled``...)."""
        totals = self.index.totals
        c = self.compacted
        compacted = {
            "succeeded": c.succeeded,
            "failed": c.failed,
            "invalid": c.invalid,
            "dups": c.dups,
            "cancelled": c.cancelled,
        }
        return {name: totals.get(name, 0) + n for name, n in compacted.items()}

    def delivery(
        self,
        env: Envelope,
        loc: Loc,
        attempt: int,
        *,
        overwrite: Overwrite = Overwrite.NEVER,
        lost: int | None = None,
    ) -> Delivery:
        """A delivery of ``env``: this forwarder's owner id, lease, key lifetime and generation.

        ``lost``: how many of its runs vanished so far (default: as the ledger counts them). Its
        RetryLaters so far, and since when, are the ledger's too (:attr:`LedgerIndex.later`).
        """
        later, later_since = self.index.later.get(loc, (0, None))
        key = limit_key_of(env)
        # (No key, no limit: not asked, once per job pushed.)
        limit = None if key is None else self.config.key_limits.of(key)
        return Delivery(
            env,
            self.checkpoint.owner,
            loc,
            attempt=attempt,
            overwrite=overwrite,
            lease_s=self.config.lease_s,
            key_ttl_s=self.config.key_ttl_s,
            gen=self.checkpoint.generation,
            lost=self.index.lost.get(loc, (0, 0))[1] if lost is None else lost,
            later=later,
            later_since=later_since,
            report_start=True,  # its claim sends a started event (job.status "started")
            limit=None if limit is None or key is None else limit.wire(key),
        )

    # -- the checkpoint -----------------------------------------------------------------------

    def save(self, forwarded: int) -> None:
        """Count ``forwarded`` more pushed jobs and durably replace the checkpoint."""
        self.checkpoint.forwarded += forwarded
        self.checkpoint.terminal = self.terminal_total
        started = time.perf_counter()
        save_checkpoint(self.journal, self.checkpoint)
        self._timed(started)
        self._save_snapshot()

    def saw(self, record: Record, env: Envelope | None) -> None:
        """Note a record the forwarder read (``env``: the job in it, when it is one) for stats."""
        self.pending.saw_record(record, env, self.index)

    def figures_changed(self) -> None:
        """The window's figures moved: the snapshot is written again at the end of the step."""
        self._stats.stale = True

    def refresh_snapshot(self) -> None:
        """Write the snapshot again if outcomes or compaction changed since it was (end of a step)."""
        self.count_pending()
        if self._saver.due(self.index):
            self._saver.save(self.index, self.compacted)
        if self._stats.stale:
            self._save_snapshot()

    def _save_snapshot(self) -> None:
        """Write the figures ``hybridq.stats`` reads (a cache: a failure only makes it fall back).

        Not before the jobs read before this start are counted: the last start's snapshot stays
        (``hybridq.stats`` reads the journal after its positions, or scans when it is stale).
        """
        if not self.pending_ready:
            self._stats.stale = True
            return
        self._stats.write(
            self.checkpoint,
            self.index,
            self.compacted,
            self.pending,
            own_chain=self.own_chain,
            figures=self.figures,
            limit_figures=self.limit_figures,
        )

    def advance(self, positions: dict[str, ChainPosition]) -> None:
        """Note how far the journal was read (everything before it accepted by the transport)."""
        self.checkpoint.positions = positions

    def hold(self, held: Held) -> None:
        """Hold a delayed job until its time (once, however often its record is read)."""
        queue = self.checkpoint.held
        at = bisect.bisect_left(queue, held)
        if at < len(queue) and queue[at] == held:
            return  # read again after a step was retried: held once
        queue.insert(at, held)

    def release_held(self, count: int) -> None:
        """Drop the first ``count`` held jobs (the transport has them now)."""
        del self.checkpoint.held[:count]

    def count_duplicates(self, count: int) -> None:
        """Count pushes the transport already knew (the duplicates job ids absorbed)."""
        self.checkpoint.duplicate_pushes += count

    def set_epoch(self, epoch: str, run_id: str | None, generation: int) -> None:
        """Record the epoch stored in Redis (saved with the next :meth:`save`)."""
        cp = self.checkpoint
        if generation > cp.generation:  # Redis lost or rolled back state: noted for job traces
            cp.epochs = [*cp.epochs, (generation, self.config.clock())][-EPOCHS_KEPT:]
        cp.epoch, cp.run_id, cp.generation = epoch, run_id, generation

    def forget_chains(self, writers: Sequence[str]) -> None:
        """Drop the positions of chains compacted away whole (saved with the next :meth:`save`)."""
        for writer_id in writers:
            self.checkpoint.positions.pop(writer_id, None)
