"""Moving a :class:`~hybridq.ledger.outcomes.SegmentOutcomes`'s arrays to disk and back.

:class:`SpillableOutcomes` holds the map's operations on its file (:mod:`hybridq.ledger.outcome_spill`):
:meth:`~SpillableOutcomes.spill` (what :meth:`LedgerIndex.spill_past
<hybridq.ledger.index.LedgerIndex.spill_past>` calls past its cap), the merge of a spilled map's
:attr:`recent`, and the rare changes of an offset in the file. Apart from
:mod:`hybridq.ledger.outcomes` (house style: small modules); :class:`SegmentOutcomes` inherits
these. What a spilled map keeps in memory, and why its file is trusted by nothing but this
process: :mod:`hybridq.ledger.outcome_spill` and :mod:`hybridq.ledger.spill_files`.

A map goes back to memory only for a change of its arrays other than an append or a code (a
merge of jobs that finished out of order, a delete, a punch): read back whole, changed as in
memory, written to a new file (the old one removed). So a spilled map stays spilled: the index
chose it as one of the largest not at a drain front (:meth:`LedgerIndex.spill_past
<hybridq.ledger.index.LedgerIndex.spill_past>`).

This module must not import redis or rq.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hybridq.ledger.outcome_codes import _CODES, _NARROW_MAX, _NO_CODES, _NO_OFFSETS, _WIDE_MAX
from hybridq.ledger.outcome_counts import OutcomeCounts
from hybridq.ledger.outcome_spill import SpilledArrays
from hybridq.ledger.spill_files import paused, spill_failed, sweep

__all__ = ["SPILL_CHECK_MIN", "SPILL_DOWN_TO", "UNCAPPED", "SpillableOutcomes", "spill_largest"]

#: The index's cap is checked every eighth of it of jobs added (at least this many), and a check
#: past it spills down to this fraction of it (:func:`spill_largest`).
SPILL_CHECK_MIN = 1024
SPILL_DOWN_TO = 0.75
#: Jobs added between two checks without a cap (a check then does nothing; a one-digit int).
UNCAPPED = 2**30 - 1


class SpillableOutcomes(OutcomeCounts):
    """The on-disk operations of :class:`~hybridq.ledger.outcomes.SegmentOutcomes` (module docstring)."""

    # The map's state, set and described by SegmentOutcomes (hybridq.ledger.outcomes).
    __slots__ = ("_at", "_codes", "_last", "_merge_at", "_odd", "_offsets", "_punched", "_spill", "recent")
    _at: int
    _last: float
    _merge_at: int

    def _merge(self) -> None:
        raise NotImplementedError

    def _merge_at_for(self, n: int) -> int:
        raise NotImplementedError

    def __setitem__(self, offset: int, outcome: str) -> None:
        raise NotImplementedError

    def resident(self) -> int:
        """The listed offsets this map holds in memory (what the index's cap counts)."""
        return len(self._offsets) + len(self.recent) + (len(self._odd) if self._odd else 0)

    @property
    def spilled(self) -> bool:
        """Whether the arrays are on disk."""
        return self._spill is not None

    def spill(self, directory: str) -> bool:
        """Move the arrays (with :attr:`recent` merged in) to a file in ``directory``.

        A spilled map's :attr:`recent` is merged into its file. ``False``: they stay in memory
        (none to move, or the write failed or was refused: logged once, a full disk is a pause
        elsewhere).
        Reading the file back failing raises :class:`~hybridq.errors.JournalIOError`.
        """
        self._merge()
        if self._spill is not None or not self._offsets:
            return self._spill is not None
        try:
            spill = SpilledArrays.write(directory, self._offsets, self._codes)
        except OSError as exc:
            spill_failed(exc)
            return False
        self._spill, self._offsets, self._codes, self._at = spill, _NO_OFFSETS, _NO_CODES, 0
        return True

    def _unspill(self) -> str:
        """Read the arrays back into memory (the file removed); returns its directory."""
        spill = self._spill
        assert spill is not None
        offsets, codes = spill.read("I" if spill.last <= _NARROW_MAX else "Q")
        self._offsets, self._codes, self._spill, self._at = offsets, codes, None, 0
        spill.close()
        return spill.directory

    def _merge_spilled(self) -> None:
        """:meth:`_merge` of a spilled map: an append to its file, or in memory and out again.

        Appended when all are past the file's end (jobs finished in order), else merged in
        memory and written to a new file.
        """
        spill, recent = self._spill, self.recent
        assert spill is not None
        if paused():  # writes held back (a full disk): the additions wait in memory, not the map
            if recent:
                self._merge_later()
            return
        keys = sorted(recent)
        if keys and keys[0] > spill.last and keys[-1] <= _WIDE_MAX:
            codes = bytes(map(_CODES.__getitem__, map(recent.__getitem__, keys)))
            try:
                spill.append(keys, codes)
            except OSError as exc:
                spill_failed(exc)
                self._merge_later()
                return
            else:
                self._last = spill.last
                self._merge_at = self._merge_at_for(spill.n)
                recent.clear()
                return
        elif not keys:
            return
        directory = self._unspill()
        self._merge()
        self.spill(directory)

    def _merge_later(self) -> None:
        """A spilled map's merge not written now: its latest additions stay in :attr:`recent`.

        The next merge comes when it holds twice as many: reading the whole map back to memory
        instead (its file's write refused too) would undo the cap while the disk stays full.
        """
        self._merge_at = max(self._merge_at, len(self.recent)) * 2

    def _set_spilled(self, spill: SpilledArrays, offset: int, outcome: str) -> None:
        """:meth:`__setitem__` of an offset in the file: its code rewritten there (a rank upgrade).

        A name with no code (or a failed write): in memory, changed, written out again.
        """
        code = _CODES.get(outcome)
        if code is not None:
            try:
                spill.set_code(offset, code)
            except OSError as exc:
                spill_failed(exc)
            else:
                return
        self._in_memory(lambda: self.__setitem__(offset, outcome))

    def _in_memory(self, change: Callable[[], None]) -> None:
        """Make ``change`` to the arrays read back in memory, then write them to a new file."""
        directory = self._unspill()
        try:
            change()
        finally:
            self.spill(directory)

    def _unlisted(self, offset: int) -> bool:
        """Whether ``offset``, in neither :attr:`recent` nor the arrays, is in :attr:`_odd` or a range."""
        return (offset in self._odd if self._odd else False) or (
            self._punched is not None and self._punched.covers(offset)
        )


def spill_largest(maps: Mapping[tuple[str, int], SpillableOutcomes], directory: str, cap: int | None) -> int:
    """Past ``cap`` listed offsets in memory, spill the maps holding most; returns the jobs to the next check.

    ``maps``: per journal segment ``(writer, index)``. Spilled down to :data:`SPILL_DOWN_TO` of
    ``cap`` (no spill at every check), the next check ``cap / 8`` jobs later (at least
    :data:`SPILL_CHECK_MIN`). The newest two segments of each writer stay in memory: the drain
    front, which the pushes and the harvest ask most. A map spilled already is left alone: its
    :attr:`recent` is merged by the rule of any map's (a check over the cap would otherwise
    rewrite every spilled map with one late finish). None while writes are held back
    (:func:`~hybridq.ledger.spill_files.paused`: a full disk), and none after the first that
    fails. The first call of the process for ``directory`` removes the spill files a killed
    process left there (:func:`~hybridq.ledger.spill_files.sweep`), even with no cap.
    ``None``: no cap.
    """
    sweep(directory)
    if cap is None:
        return UNCAPPED
    held = {seg: done.resident() for seg, done in maps.items()}
    total = sum(held.values())
    if total > cap and not paused():
        newest: dict[str, list[int]] = {}
        for writer, segment in held:
            newest.setdefault(writer, []).append(segment)
        front = {(writer, n) for writer, segments in newest.items() for n in sorted(segments)[-2:]}
        for seg in sorted(held.keys() - front, key=held.__getitem__, reverse=True):
            if total <= cap * SPILL_DOWN_TO or not held[seg]:
                break
            done = maps[seg]
            if done.spilled:
                continue
            moved = done.spill(directory)
            total -= held[seg] - done.resident()
            if not moved and paused():
                break
    return max(SPILL_CHECK_MIN, cap // 8)
