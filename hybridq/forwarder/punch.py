"""Punching finished records out of sealed segments that cannot be deleted yet (issue 29).

A journal segment is deleted only once every job in it is durably terminal and it is its
chain's oldest (:mod:`hybridq.forwarder.dead_segments`, docs/reliability.md rule 8): one job
that stays unfinished (a long task, a retry's backoff, a limit key's wait, a keyed delayed job)
kept its segment and every later one of its chain on disk. This frees the blocks of the runs of
finished records in them meanwhile (:mod:`hybridq.journal.holes`), by the same test as the
deletion: a record goes only when its job's outcome is in the ledger index (durable before it
is applied), its segment sealed and fully read. Not punched: a job failed for good and still
listed (``failed list``, requeue read its envelope from the ledger, but ``hybridq trace`` and
the dashboard show its record), and a requeued job's record (:func:`_requeued`). The stats
tracker's read-backs of a block skip its punched records
(:func:`hybridq.lookup.pending_blocks.read_rows`: finished, so not pending).

Bounded per pass: one segment is read (its records' headers and checksums, at most one segment
size), and only a segment where enough jobs finished since it was last looked at (after a
restart: since its map's punched runs). A sealed segment's seal is read once per process: an
idle pass over 300 sealed segments makes 1 ``stat`` and 2 ``listdir`` (601 ``stat``, 600
``open`` and 900 ``pread`` before; counted by wrapping ``os`` functions around one ``step``).

This module must not import redis or rq.
"""

from __future__ import annotations

import logging

from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, StateFileCorrupt
from hybridq.forwarder.state import ForwarderState
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.holes import punch_holes, punch_supported, read_holes
from hybridq.journal.punch_runs import RunBuilder
from hybridq.journal.reader import JournalReader, list_chains, seal_offset

__all__ = ["MIN_PUNCH_BYTES", "Puncher"]

log = logging.getLogger("hybridq.forwarder")

#: A run of finished records is punched when it is at least this long, or half its segment: four
#: filesystem blocks (a punch frees the whole blocks inside its range only), so that a waiting
#: job every hundred 200-byte jobs still leaves runs to punch; each costs 40 bytes of hole map.
MIN_PUNCH_BYTES = 16 << 10
#: A segment is read again only once this fraction of its records finished since the last look.
RELOOK_FRACTION = 8


