"""The ledger's in-memory index (:class:`LedgerIndex`): terminal jobs, duplicates, retries, keys.

Replaying the records in any order gives the same :class:`LedgerIndex` (a terminal outcome beats
everything, the highest attempt wins), because records of several chains have no global order
(but for two cases of the listed failures: docs/reliability.md, the key table).
Outcomes of one job rank ``succeeded`` > ``failed`` > ``cancelled``, whatever order they are read
in: what a run really did beats the cancel. The entry format is :mod:`hybridq.ledger.entries`.

This module must not import redis or rq.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from hybridq.journal.records import Loc
from hybridq.ledger.duptable import DuplicateTable
from hybridq.ledger.entries import Entry, Seg
from hybridq.ledger.failtable import FailureTable
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.outcome_disk import UNCAPPED, spill_largest
from hybridq.ledger.outcomes import SegmentOutcomes
from hybridq.ledger.outranking import outranking
from hybridq.protocol import EntryKind

#: Which outcome of one job wins when several are recorded (see the module docstring).
_RANK = {"cancelled": 1, "failed": 2, "succeeded": 3}
#: One string object per outcome: an entry's own (decoded from its JSON) would be kept once per
#: terminal job in :attr:`LedgerIndex.terminal` until its next merge (58 bytes each, issue 29).
_SHARED = {name: name for name in ("cancelled", "failed", "succeeded", "invalid")}
_SUCCEEDED = _SHARED["succeeded"]
#: Entry kinds compared on every entry folded, as module constants: on Python 3.11 a member read
#: from its class goes through ``EnumType``'s ``__getattr__`` hook, about 900 instructions
#: (docs/benchmarks.md, "The forwarder's writes per job, again").
_DONE, _RETRY, _LOST = EntryKind.DONE, EntryKind.RETRY, EntryKind.LOST
_REQUEUED, _KEY = EntryKind.REQUEUED, EntryKind.KEY
_DUPLICATE, _CANCEL = EntryKind.DUPLICATE, EntryKind.CANCEL


@dataclass
class LedgerIndex:
    """What the ledger says, in memory: which jobs are terminal, retries due, failures to list."""

    #: Per journal segment, offset -> terminal outcome of the job recorded there (about 6 bytes a
    #: job: :mod:`hybridq.ledger.outcomes`; on disk past :attr:`spill_cap`).
    terminal: dict[Seg, SegmentOutcomes] = field(default_factory=dict)
    #: Suppressed duplicate deliveries, per journal segment of the job they delivered.
    dups: dict[Seg, int] = field(default_factory=dict)
    #: Non-terminal jobs with a failed attempt: loc -> (run_at, attempt that failed).
    retries: dict[Loc, tuple[float, int]] = field(default_factory=dict)
    #: Non-terminal jobs whose worker vanished: loc -> (highest attempt lost, times lost).
    lost: dict[Loc, tuple[int, int]] = field(default_factory=dict)
    #: Non-terminal jobs that said RetryLater: loc -> (how many times, when first). A delivery
    #: carries them: the job's attempt is the run's minus them, the deadline counts from then.
    later: dict[Loc, tuple[int, float]] = field(default_factory=dict)
    #: Explicit idempotency keys (hashes) -> the ``key`` entry of the job that owns each: in
    #: memory here, on disk in the forwarder (:mod:`hybridq.ledger.keytable`, issue 29); its
    #: file holds the listed failures too (:attr:`failed`).
    keys: KeyTable = field(default_factory=KeyTable)
    #: Jobs in :attr:`terminal` (kept as a number so the forwarder can publish it cheaply).
    terminal_count: int = 0
    #: Running totals over :attr:`terminal` and :attr:`dups` (for metrics: no scan on a scrape).
    totals: dict[str, int] = field(
        default_factory=lambda: {"succeeded": 0, "failed": 0, "invalid": 0, "dups": 0, "cancelled": 0}
    )
    #: Ids of the events behind :attr:`dups`, per journal segment (a re-harvest after a crash
    #: must not count a duplicate twice; everything else in the index is idempotent already).
    dup_events: dict[Seg, set[str]] = field(default_factory=dict)
    #: Jobs a cancel was asked for that are not terminal yet: loc -> their ``cancel`` entry.
    cancels: dict[Loc, Entry] = field(default_factory=dict)
    #: The most listed offsets :attr:`terminal` holds in memory (:meth:`spill_past`); ``None``:
    #: no cap (every reader of the ledger but the forwarder).
    spill_cap: int | None = field(default=None, compare=False)
    #: The journal directory whose ``.index-spill`` holds the spilled maps' files
    #: (:mod:`hybridq.ledger.spill_files`).
    spill_dir: str = field(default="", compare=False)
    #: At which :attr:`terminal_count` the cap is checked next (moved with it when it falls, so
    #: that as many jobs are added between two checks).
    _check_at: int = field(default=UNCAPPED, repr=False, compare=False)

    @property
    def failed(self) -> FailureTable:
        """Jobs that failed for good, not requeued: loc -> their ``done`` entry (with the envelope).

        Rows of :attr:`keys`'s file, not entries in memory (:mod:`hybridq.ledger.failtable`).
        """
        return self.keys.failures

    @property
    def duplicates(self) -> DuplicateTable:
        """Duplicates not settled yet (their key's owner is not terminal): loc -> ``duplicate`` entry.

        Rows of :attr:`keys`'s file, not entries in memory (:mod:`hybridq.ledger.duptable`).
        """
        return self.keys.duplicates

    def is_terminal(self, loc: Loc) -> bool:
        """Whether the job at ``loc`` reached a terminal outcome."""
        done = self.terminal.get((loc[0], loc[1]))
        if done is None:
            return False
        offset = loc[2]
        return offset in done.recent or done.has_merged(offset)

    def outcome(self, loc: Loc) -> str | None:
        """The terminal outcome of the job at ``loc``, ``None`` if it has none."""
        done = self.terminal.get((loc[0], loc[1]))
        return None if done is None else done.get(loc[2])

    def attempts(self, loc: Loc) -> int:
        """The highest attempt known to have started for the job at ``loc`` (0 if none)."""
        return max(self.retries.get(loc, (0.0, 0))[1], self.lost.get(loc, (0, 0))[0])

    def apply(self, entry: Entry, raw: bytes | None = None) -> bool:
        """Fold one entry in; returns ``False`` if it changed nothing (a replayed event).

        ``raw``: the entry's JSON (``entry.to_bytes()``) if the caller has it: a listed failure
        is kept as it (:meth:`FailureTable.put`).
        """
        loc, seg = entry.loc, (entry.loc[0], entry.loc[1])
        if entry.dup and entry.event_id is not None:
            seen = self.dup_events.setdefault(seg, set())
            if entry.event_id in seen:
                return False
            seen.add(entry.event_id)
        if entry.kind == _REQUEUED:
            self.failed.requeue(loc)
            return True
        if entry.kind == _KEY:
            return self._own_key(entry)
        if entry.kind == _DUPLICATE:
            if self.is_terminal(loc):
                return False
            return self.duplicates.add(entry, raw)
        if entry.kind == _CANCEL:
            if self.is_terminal(loc) or loc in self.cancels:
                return False
            self.cancels[loc] = entry
            return True
        if entry.dup:
            self.dups[seg] = self.dups.get(seg, 0) + 1
            self.totals["dups"] += 1
        if entry.kind == _DONE:
            done = self.terminal.get(seg)
            if done is None:
                done = self.terminal[seg] = SegmentOutcomes()
            new = shared(entry.outcome)
            old = done.insert(loc[2], new)
            if old is not None:
                if _RANK.get(new, 0) > _RANK.get(old, 0) > 0:
                    # A success beats a failure whatever the order the two were read in (the
                    # forwarder gave up on a lost worker that then reported after all), and
                    # what a run reported beats a cancel the forwarder settled meanwhile.
                    done[loc[2]] = new
                    self.totals[old] -= 1
                    self.totals[new] += 1
                    self.failed.delist(loc)
                    if new == "failed" and entry.dup_of is None and entry.under is None:
                        self.failed.put(loc, entry, raw)  # unless requeued (a mark stays in the table)
                    return True
                return entry.dup
            self.terminal_count += 1
            if new in self.totals:
                self.totals[new] += 1
            self.retries.pop(loc, None)
            self.lost.pop(loc, None)
            self.later.pop(loc, None)
            if self.keys.duplicates.pending:  # an int test while there is none (the common case)
                self.keys.duplicates.ended(loc)
            self.cancels.pop(loc, None)
            # A settled duplicate is not listed: its owner is (requeue that one).
            # A requeue mark read before it keeps it off the list (:meth:`FailureTable.put`);
            # one ``under`` a success is never listed, even read before that success (a replay's
            # chain order), as apply_compacted does (docs/reliability.md).
            if entry.outcome == "failed" and entry.dup_of is None and entry.under is None:
                self.failed.put(loc, entry, raw)
            return True
        if self.is_terminal(loc):
            return False
        if entry.kind == _RETRY:
            known = self.retries.get(loc)
            if known is None or entry.attempt > known[1]:
                self.retries[loc] = (float(entry.run_at or 0.0), entry.attempt)
            if entry.later:  # counts only grow, the first time only goes back: any order folds alike
                count, since = self.later.get(loc, (0, float(entry.later_since or 0.0)))
                self.later[loc] = (max(count, entry.later), min(since, float(entry.later_since or since)))
            return True
        if entry.kind == _LOST:
            attempt, times = self.lost.get(loc, (0, 0))
            self.lost[loc] = (max(attempt, entry.attempt), times + 1)
            return True
        return False

    def outranking(self, entries: Sequence[Entry]) -> Sequence[Entry]:
        """``entries`` to append, each outcome ranked against the job's other one in its record.

        A success of a job recorded ``failed`` is marked ``over``, a failure of a job recorded
        ``succeeded`` ``under`` (:func:`hybridq.ledger.outranking.outranking`).
        """
        return outranking(entries, self.terminal, bool(self.totals["failed"]), self.outcome)

    def apply_compacted(self, entry: Entry) -> None:
        """Fold in an entry of a compacted journal segment: counted in Compacted already.

        Only what outlives the segment matters: a failure still listed (not one ``under`` a
        success), a requeue mark, a success that outranked a failure (its mark: no outcome is
        kept here to rank the two, and chains are read in any order; docs/reliability.md, "A
        success outranks a failure"), and a finished job's key (its window).
        """
        kind = entry.kind
        if kind == _DONE:
            if entry.outcome == "failed" and entry.dup_of is None and entry.under is None:
                self.failed.setdefault(entry.loc, entry)
            elif entry.over is not None and entry.outcome == _SUCCEEDED:  # a dup's too, as apply ranks it
                self.failed.outrank(entry.loc)
        elif kind == _REQUEUED:
            self.failed.requeue(entry.loc)
        elif kind == _KEY:
            self.apply(entry)

    def apply_succeeded(self, loc: Loc) -> bool:
        """:meth:`apply` of a ``done`` entry that ``succeeded``, not a duplicate (most of a ledger).

        The same changes without building an :class:`Entry` (the replay at start: a third of its
        time went to building them).
        """
        seg = (loc[0], loc[1])
        done = self.terminal.get(seg)
        if done is None:
            done = self.terminal[seg] = SegmentOutcomes()
        old = done.insert(loc[2], _SUCCEEDED)
        if old is not None:
            if _RANK.get(old, 0) not in (1, 2):
                return False  # succeeded already, or invalid: nothing outranks them here
            done[loc[2]] = _SUCCEEDED
            self.totals[old] -= 1
            self.totals["succeeded"] += 1
            self.failed.delist(loc)
            return True
        self.terminal_count += 1
        self.totals["succeeded"] += 1
        for table in (self.retries, self.lost, self.later, self.cancels):
            if table:  # mostly all empty in a drain: no hash of ``loc`` for them
                table.pop(loc, None)
        if self.keys.duplicates.pending:
            self.keys.duplicates.ended(loc)
        return True

    def _own_key(self, entry: Entry) -> bool:
        """Make the job of a ``key`` entry its key's owner if it is the newest (any replay order).

        Newest by admission time: a job admitted after the key was forgotten, or a requeue, takes
        the key over. The same job's entry re-appended by compaction (with ``until``) replaces it.
        """
        return self.keys.own(entry)

    def owner_outcome(self, owner: Entry, gone: Callable[[Loc], bool]) -> str | None:
        """The outcome of the job owning a key (``owner``: its ``key`` entry); ``None`` if pending.

        ``gone(loc)``: whether the journal segment of ``loc`` was compacted (its jobs all terminal,
        their outcomes forgotten but for listed failures).
        """
        return self.outcome_at(owner.loc, gone, owner.outcome)

    def outcome_at(self, loc: Loc, gone: Callable[[Loc], bool], known: str | None = None) -> str | None:
        """The outcome of the job at ``loc`` even if its segment was compacted; ``None`` if pending.

        ``known``: the outcome its key entry carries, if any (:meth:`owner_outcome`): a
        compacted job's cancel is known only there. Else a compacted job failed if its failure
        is listed or was requeued (the mark stays), and succeeded otherwise.
        """
        done = self.outcome(loc)
        if done is not None:
            return done
        if known is not None:
            return known
        if gone(loc):
            return "failed" if self.failed.failed_at(loc) else "succeeded"
        return None

    def forget_keys(self, now: float, most: int | None = None) -> int:
        """Forget keys whose window ended before ``now``; beyond ``most`` keys left, the oldest.

        Only keys with a window count (those of pending jobs, or of jobs whose segment is still
        in the journal, have none). Returns how many were forgotten.
        """
        return self.keys.forget_expired(now, most)

    def forget_segment(self, seg: Seg) -> None:
        """Drop what is known about a compacted journal segment (its counts moved to Compacted)."""
        done = self.terminal.pop(seg, None)
        if done is not None:
            for outcome, n in done.tally().items():
                if outcome in self.totals:
                    self.totals[outcome] -= n
            self.terminal_count -= len(done)
            self._check_at -= len(done)
        self.totals["dups"] -= self.dups.get(seg, 0)
        self.dups.pop(seg, None)
        self.dup_events.pop(seg, None)

    def collapse(self, seg: Seg, spans: Iterable[tuple[int, int, int]]) -> None:
        """Keep the punched ranges ``spans`` (``(start, end, jobs)``) of ``seg`` instead of their offsets.

        Only for ranges of a durable hole map: every job in them finished (docs/reliability.md
        rule 8), so a range adds no job and changes no answer (:meth:`SegmentOutcomes.drop_ranges
        <hybridq.ledger.outcomes.SegmentOutcomes.drop_ranges>`). The counts follow what the map
        holds after, should it hold a job more (one whose outcome the replay missed) or fewer.
        """
        done = self.terminal.get(seg)
        if done is None:
            done = self.terminal[seg] = SegmentOutcomes()
        n, before = len(done), done.tally()
        spans = sorted(spans)
        done.drop_ranges(spans)
        # What a replay left of a job in a range whose ``done`` entry was punched out of the
        # ledger (hybridq.ledger.punch_select): those tables hold jobs not terminal only (few:
        # one pass each, a bisect per row of this segment).
        for table in (self.retries, self.lost, self.later, self.cancels):
            if table:
                for loc in [loc for loc in table if (loc[0], loc[1]) == seg and _inside(loc[2], spans)]:
                    del table[loc]
        after = done.tally()
        self.terminal_count += len(done) - n
        self._check_at += len(done) - n
        for name in {*before, *after}:
            if name in self.totals:
                self.totals[name] += after.get(name, 0) - before.get(name, 0)

    def check_spill(self) -> None:
        """:meth:`spill_past` if enough jobs were added since the last check: one compare.

        Called after each batch folded in (the forwarder's ledger appends), not in :meth:`apply`
        and :meth:`apply_succeeded`: a compare there cost 1.7 % of the instructions of a job
        added (docs/benchmarks.md, "The ledger index spilled past a cap").
        """
        if self.terminal_count >= self._check_at:
            self.spill_past(self.spill_dir, self.spill_cap)

    def spill_past(self, directory: str, cap: int | None) -> None:
        """Hold at most about ``cap`` listed offsets of :attr:`terminal` in memory: the rest on disk.

        Now, and by :meth:`check_spill` every so many jobs added: the largest maps but the drain
        front's (:func:`~hybridq.ledger.outcome_disk.spill_largest`). ``None``: no cap (the
        spilled maps stay spilled). The bound: docs/forwarder.md, "Memory: the bound that holds
        now" (issue 29).
        """
        self.spill_dir, self.spill_cap = directory, cap
        self._check_at = self.terminal_count + spill_largest(self.terminal, directory, cap)

    def counts(self, live: Iterable[Seg]) -> dict[str, int]:
        """``succeeded``, ``failed``, ``invalid``, ``dups`` and ``cancelled`` over the given segments."""
        out = {"succeeded": 0, "failed": 0, "invalid": 0, "dups": 0, "cancelled": 0}
        for seg in live:
            done = self.terminal.get(seg)
            for outcome, n in ({} if done is None else done.tally()).items():
                if outcome in out:
                    out[outcome] += n
            out["dups"] += self.dups.get(seg, 0)
        return out


def _inside(offset: int, spans: list[tuple[int, int, int]]) -> bool:
    """Whether ``offset`` is in one of ``spans`` (sorted, not overlapping: a hole map's ranges)."""
    at = bisect.bisect_right(spans, offset, key=lambda span: span[0]) - 1
    return at >= 0 and offset < spans[at][1]


def shared(outcome: str | None) -> str:
    """The shared string object of ``outcome`` (``failed`` when missing)."""
    name = outcome or "failed"
    return _SHARED.get(name, name)
