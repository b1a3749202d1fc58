"""The jobs the forwarder has read and that are not terminal: how many per queue, the oldest.

:class:`PendingTracker` is what :mod:`hybridq.lookup.stats` snapshots for ``hybridq.stats``: fed
the records as the forwarder reads them and the locations that become terminal, about 20 bytes
per record of the live (not compacted) journal. :class:`DeferredCount` lets a restarted
forwarder push before it has counted what it had read before (issue 29: a JSON parse of every
record of the live journal stood before the first push).

This module must not import redis or rq.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import struct
import time
from array import array
from collections.abc import Callable, Iterator, Mapping

from hybridq.envelope.model import Envelope
from hybridq.journal import ChainPosition, JournalReader, Record, RecordType
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.format import FILE_HEADER_SIZE, segment_name
from hybridq.journal.reader import list_chains, peek_header
from hybridq.journal.records import Loc
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.index import LedgerIndex

__all__ = ["DeferredCount", "PendingTracker", "job_fields"]

#: Jobs per block of the oldest-pending minimum (a job ending rescans at most its block).
_BLOCK = 512
_DONE = math.inf

Seg = tuple[str, int]

_LEN = struct.Struct("<I")


def job_fields(payload: bytes) -> tuple[str, float] | None:
    """A record's queue and creation time, as ``status`` reads them; ``None`` if it is not a job."""
    try:
        body = json.loads(payload)
        return str(body["queue"]), float(body["created_at"])
    except (ValueError, KeyError, TypeError, OverflowError):
        return None


class _Segment:
    """What the forwarder read of one journal segment: every record's offset, its job if pending.

    About 20 bytes per record. A segment counted from its seal (every job in it terminal) holds
    only that count.
    """

    __slots__ = ("counted", "created", "mins", "offsets", "queues")

    def __init__(self, counted: int = 0) -> None:
        self.counted = counted
        self.offsets = array("q")
        #: Creation times of pending jobs; ``inf`` for a record that is not (or no longer) one.
        self.created = array("d")
        self.queues = array("I")
        #: The least creation time per block of ``_BLOCK`` records.
        self.mins: list[float] = []

    @property
    def seen(self) -> int:
        return self.counted + len(self.offsets)