class Puncher:
    """Punches runs of finished records of one journal directory (the forwarder's lock held)."""

    def __init__(self, state: ForwarderState, *, min_bytes: int = MIN_PUNCH_BYTES) -> None:
        self.state = state
        self.journal = state.journal
        self.min_bytes = min_bytes
        #: Per segment looked at: how many of its jobs were finished then (or, first, punched).
        self._seen: dict[tuple[str, int], int] = {}
        #: Per sealed segment: its data record count and where its seals start. A sealed segment
        #: never changes under the forwarder's lock (a punch keeps its size; a repair needs the
        #: forwarder stopped), so an idle pass reads no file (review of issue 29, L2).
        self._seals: dict[tuple[str, int], tuple[int, int]] = {}
        #: Bytes punched by this process (for the log and the tests).
        self.punched = 0

    def step(self) -> int:
        """Punch the runs of at most one segment; returns the bytes punched."""
        if not punch_supported(self.journal) or not self.state.pending_ready:
            return 0
        chains = list_chains(self.journal)
        present = {(writer_id, index) for writer_id, indices in chains.items() for index in indices}
        self._seen = {seg: n for seg, n in self._seen.items() if seg in present}
        self._seals = {seg: v for seg, v in self._seals.items() if seg in present}
        for writer_id, indices in chains.items():
            for index in indices:
                if self._due((writer_id, index), head=index == indices[0]):
                    return self._punch((writer_id, index))
        return 0

    def _finished(self, seg: tuple[str, int]) -> int | None:
        """How many jobs of sealed, fully read segment ``seg`` finished; ``None`` if it is not one."""
        pos = self.state.checkpoint.positions.get(seg[0])
        if pos is None or pos.segment <= seg[1]:
            return None
        seals = self._sealed(seg)
        if seals is None:
            return None
        done = self.state.index.terminal.get(seg)
        return 0 if done is None else done.count_below(seals[1])

    def _sealed(self, seg: tuple[str, int]) -> tuple[int, int] | None:
        """``seg``'s data record count and seal offset, read once; ``None`` if it is not sealed."""
        known = self._seals.get(seg)
        if known is None:
            count = sealed_data_count(self.journal, *seg)
            seal_at = seal_offset(self.journal, *seg)
            if count is None or seal_at is None:
                return None
            known = self._seals[seg] = (count, seal_at)
            # Judged before a restart: its punched runs were finished then (one map read).
            try:
                punched = sum(h.count for h in read_holes(self.journal, *seg))
            except StateFileCorrupt:
                punched = 0  # the scan reports it; nothing is punched on it (add_holes raises)
            self._seen.setdefault(seg, punched)
        return known

    def _due(self, seg: tuple[str, int], *, head: bool) -> bool:
        """Whether to read ``seg`` now: enough of its jobs finished since it was last looked at.

        A segment whose jobs all finished is punched whole while an earlier one pins it (it goes
        only as its chain's oldest); as the oldest, the compactor deletes it.
        """
        finished = self._finished(seg)
        seals = self._seals.get(seg)
        if seals is None or finished is None or (head and finished >= seals[0]):
            return False
        count = seals[0]
        last = self._seen.get(seg, 0)
        return finished > last and (not last or finished - last >= max(1, count // RELOOK_FRACTION))

    def _punch(self, seg: tuple[str, int]) -> int:
        self._seen[seg] = self._finished(seg) or 0
        done = self.state.index.terminal.get(seg)
        if done is None:
            return 0
        failed = self.state.index.failed
        size = self._seals[seg][1] if seg in self._seals else 0
        runs = RunBuilder(self.min_bytes, size)
        for rec in JournalReader(self.journal).segment_records(*seg):
            outcome = done.get(rec.offset)
            ok = (
                outcome is not None
                and not (outcome == "failed" and (*seg, rec.offset) in failed)
                and not _requeued(rec.payload)
            )
            if not ok or runs.breaks_at(rec):
                runs.close()  # a job not finished, or a punched range, between
            if ok:
                runs.add(rec)
        runs.close()
        if not runs.runs:
            return 0
        freed, holes = punch_holes(self.journal, *seg, runs.runs)
        # The map is durable: the index keeps its ranges instead of their jobs (hybridq.ledger.punched).
        try:
            if holes:
                self.state.index.collapse(seg, [(h.start, h.end, h.count) for h in holes])
        except ValueError as exc:
            # As at start (hybridq.ledger.punched_maps): the same answers, more memory. Raised, it
            # would stop the forwarder after each restart (the start skips the map, then the next
            # punch of the segment is refused again).
            log.warning("the ranges punched of segment %d of chain %s stay listed: %s", seg[1], seg[0], exc)
        if freed:
            log.info("punched %d bytes of finished jobs out of segment %d of chain %s", freed, seg[1], seg[0])
        self.punched += freed
        return freed


def _requeued(payload: bytes) -> bool:
    """Whether a record is a requeued job's (its envelope's ``requeue`` above 0): never punched.

    The job's first record stays (its failure keeps a requeue mark in the ledger), and a
    punched record's job answers from its ledger ``done`` entry at that record's location only:
    the lookup index rebuilt (its bare row loses to the first record's row) and ``cancel()``
    (it finds the first record) would read the requeued job's success as the first failure, and
    cancel a ``depends_on`` dependent (review 2 of issue 29, M1; docs/guarantees.md). Requeues
    are rare: a record is decoded only when its bytes name ``"requeue"`` (the field, as
    ``Envelope.to_bytes`` writes it, or a key of its arguments).
    """
    if b'"requeue"' not in payload:
        return False
    try:
        return Envelope.from_bytes(payload).requeue > 0
    except EnvelopeError:
        return False  # not an envelope: not written by a requeue
