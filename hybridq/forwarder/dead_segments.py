"""Dead segments: deleting journal and ledger segments that nothing needs any more (compaction).

A journal segment goes only when it is **sealed**, **fully read** by the forwarder and **every
job in it is durably terminal** in the ledger (docs/reliability.md rule 8). The counters that replace
it (accepted, succeeded, failed, ...) are saved to ``compaction.state`` first; a crash between
that save and the unlink is finished at the next start. Segments go oldest first in each chain
(a gap in the middle of a chain would be corruption).

A ledger segment follows when every entry in it concerns deleted journal segments. Failures
still listed (and requeue marks that still cancel a failure written elsewhere) are appended
again first, so ``failed list`` and ``requeue`` outlive the segments that recorded them; so does
the ``key`` entry of a job that owns an idempotency key: it moves to the key store, with its
outcome and the end of its key window (``until``: now + ``key_window_s``); a key store segment
goes once every window in it ended (hybridq.forwarder.admission).

This module must not import redis or rq.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping

from hybridq.forwarder.ledger_punch import LedgerPuncher
from hybridq.forwarder.punch import Puncher
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import crashpoints
from hybridq.journal.compact import remove_oldest_segment, sealed_data_count
from hybridq.journal.format import segment_name
from hybridq.journal.holes import tidy_hole_maps
from hybridq.journal.reader import list_chains, seal_offset
from hybridq.journal.records import Loc
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry, Seg
from hybridq.ledger.segment_scan import LedgerSegmentScan, all_gone, scan_ledger_segment
from hybridq.ledger.store import keys_dir, ledger_dir, read_ledger_failures

__all__ = ["COMPACT_INTERVAL_S", "Compactor"]

log = logging.getLogger("hybridq.forwarder")

#: How often compaction looks for dead segments (seconds).
COMPACT_INTERVAL_S = 5.0


class Compactor:
    """Deletes dead segments of one journal directory (the forwarder's lock must be held).

    Args:
        state: the forwarder's state: its positions say what was fully read, its ledger index
            which jobs are terminal; the compaction counters are saved through it before each
            deletion, and entries that must outlive a ledger segment are appended through it.
    """

    def __init__(self, state: ForwarderState) -> None:
        self.state = state
        self.journal = state.journal
        self._next = 0.0
        self._ledger_once = False
        #: What sealed ledger segments name (:attr:`LedgerSegmentScan.reach`), by (writer id,
        #: index), with the file's identity (inode, size) when scanned. A sealed segment never
        #: changes, so what it names holds until it is deleted: the first segment that cannot go
        #: yet is read once, not at every pass (issue 29). Only those few numbers are kept: the
        #: entries it keeps (failures with their envelopes: megabytes for a segment of them)
        #: are read again when it goes.
        self._scans: dict[tuple[str, int], tuple[tuple[int, int], dict[str, int]]] = {}
        #: Frees the finished records of segments that cannot go yet (hybridq.forwarder.punch).
        self.puncher = Puncher(state)
        #: Frees the entries no replay needs of ledger segments that cannot go yet.
        self.ledger_puncher = LedgerPuncher(state, self._gone_now, self._stamped_keys)

    def hurry(self) -> None:
        """Look at the next call, whatever the timer says."""
        self._next = 0.0

    def compact(self) -> bool:
        """Delete dead journal segments, then dead ledger segments.

        Returns whether chains compacted away whole were dropped from the checkpoint (the
        forwarder's reader must forget them too, or its next position would put them back).
        """
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + COMPACT_INTERVAL_S
        deleted = 0
        for writer_id, indices in list_chains(self.journal).items():
            for index in indices:
                if not self._segment_dead(writer_id, index):
                    break
                self._delete(writer_id, index)
                deleted += 1
        self.puncher.step()
        forgot = False
        if deleted or not self._ledger_once:
            # The ledger follows the journal; and once after a start, for the chains of earlier
            # forwarder runs, which recovery has just sealed.
            self._ledger_once = True
            if self._compact_ledger():
                self.state.save_index_soon()  # the saved index no longer fits the ledger (docs/forwarder.md)
            self._compact_keys()
            forgot = self._forget_gone_chains()
        # What of the ledger segments that stay no replay needs (hybridq.forwarder.ledger_punch).
        self.ledger_puncher.step(self.puncher.punched)
        return forgot

    def _gone(self, seg: Seg, first: Mapping[str, int]) -> bool:
        """Whether journal segment ``seg`` was compacted (its chain may be forgotten too).

        ``first``: each present chain's first segment. Below it, a segment was compacted even if
        its chain was forgotten meanwhile and then grew again (``ledger.load_index``). It holds
        for every lower index of a chain when it holds for one (``LedgerSegmentScan.all_gone``).
        """
        return self.state.compacted.is_compacted(seg) or seg[1] < first.get(seg[0], sys.maxsize)

    def _gone_now(self) -> Callable[[Seg], bool]:
        """:meth:`_gone` with the journal's chains as they are now (listed once)."""
        first = {writer: indices[0] for writer, indices in list_chains(self.journal).items()}
        return lambda seg: self._gone(seg, first)

    def _forget_gone_chains(self) -> bool:
        """Drop what is kept per writer once its chain is compacted away entirely.

        Every producer process starts a chain; without this, the checkpoint (rewritten after
        every batch) and the compaction state would grow with every process ever started.
        """
        present = list_chains(self.journal)
        gone = [w for w in self.state.compacted.through if w not in present]
        if not gone:
            return False
        new = self._draft()
        for writer_id in gone:
            del new.through[writer_id]
        # The compaction state first: a crash before the checkpoint is saved leaves a position
        # for a chain with no files, which the reader skips.
        self.state.commit_compacted(new)
        self.state.forget_chains(gone)
        return True

    def _draft(self) -> Compacted:
        """A copy of the compaction state to change; ``state.commit_compacted`` makes it the real one."""
        compacted = self.state.compacted
        return dataclasses.replace(compacted, through=dict(compacted.through))

    def finish_deletions(self) -> None:
        """Delete segments a crash left behind after their compaction state was saved.

        And the hole maps a crash left behind their segment, or a segment a crash left writable
        while it was punched (:func:`~hybridq.journal.holes.tidy_hole_maps`).
        """
        tidy_hole_maps(self.journal)
        if os.path.isdir(ledger_dir(self.journal)):
            tidy_hole_maps(ledger_dir(self.journal))  # the ledger's own (hybridq.forwarder.ledger_punch)
        for writer_id, indices in list_chains(self.journal).items():
            for index in indices:
                if not self.state.compacted.is_compacted((writer_id, index)):
                    break
                log.info("finishing the compaction of segment %d of chain %s", index, writer_id)
                remove_oldest_segment(self.journal, writer_id, index)

    def _segment_dead(self, writer_id: str, index: int) -> bool:
        pos = self.state.checkpoint.positions.get(writer_id)
        if pos is None or pos.segment <= index:
            return False  # not fully read (a sealed, read segment moves the position past it)
        count = sealed_data_count(self.journal, writer_id, index)
        seal_at = seal_offset(self.journal, writer_id, index)
        if count is None or seal_at is None:
            return False
        # Only outcomes of records below the seal count: one for a record that was read before
        # it was durable, and cut off by recovery since, must not stand in for a live job.
        done = self.state.index.terminal.get((writer_id, index))
        return (0 if done is None else done.count_below(seal_at)) >= count

    def _delete(self, writer_id: str, index: int) -> None:
        seg = (writer_id, index)
        c = self._draft()
        counts = self.state.index.counts([seg])
        c.through[writer_id] = index
        c.accepted += sealed_data_count(self.journal, writer_id, index) or 0
        c.succeeded += counts["succeeded"]
        c.failed += counts["failed"]
        c.invalid += counts["invalid"]
        c.dups += counts["dups"]
        c.cancelled += counts["cancelled"]
        self.state.commit_compacted(c)  # rule 8: the replacement is durable before the delete
        crashpoints.reached("compact_after_state")
        remove_oldest_segment(self.journal, writer_id, index)
        self.state.index.forget_segment(seg)

    def _stamped_keys(self, entries: list[Entry]) -> list[Entry]:
        """The ``key`` entries of a ledger segment about to go that the key store must keep.

        The current owner's, with its outcome (its journal segment is gone: the job is terminal)
        and the end of its window: now + ``key_window_s``. The ledger punch moves only keys of
        jobs whose journal segment is gone too (``ledger/punch_select.py``).
        """
        index = self.state.index
        until = self.state.config.clock() + self.state.config.key_window_s
        out: list[Entry] = []
        for e in entries:
            known = index.keys.get(e.key) if e.kind == "key" and e.key is not None else None
            if known is None or known.until is not None or (known.loc, known.at) != (e.loc, e.at):
                continue  # not a key entry, taken over or forgotten since, or stored already
            outcome = index.owner_outcome(known, lambda _loc: True)
            out.append(dataclasses.replace(known, outcome=outcome, until=until))
        return out

    def _compact_keys(self) -> None:
        """Delete key store segments whose windows all ended (or far beyond ``key_window_max``).

        Entries are appended in window order, so the oldest segments go first.
        """
        path = keys_dir(self.journal)
        segments = self.state.key_segments
        if not segments or not os.path.isdir(path):
            return
        now, most = self.state.config.clock(), self.state.config.key_window_max
        chains = list_chains(path)
        after = sum(count for _, count in segments.values())
        for seg, (until, count) in sorted(segments.items(), key=lambda item: item[1][0]):
            after -= count
            # Twice the bound: stale entries (keys taken over since) count too.
            if until >= now and after < 2 * most:
                break
            writer_id, index = seg
            first = chains.get(writer_id, [])
            if writer_id == self.state.own_keys_chain and first and index == first[-1]:
                continue  # our own open segment
            if not first or first[0] != index or sealed_data_count(path, writer_id, index) is None:
                continue
            remove_oldest_segment(path, writer_id, index)
            del segments[seg]
            first.pop(0)

    def _compact_ledger(self) -> int:
        """Delete sealed ledger segments whose entries all concern deleted journal segments."""
        path = ledger_dir(self.journal)
        if not os.path.isdir(path):
            return 0
        own = self.state.own_chain
        self.state.forget_keys()
        # One streaming pass over the failures and requeue marks only (issue 29: keeping every
        # entry of a long drain's ledger cost hundreds of MB per compaction): requeues appended
        # by other processes since this forwarder started, and how many segments hold a failure
        # of each loc (a requeue mark must outlive all of them).
        failed_in: set[tuple[Loc, str, int]] = set()
        for record, e in read_ledger_failures(self.journal):
            if e.kind == "requeued":
                self.state.index.apply(e)
            elif e.kind == "done" and e.outcome == "failed":
                failed_in.add((e.loc, record.writer_id, record.segment_index))
        failures: dict[Loc, int] = {}
        for loc, _, _ in failed_in:
            failures[loc] = failures.get(loc, 0) + 1
        gone = self._gone_now()
        chains = list_chains(path)
        self._scans = {seg: v for seg, v in self._scans.items() if seg[1] in chains.get(seg[0], ())}
        deleted = 0
        for writer_id, indices in chains.items():
            for index in indices:
                if writer_id == own and index == indices[-1]:
                    break  # our own open segment
                if sealed_data_count(path, writer_id, index) is None:
                    break
                reach, scan = self._reach(path, writer_id, index)
                if not all_gone(reach, gone):
                    break
                if scan is None:  # known from an earlier pass, its entries not kept in memory
                    scan = scan_ledger_segment(self.journal, writer_id, index)
                entries = scan.kept  # failures, requeue marks and keys: all it may keep
                here = {e.loc for e in entries if e.kind == "done" and e.outcome == "failed"}
                # Failures still listed outlive the segment that recorded them; so does a mark
                # (a requeue, a success over the failure: docs/reliability.md, "A success
                # outranks a failure") while another segment still holds the failure it cancels.
                keep = [
                    e.as_mark()  # a success over a failure is appended without its result
                    for e in entries
                    if (e.kind == "done" and e.over is None and self.state.index.failed.get(e.loc) == e)
                    or (e.is_mark() and failures.get(e.loc, 0) > (e.loc in here))
                ]
                stamped = self._stamped_keys(entries)
                for loc in here:
                    failures[loc] -= 1
                self.state.append(keep, apply=False)
                self.state.store_keys(stamped)  # durable before the segment that had them goes
                remove_oldest_segment(path, writer_id, index)
                self._scans.pop((writer_id, index), None)
                deleted += 1
        return deleted

    def _reach(
        self, path: str, writer_id: str, index: int
    ) -> tuple[dict[str, int], LedgerSegmentScan | None]:
        """What sealed ledger segment ``index`` of chain ``writer_id`` names, and its scan if read now."""
        st = os.stat(os.path.join(path, segment_name(writer_id, index)))
        identity = (st.st_ino, st.st_size)
        known = self._scans.get((writer_id, index))
        if known is not None and known[0] == identity:
            return known[1], None
        scan = scan_ledger_segment(self.journal, writer_id, index)
        self._scans[(writer_id, index)] = (identity, scan.reach)
        return scan.reach, scan
