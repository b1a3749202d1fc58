"""A restarted forwarder's count of jobs read and not terminal: saved at a clean stop, or counted anew.

The count is saved in ``lookup/pending.state``.

A restarted forwarder counts the records it had read before (:class:`DeferredCount`): a JSON
parse of every record of the live journal, after the first push but for seconds at a million
(the stats snapshot waits for it, and the loop does not idle meanwhile). At a clean stop the
count is saved with what it was counted from: the checkpoint's positions, the journal's segments
before them (a repair cuts or removes some), the files of the ledger and of the key store (each
segment's name and size), and the compaction state. The next start
takes it only if all of them are still the same, so it is exactly what a count would give;
anything else (a crash, an outcome appended by another process, a torn tail repaired, a
compaction) makes the start count as before. The file is read once and deleted; a damaged one
is ignored (it is a cache).

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from hybridq.errors import StateFileCorrupt
from hybridq.journal import ChainPosition, JournalReader, RecordType
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.format import FILE_HEADER_SIZE, parse_segment_name, segment_name
from hybridq.journal.paths import ensure_journal_dir
from hybridq.journal.reader import list_chains, peek_header
from hybridq.journal.records import Loc
from hybridq.journal.statefile import MAX_STATE_BYTES, read_state, write_state
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import keys_dir, ledger_dir
from hybridq.lookup.pending import PendingTracker
from hybridq.lookup.pending_blocks import Segment, job_fields

log = logging.getLogger(__name__)

__all__ = ["DeferredCount", "count_into", "count_key", "load_count", "save_count"]

NAME = "pending"
_LEN = struct.Struct("<I")


def _dir(journal: str) -> str:
    return os.path.join(journal, "lookup")


def _files(path: str) -> list[list[Any]]:
    """Each segment file of a ledger-format directory, with its size (none if it is missing)."""
    with contextlib.suppress(FileNotFoundError), os.scandir(path) as it:
        return sorted([e.name, e.stat().st_size] for e in it if e.name.endswith(".wal"))
    return []


def _read_segments(journal: str, positions: Mapping[str, ChainPosition]) -> list[list[Any]]:
    """The journal's segments before the positions (sealed: name and size), and the positions' own.

    They change only when ``journal repair`` cuts or removes one (a compaction is in the key too).
    """
    found: list[list[Any]] = []
    with os.scandir(journal) as it:
        for entry in it:
            parsed = parse_segment_name(entry.name)
            position = positions.get(parsed[0]) if parsed is not None else None
            if parsed is None or position is None or parsed[1] > position.segment:
                continue
            found.append([entry.name, entry.stat().st_size if parsed[1] < position.segment else None])
    return sorted(found)


def count_key(journal: str, positions: Mapping[str, ChainPosition], compacted: Compacted) -> str:
    """What a count up to ``positions`` is made from: equal keys, equal counts (a few ``stat``)."""
    return json.dumps(
        {
            "v": 3,  # the file's format (1: a row per record, 2: no sums; their keys never equal a 3)
            "positions": {w: list(p) for w, p in positions.items()},
            "journal": _read_segments(journal, positions),
            "ledger": _files(ledger_dir(journal)),
            "keys": _files(keys_dir(journal)),
            "compacted": json.loads(compacted.to_bytes()),
        },
        sort_keys=True,
    )


def save_count(
    journal: str, count: DeferredCount, positions: Mapping[str, ChainPosition], compacted: Compacted
) -> None:
    """Save ``count`` (complete only) for the next start; call once nothing else will be written.

    Only the records before ``positions``: the next start reads from there (and joins its own
    count behind this one).
    """
    if not (count.started and count.ready):
        return  # a start that failed before its count began: an empty count is not the count
    count.live.rewind(positions)  # records read past the checkpoint (none after a whole step)
    if count.live.inexact:
        return  # a block not read back: counts too high, the next start counts anew
    key = count_key(journal, positions, compacted).encode()
    payload = _LEN.pack(len(key)) + key + count.live.to_bytes()
    if len(payload) > MAX_STATE_BYTES:
        return  # millions of rows (blocks where some jobs finished and some not): counted again
    write_state(ensure_journal_dir(_dir(journal)), NAME, payload)


def load_count(journal: str, key: str) -> PendingTracker | None:
    """The count saved at the last stop, if it was made from the files ``key`` names; deleted once read.

    ``key``: :func:`count_key` at the start, before anything was written.
    """
    try:
        payload = read_state(_dir(journal), NAME)
    except (StateFileCorrupt, OSError):
        payload = None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(_dir(journal), NAME + ".state"))
    if payload is None:
        return None
    try:
        (n,) = _LEN.unpack_from(payload)
        if payload[_LEN.size : _LEN.size + n].decode() != key:
            return None  # made from other files: counted again
        return PendingTracker.from_bytes(payload[_LEN.size + n :], journal)
    except (ValueError, KeyError, TypeError, struct.error):
        return None


def _count_dead(
    tracker: PendingTracker,
    journal: str,
    writer: str,
    indices: list[int],
    pos: ChainPosition,
    index: LedgerIndex,
    compacted: Compacted,
) -> ChainPosition | None:
    """Count a chain's sealed, read segments whose jobs are all terminal, from their seals.

    Returns where the first other segment starts (``None``: none to read).
    """
    for index_ in indices:
        seg = (writer, index_)
        if compacted.is_compacted(seg):
            continue
        count = sealed_data_count(journal, writer, index_) if index_ < pos.segment else None
        if count is None or len(index.terminal.get(seg, {})) < count:
            header = peek_header(os.path.join(journal, segment_name(writer, index_)))
            return None if header is None else ChainPosition(index_, FILE_HEADER_SIZE, header.first_seq)
        tracker.segments[seg] = Segment(count)
    return None


def count_into(
    tracker: PendingTracker,
    journal: str,
    positions: Mapping[str, ChainPosition],
    index: LedgerIndex,
    compacted: Compacted,
    *,
    every: int = 500,
) -> Iterator[None]:
    """Count into ``tracker`` what a forwarder at ``positions`` has read; yield every ``every`` records.

    A slice ends only at a yield: 2,000 records held the first step for 0.56 s past its 20 ms
    budget on a busy machine; 500 are a quarter of that.

    Reads only segments that may hold a pending job: a sealed segment read to its end whose
    jobs are all terminal is counted from its seal. A job that turns terminal meanwhile is
    told with :meth:`PendingTracker.done` (ignored if its record was not read yet: it reads as
    terminal). A terminal job's queue is read too (its JSON): its rows can go once its block is
    settled, where ``None`` would keep them.
    """
    read = 0
    chains = list_chains(journal)
    for writer, indices in chains.items():
        pos = positions.get(writer)
        if pos is None:
            continue  # nothing of it read yet
        start = _count_dead(tracker, journal, writer, indices, pos, index, compacted)
        if start is None:
            continue
        # This chain only, up to the position: every other one starts past its end.
        since = {w: ChainPosition(ix[-1] + 1, FILE_HEADER_SIZE, 0) for w, ix in chains.items()}
        since[writer] = start
        for record in JournalReader(journal).records(since):
            if not record.consumed_by(positions):
                break
            if record.rtype != RecordType.DATA:
                continue
            loc = (record.writer_id, record.segment_index, record.offset)
            tracker.saw(loc, job_fields(record.payload), finished=index.is_terminal(loc))
            read += 1
            if read % every == 0:
                yield


class DeferredCount:
    """A restarted forwarder's count: what it reads from now at once, what it read before later.

    :attr:`live` counts the records read since the start; the records read before it (up to the
    start's positions) are counted by :meth:`advance`, a slice at a time after the first push,
    and joined in front of them once all are. Outcomes meanwhile are told to both.
    """

    def __init__(self) -> None:
        self.live = PendingTracker()
        self._before: PendingTracker | None = None
        self._fill: Iterator[None] | None = None
        #: Outcomes told before the saved count was read (applied to it once it is).
        self._early: list[Loc] | None = None
        #: Whether :meth:`start` ran (before it, an empty count is "ready" but counts nothing).
        self.started = False
        #: Whether telling it an outcome raised (:meth:`done_logged`: logged once).
        self._failed = False

    def start(
        self,
        journal: str,
        positions: Mapping[str, ChainPosition],
        index: LedgerIndex,
        compacted: Compacted,
        *,
        saved: Callable[[], PendingTracker | None] | None = None,
    ) -> None:
        """Count anew: nothing yet, the records before ``positions`` to count by :meth:`advance`.

        ``saved``: reads the count of exactly those records a clean stop saved (``None`` if there
        is none that fits): the first :meth:`advance` takes it rather than counting.
        """
        self.started = True
        self.live = PendingTracker(journal)
        self._before = PendingTracker(journal)
        fill = count_into(self._before, journal, dict(positions), index, compacted)
        self._fill = fill if saved is None else self._saved_or(saved, fill)
        self._early = None if saved is None else []  # from now: outcomes before the read

    def _saved_or(self, saved: Callable[[], PendingTracker | None], fill: Iterator[None]) -> Iterator[None]:
        """Take the saved count (one slice), with the outcomes told since the start; else count."""
        tracker = saved()
        early, self._early = self._early or [], None
        if tracker is None:
            yield from fill
            return
        for loc in early:
            tracker.done(loc)
        self._before = tracker

    @property
    def ready(self) -> bool:
        """Whether :attr:`live` counts every record read, before this start and since."""
        return self._before is None

    def done(self, loc: Loc) -> None:
        """The job at ``loc`` is terminal now (a record not counted yet will read as terminal)."""
        self.live.done(loc)
        if self._before is not None:
            self._before.done(loc)
        if self._early is not None:
            self._early.append(loc)

    def done_logged(self, loc: Loc) -> None:
        """:meth:`done`, whose error fails nothing: logged once, the count made inexact.

        The forwarder tells it a durable outcome; what follows (the pushed list) must still run.
        The count stays too high, inexact (never saved for the next start, which counts anew).
        """
        try:
            self.done(loc)
        except Exception:
            if not self._failed:  # once: a bug would repeat for each outcome
                log.exception("pending count: an outcome not counted: the count is inexact")
            self._failed = self.live.inexact = True

    def advance(self, budget_s: float) -> bool:
        """Count for about ``budget_s``; whether this finished the count (joined to :attr:`live`)."""
        if self._fill is None or self._before is None:
            return False
        deadline = time.monotonic() + budget_s
        for _ in self._fill:
            if time.monotonic() >= deadline:
                return False
        self.live.take_older(self._before)
        self._before = self._fill = None
        return True
