"""Punching entries no replay needs out of ledger segments that cannot be deleted yet (issue 29).

A sealed ledger segment goes only once every journal segment its entries name is compacted
(:mod:`hybridq.forwarder.dead_segments`): one waiting job keeps its ledger segment and every
later one, about 190 bytes a job for as long as it waits. The ledger is a journal of the same
format, so the journal's hole maps serve it unchanged (:mod:`hybridq.journal.holes`: the map
durable first, every reader of the ledger skips a mapped range): this punches runs of the
entries :func:`hybridq.ledger.punch_select.punchable` allows -- those of jobs whose journal
segment is compacted or whose record is punched -- out of sealed ledger segments
(docs/reliability.md, "The ledger punched"; docs/journal.md).

The ``done`` entries of successes whose journal record was punched go too, their ids kept
instead in the segment's ids file (:mod:`hybridq.ledger.punched_ids`, about 22 bytes a job
against the entry's 190), written after the saved index and before the map: ``cancel()`` and a
rebuilt lookup index answer "succeeded" for such a job from it.

The ``key`` entries of a run go to the key store first, stamped as compaction moves them
(``Compactor._stamped_keys``), with one fsync, and the saved index is written (the key table committed)
before the map is: a start from a saved index replays only the ledger after its mark, without
the key store, so no key entry after the mark may go first (docs/reliability.md, rule 8). A
crash before the map leaves the entry in both, which a replay folds into one (the stamped entry
replaces the job's own, as after a compaction's crash before its delete).

Bounded: at most one ledger segment is read a pass, and a segment only after a journal segment
its kept entries name has gone since it was last read (or, with ``done_in_ranges``, more journal
records were punched): about 12 us of CPU an entry (``bench/ledger_punch_cpu.py``).

This module must not import redis or rq.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from hybridq import crashpoints
from hybridq.errors import JournalIOError, StateFileCorrupt
from hybridq.forwarder.state import ForwarderState
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.holes import Hole, hole_at, punch_holes, punch_supported, read_holes
from hybridq.journal.punch_runs import RunBuilder
from hybridq.journal.reader import JournalReader, list_chains, seal_offset
from hybridq.journal.records import Loc
from hybridq.ledger.entries import Entry, Seg
from hybridq.ledger.punch_select import kept_by_id, punchable
from hybridq.ledger.punched_ids import PunchedId, read_ids, remove_orphans, write_ids
from hybridq.ledger.sqlite_errors import FULL_ERRNOS
from hybridq.ledger.store import ledger_dir

__all__ = ["LedgerPuncher"]

log = logging.getLogger("hybridq.forwarder")

#: A run of entries is punched when it is at least this long, or half its segment (as the
#: journal's runs: ``hybridq.forwarder.punch.MIN_PUNCH_BYTES``; the two modules are siblings
#: in the forwarder's layers, neither imports the other).
MIN_LEDGER_PUNCH_BYTES = 16 << 10
#: How long a segment whose ids file or saved index could not be written (a full disk) is left
#: alone: the later segments are still punched meanwhile, and it is not re-read every pass.
IDS_RETRY_S = 60.0


class LedgerPuncher:
    """Punches runs of entries out of the sealed ledger segments of one journal (its lock held).

    Args:
        state: the forwarder's state (its compaction counters, its index, its key store).
        gone: makes the test whether a journal segment was compacted (the compactor's), once a pass.
        stamp: the compactor's ``_stamped_keys``: the key store entries of ``key`` entries.
    """

    def __init__(
        self,
        state: ForwarderState,
        gone: Callable[[], Callable[[Seg], bool]],
        stamp: Callable[[list[Entry]], list[Entry]],
    ) -> None:
        self.state = state
        self.journal = state.journal
        self.gone = gone
        self.stamp = stamp
        #: A run of entries is punched when it is at least this long, or half its segment.
        self.min_bytes = MIN_LEDGER_PUNCH_BYTES
        #: Whether successes of jobs in the journal's punched ranges go too (off: ``cancel()``
        #: and a rebuilt lookup index find a punched job by them; see
        #: :func:`hybridq.ledger.punch_select.punchable`). Not a setting: the tests and the
        #: benchmark turn it on.
        self.done_in_ranges = False
        #: Whether successes of jobs in the journal's punched ranges go once their ids are kept
        #: in the segment's ids file (:mod:`hybridq.ledger.punched_ids`; the default: a pinned
        #: ledger keeps about 22 bytes a finished job, not 190). Off: they stay (the tests).
        self.keep_ids = True
        #: Per ledger segment read: the journal segments its kept entries name that had not gone
        #: then (its reach); those of its kept successes that may go once their record is
        #: punched, with the count of their segment's punched records then; and the journal's
        #: punch progress then (:meth:`_stale`).
        self._read: dict[Seg, tuple[frozenset[Seg], dict[Seg, int], int]] = {}
        #: Segments whose ids file or index save failed, left alone until this monotonic time.
        self._held: dict[Seg, float] = {}
        #: Bytes punched out of the ledger by this process (for the log and the tests).
        self.punched = 0
        #: Entries looked at (for the CPU figure per entry in docs/benchmarks.md).
        self.looked = 0

    def _stale(self, seg: Seg, progress: int, gone: Callable[[Seg], bool]) -> bool:
        """Whether a read of ``seg`` may punch more than its last read did.

        Only once a journal segment its kept entries name has gone since (their reach, as
        ``_compact_ledger``'s ``all_gone``), or more records were punched out of a journal
        segment whose records its kept successes name (those that go once their record is
        punched: ``kept_by_id``, or any success with ``done_in_ranges``). Not on any compaction
        or journal punch: under a steady load one comes about every pass, and a 4 MiB segment
        costs about 0.3 s of CPU to read (12 us an entry, docs/benchmarks.md), on the
        forwarder's loop. A journal punch alone does not make a segment stale for its ``retry``
        and ``lost`` entries: what it frees of them seldom makes a run; they go at the next
        read for another reason.
        """
        read = self._read.get(seg)
        if read is None:
            return True
        reach, waits, at = read
        if any(gone(j) for j in reach):
            return True
        if waits and at != progress:  # the journal punched something since: was it theirs?
            if any(self._punched_records(j) != n for j, n in waits.items()):
                return True
            self._read[seg] = (reach, waits, progress)
        return False

    def _holes(self, jseg: Seg) -> tuple[Hole, ...]:
        """Journal segment ``jseg``'s punched ranges; none if its map cannot be read (the scan says so)."""
        try:
            return read_holes(self.journal, *jseg)
        except (OSError, StateFileCorrupt):
            return ()

    def _punched_records(self, jseg: Seg) -> int:
        """How many records of journal segment ``jseg`` its hole map lists."""
        return sum(h.count for h in self._holes(jseg))

    def _once_punched(self, entry: Entry) -> bool:
        """Whether ``entry`` (kept) may go once its journal record is punched."""
        if self.done_in_ranges and punchable(entry, _never, _always, done_in_ranges=True):
            return True
        return self.keep_ids and kept_by_id(entry, _always)

    def step(self, journal_punched: int = 0) -> int:
        """Punch the runs of at most one sealed ledger segment; returns the bytes punched.

        ``journal_punched``: bytes the journal's puncher freed so far (its progress).
        """
        path = ledger_dir(self.journal)
        if not os.path.isdir(path) or not punch_supported(self.journal):
            return 0
        chains = list_chains(path)
        own = self.state.own_chain
        progress = journal_punched
        present = {(w, i) for w, indices in chains.items() for i in indices}
        self._read = {seg: r for seg, r in self._read.items() if seg in present}
        self._held = {seg: t for seg, t in self._held.items() if seg in present}
        remove_orphans(path, present)  # the ids files of ledger segments deleted since
        if not self.state.index_savable():
            # Every punch would stop at its index save (a failed append, a poisoned key table,
            # until a restart): no segment read (about 0.3 s of CPU each) and held for nothing.
            return 0
        gone = self.gone()
        for writer_id, indices in chains.items():
            for index in indices:
                if writer_id == own and index == indices[-1]:
                    break  # our own open segment
                seg = (writer_id, index)
                if self._held.get(seg, 0.0) > time.monotonic() or not self._stale(seg, progress, gone):
                    continue  # held: its ids file could not be written; the next segments still go
                if sealed_data_count(path, writer_id, index) is None:
                    break  # not sealed (another process's open segment)
                return self._punch(path, seg, gone, progress)
        return 0

    def _punch(self, path: str, seg: Seg, gone: Callable[[Seg], bool], progress: int) -> int:
        maps: dict[Seg, tuple[Hole, ...]] = {}  # the journal's maps, each read once, as decided on
        reach: set[Seg] = set()
        waits: set[Seg] = set()

        def punched(loc: Loc) -> bool:
            holes = maps.get((loc[0], loc[1]))
            if holes is None:
                holes = maps[(loc[0], loc[1])] = self._holes((loc[0], loc[1]))
            return hole_at(holes, loc[2]) is not None

        keys: list[Entry] = []
        run_keys: list[Entry] = []
        ids: list[PunchedId] = []
        run_ids: list[PunchedId] = []
        # Sealed (the caller checked): its data ends where its seal records start.
        runs = RunBuilder(self.min_bytes, seal_offset(path, *seg) or 0)

        def close() -> None:
            if runs.close():
                keys.extend(run_keys)
                ids.extend(run_ids)
            run_keys.clear()
            run_ids.clear()

        for rec in JournalReader(path).segment_records(*seg):
            self.looked += 1
            try:
                entry: Entry | None = Entry.from_bytes(rec.payload)
            except (ValueError, KeyError, TypeError):
                entry = None  # passed its checksum, so a bug: kept, as every reader skips it
            ok = entry is not None and punchable(entry, gone, punched, done_in_ranges=self.done_in_ranges)
            by_id = not ok and self.keep_ids and entry is not None and kept_by_id(entry, punched)
            ok = ok or by_id
            if not ok and entry is not None and not gone(entry.loc[:2]):
                reach.add((entry.loc[0], entry.loc[1]))
                if self._once_punched(entry):
                    waits.add((entry.loc[0], entry.loc[1]))
            if not ok or runs.breaks_at(rec):
                close()  # an entry kept, or a punched range, between
            if ok and entry is not None:
                runs.add(rec)
                if entry.kind == "key":
                    run_keys.append(entry)
                elif by_id:
                    run_ids.append(PunchedId.of(entry))
        close()
        # The counts of the maps this read decided on, not read again: a range mapped since must
        # make the segment stale.
        counts = {j: sum(h.count for h in maps.get(j, ())) for j in waits}
        self._read[seg] = (frozenset(reach), counts, progress)
        if not runs.runs:
            return 0
        stamped = self.stamp(keys)
        if stamped:
            self.state.store_keys(stamped)  # durable before the entries that had them go
        crashpoints.reached("ledger_punch_after_keys")
        # A start from a saved index does not read the key store: it replays the ledger after
        # the index's mark, which must then still hold every key entry after it. So the index
        # (and the key table, with the windows just stamped) is saved first; not saved (a
        # poisoned key table, an I/O error such as a full disk: logged by the saver): nothing is
        # punched, and the segment is held as on a failed ids file, then read again.
        if not self.state.save_index_now():
            self._hold(seg, "the ledger index not saved")
            return 0
        crashpoints.reached("ledger_punch_after_index")
        if ids:
            # Durable before the map: from then on the ids file is all that names these jobs
            # (a crash between the two leaves them named twice, which readers fold into one).
            # A damaged ids file raises StateFileCorrupt out of here: the forwarder stops, as on
            # a damaged hole map (docs/reliability.md rule 12); skipped, it would be read every pass.
            try:
                kept = read_ids(path, *seg)
                write_ids(path, *seg, list(dict.fromkeys([*kept, *ids])))
            except (OSError, JournalIOError) as exc:
                # write_state wraps its OSError in JournalIOError. A full disk (ENOSPC, EDQUOT)
                # holds this segment; any other error goes out of step() as a failed hole-map
                # write does, the segment read again on the next pass (StateFileCorrupt is neither).
                self._read.pop(seg, None)
                if isinstance(exc, JournalIOError) and exc.errno not in FULL_ERRNOS:
                    raise
                self._hold(seg, f"ids file not written: {exc}")
                return 0
        crashpoints.reached("ledger_punch_after_ids")
        freed, _ = punch_holes(path, seg[0], seg[1], runs.runs)
        if freed:
            log.info("punched %d bytes of the ledger out of segment %d of chain %s", freed, seg[1], seg[0])
        self.punched += freed
        return freed

    def _hold(self, seg: Seg, why: str) -> None:
        """Leave ``seg`` alone for :data:`IDS_RETRY_S`, then read it again; the later segments still go."""
        self._read.pop(seg, None)
        log.warning(
            "ledger punch of segment %d of chain %s held %.0f s: %s", seg[1], seg[0], IDS_RETRY_S, why
        )
        self._held[seg] = time.monotonic() + IDS_RETRY_S


def _never(_seg: Seg) -> bool:
    return False


def _always(_loc: Loc) -> bool:
    return True