class PendingTracker:
    """Jobs the forwarder has read and that are not terminal: how many per queue, the oldest.

    Fed the records as the forwarder reads them (:meth:`saw`) and the locations that become
    terminal (:meth:`done`). Memory: about 20 bytes per record of the live (not compacted) journal.
    """

    def __init__(self) -> None:
        self.segments: dict[Seg, _Segment] = {}
        self.pending: dict[str, int] = {}
        self._names: list[str] = []
        self._ids: dict[str, int] = {}
        #: Blocks whose least creation time became terminal: (writer, segment, block).
        self._dirty: set[tuple[str, int, int]] = set()

    def saw(self, loc: Loc, job: tuple[str, float] | None) -> None:
        """Count the record at ``loc``; ``job``: its queue and creation time if it is pending.

        A record read again (after a step was retried) is counted once.
        """
        seg = self.segments.get((loc[0], loc[1]))
        if seg is None:
            seg = self.segments[(loc[0], loc[1])] = _Segment()
        if seg.offsets and loc[2] <= seg.offsets[-1]:
            return
        queue, created = job if job is not None else ("", _DONE)
        qid = self._qid(queue)
        if len(seg.offsets) % _BLOCK == 0:
            seg.mins.append(created)
        elif created < seg.mins[-1]:
            seg.mins[-1] = created
        seg.offsets.append(loc[2])
        seg.created.append(created)
        seg.queues.append(qid)
        if job is not None:
            self.pending[queue] = self.pending.get(queue, 0) + 1

    def _qid(self, queue: str) -> int:
        qid = self._ids.get(queue)
        if qid is None:
            qid = self._ids[queue] = len(self._names)
            self._names.append(queue)
        return qid

    def take_older(self, older: PendingTracker) -> None:
        """Put ``older``'s records in front of this tracker's (all of them before its own, per segment).

        A restarted forwarder counts what it reads from the start, and what it had read before
        in the background (:meth:`fill`): the two are joined once that is done.
        """
        for seg, old in older.segments.items():
            old.queues = array("I", (self._qid(older._names[q]) for q in old.queues))
            mine = self.segments.get(seg)
            if mine is None:
                self.segments[seg] = old
                continue
            mine.counted += old.counted
            mine.offsets = old.offsets + mine.offsets
            mine.created = old.created + mine.created
            mine.queues = old.queues + mine.queues
            mine.mins = [min(mine.created[i : i + _BLOCK]) for i in range(0, len(mine.created), _BLOCK)]
        for queue, n in older.pending.items():
            self.pending[queue] = self.pending.get(queue, 0) + n

    def to_bytes(self) -> bytes:
        """The count as bytes (:meth:`from_bytes`): a JSON head, then each segment's columns."""
        segments = list(self.segments.items())
        head = {
            "names": self._names,
            "pending": self.pending,
            "segments": [[w, i, s.counted, len(s.offsets)] for (w, i), s in segments],
        }
        raw = json.dumps(head).encode()
        body = [_LEN.pack(len(raw)), raw]
        for _, seg in segments:
            body += [seg.offsets.tobytes(), seg.created.tobytes(), seg.queues.tobytes()]
        return b"".join(body)

    @classmethod
    def from_bytes(cls, payload: bytes) -> PendingTracker:
        """Read :meth:`to_bytes`; raises ``ValueError`` (or ``KeyError``...) if it is not whole."""
        (n,) = _LEN.unpack_from(payload)
        head = json.loads(payload[_LEN.size : _LEN.size + n])
        tracker = cls()
        tracker._names = [str(name) for name in head["names"]]
        tracker._ids = {name: i for i, name in enumerate(tracker._names)}
        tracker.pending = {str(q): int(c) for q, c in head["pending"].items()}
        at = _LEN.size + n
        for writer, index, counted, count in head["segments"]:
            seg = _Segment(int(counted))
            for column in (seg.offsets, seg.created, seg.queues):
                size = int(count) * column.itemsize
                column.frombytes(payload[at : at + size])
                at += size
                if len(column) != count:
                    raise ValueError("cut short")
            seg.mins = [min(seg.created[i : i + _BLOCK]) for i in range(0, len(seg.created), _BLOCK)]
            tracker.segments[(str(writer), int(index))] = seg
        if at != len(payload):
            raise ValueError("trailing bytes")
        return tracker

    def saw_record(self, record: Record, env: Envelope | None, index: LedgerIndex) -> None:
        """:meth:`saw` for a record the forwarder read (``env``: the job in it, when it is one)."""
        if record.rtype != RecordType.DATA:
            return  # not counted by status either
        loc = (record.writer_id, record.segment_index, record.offset)
        if env is not None:
            self.saw(loc, (env.queue, env.created_at))
        elif index.is_terminal(loc):
            self.saw(loc, None)
        else:  # a duplicate waiting for its key's owner (read again after a restart)
            self.saw(loc, job_fields(record.payload))

    def done(self, loc: Loc) -> None:
        """The job at ``loc`` is terminal now (idempotent; unknown locations are ignored)."""
        seg = self.segments.get((loc[0], loc[1]))
        if seg is None:
            return
        i = bisect.bisect_left(seg.offsets, loc[2])
        if i == len(seg.offsets) or seg.offsets[i] != loc[2] or seg.created[i] == _DONE:
            return
        created = seg.created[i]
        seg.created[i] = _DONE
        queue = self._names[seg.queues[i]]
        left = self.pending[queue] - 1
        if left:
            self.pending[queue] = left
        else:
            del self.pending[queue]
        if seg.mins[i // _BLOCK] == created:
            self._dirty.add((loc[0], loc[1], i // _BLOCK))  # its block's least: found again when asked

    def rewind(self, positions: Mapping[str, ChainPosition]) -> None:
        """Forget the records after ``positions`` (read by a step that failed: read again next)."""
        for (writer, index_), seg in list(self.segments.items()):
            pos = positions.get(writer)
            if pos is not None and index_ < pos.segment:
                continue
            keep = 0 if pos is None or index_ > pos.segment else bisect.bisect_left(seg.offsets, pos.offset)
            for offset in seg.offsets[keep:]:
                self.done((writer, index_, offset))
            del seg.offsets[keep:], seg.created[keep:], seg.queues[keep:]
            del seg.mins[(keep + _BLOCK - 1) // _BLOCK :]
            if keep % _BLOCK:
                seg.mins[-1] = min(seg.created[(keep // _BLOCK) * _BLOCK : keep])

    def forget(self, compacted: Compacted, positions: Mapping[str, ChainPosition]) -> None:
        """Drop the compacted segments (every job in them was terminal), and chains gone whole."""
        for seg in [s for s in self.segments if compacted.is_compacted(s) or s[0] not in positions]:
            del self.segments[seg]

    @property
    def consumed(self) -> int:
        """Records read, in the segments not compacted."""
        return sum(seg.seen for seg in self.segments.values())

    def oldest(self) -> float | None:
        """The creation time of the oldest pending job read, ``None`` when there is none."""
        for writer, index_, block in self._dirty:
            seg = self.segments.get((writer, index_))
            if seg is not None and block < len(seg.mins):
                seg.mins[block] = min(seg.created[block * _BLOCK : (block + 1) * _BLOCK])
        self._dirty.clear()
        least = min((min(seg.mins) for seg in self.segments.values() if seg.mins), default=_DONE)
        return None if least == _DONE else least

    def _count_dead(
        self,
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
            self.segments[seg] = _Segment(count)
        return None

    def fill(
        self,
        journal: str,
        positions: Mapping[str, ChainPosition],
        index: LedgerIndex,
        compacted: Compacted,
        *,
        every: int = 500,
    ) -> Iterator[None]:
        """Count what a forwarder standing at ``positions`` has read; yield every ``every`` records.

        A slice ends only at a yield: 2,000 records held the first step for 0.56 s past its 20 ms
        budget on a busy machine; 500 are a quarter of that.

        Reads only segments that may hold a pending job: a sealed segment read to its end whose
        jobs are all terminal is counted from its seal. A job that turns terminal meanwhile is
        told with :meth:`done` (ignored if its record was not read yet: it reads as terminal).
        """
        read = 0
        chains = list_chains(journal)
        for writer, indices in chains.items():
            pos = positions.get(writer)
            if pos is None:
                continue  # nothing of it read yet
            start = self._count_dead(journal, writer, indices, pos, index, compacted)
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
                self.saw(loc, None if index.is_terminal(loc) else job_fields(record.payload))
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
        self.live = PendingTracker()
        self._before = PendingTracker()
        fill = self._before.fill(journal, dict(positions), index, compacted)
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
