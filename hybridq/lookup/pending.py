"""The jobs the forwarder has read and that are not terminal: how many per queue, the oldest.

:class:`PendingTracker` is what :mod:`hybridq.lookup.stats` snapshots for ``hybridq.stats``: fed
the records as the forwarder reads them and the locations that become terminal. It holds no row
per waiting job past :data:`ROWS_KEPT` (:mod:`hybridq.lookup.pending_blocks`: about 0.04 bytes
per record of a block none of whose jobs finished, 20 bytes per record of a block held as rows),
so the forwarder's memory does not grow with a backlog nobody runs. Per-queue counts and the
oldest creation time are exact, unless a block could not be read back (:attr:`inexact`: too
high until the next start counts anew). :class:`~hybridq.lookup.pending_file.DeferredCount` lets a
restarted forwarder push before it has counted what it had read before (issue 29: a JSON parse
of every record of the live journal stood before the first push).

This module must not import redis or rq.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import struct
from array import array
from collections.abc import Iterator, Mapping

from hybridq.envelope.model import Envelope
from hybridq.errors import JournalCorruption
from hybridq.journal import ChainPosition, JournalReader, Record, RecordType
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.format import FILE_HEADER_SIZE, segment_name
from hybridq.journal.reader import list_chains, peek_header
from hybridq.journal.records import Loc
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.lookup.pending_blocks import DEAD, DONE, Rows, Segment, job_fields, read_rows

__all__ = ["PendingTracker", "job_fields"]

log = logging.getLogger("hybridq.forwarder")

Seg = tuple[str, int]

#: Rows (20 bytes each) the tracker holds before it keeps new blocks of waiting jobs as summaries
#: (2 MB): a burn-down's jobs finish while their blocks are still rows, so no block is read back
#: for them; only a backlog past this many jobs costs a read back of its blocks as they drain.
ROWS_KEPT = 100_000

_LEN = struct.Struct("<I")


class PendingTracker:
    """Jobs the forwarder has read and that are not terminal: how many per queue, the oldest.

    Fed the records as the forwarder reads them (:meth:`saw`) and the locations that become
    terminal (:meth:`done`). ``journal``: where a block's records are read back from when one of
    its jobs finishes (``None``: every record is held as a row, 20 bytes each).
    """

    def __init__(self, journal: str | None = None) -> None:
        self.journal = journal
        self.segments: dict[Seg, Segment] = {}
        self.pending: dict[str, int] = {}
        self._names: list[str] = []
        self._ids: dict[str, int] = {}
        #: Blocks whose least creation time became terminal: (writer, segment, block).
        self._dirty: set[tuple[str, int, int]] = set()
        #: About how many rows the blocks held as rows have (what :data:`ROWS_KEPT` bounds).
        self.held = 0
        #: Whether a block could not be read back from the journal: the counts and ``oldest`` may
        #: stay too high (too old) until the next start counts anew (never saved for it).
        self.inexact = False

    def saw(self, loc: Loc, job: tuple[str, float] | None) -> None:
        """Count the record at ``loc``; ``job``: its queue and creation time if it is pending.

        A record read again (after a step was retried) is counted once.
        """
        seg = self.segments.get((loc[0], loc[1]))
        if seg is None:
            seg = self.segments[(loc[0], loc[1])] = Segment()
        if loc[2] <= seg.last:
            return
        queue, created = job if job is not None else ("", DONE)
        summary = job is not None and self.journal is not None and self.held >= ROWS_KEPT
        self.held += seg.add(loc[2], created, self._qid(queue), summary=summary)
        if job is not None:
            self.pending[queue] = self.pending.get(queue, 0) + 1

    def _recount(self) -> None:
        """Count :attr:`held` anew (after a change of many blocks at once)."""
        self.held = sum(len(rows.offsets) for seg in self.segments.values() for rows in seg.rows.values())

    def _qid(self, queue: str) -> int:
        qid = self._ids.get(queue)
        if qid is None:
            qid = self._ids[queue] = len(self._names)
            self._names.append(queue)
        return qid

    def _rows(self, seg_key: Seg, seg: Segment, b: int, *, strict: bool = False) -> Rows:
        """Block ``b``'s rows, read back from the journal if it is a summary (every job pending).

        ``strict``: raise ``OSError`` or :class:`JournalCorruption` if it cannot be read back.
        """
        rows = seg.rows.get(b)
        if rows is not None:
            return rows
        try:
            found = read_rows(self.journal, seg_key, seg.starts[b], seg.end_of(b), seg.counts[b])
        except (OSError, JournalCorruption) as exc:
            if strict:
                raise
            # A stats cache: its jobs stay counted (and its least creation time stays) as they
            # were, too high, until the next start counts anew; inexact keeps a clean stop from
            # saving this count for that start (lookup/pending_file.py).
            log.warning(
                "pending count: cannot read %s block %d back (%s): its jobs stay counted", seg_key, b, exc
            )
            self.inexact = True
            seg.rows[b] = DEAD
            return DEAD
        rows = seg.rows[b] = Rows()
        self.held += len(found)
        for offset, payload in found:
            queue, created = job_fields(payload) or ("", DONE)  # was a pending job when read
            rows.add(offset, created, self._qid(queue))
        return rows

    def take_older(self, older: PendingTracker) -> None:
        """Put ``older``'s records in front of this tracker's (all of them before its own, per segment).

        A restarted forwarder counts what it reads from the start, and what it had read before
        in the background (:meth:`fill`): the two are joined once that is done.
        """
        for key, old in older.segments.items():
            for rows in old.rows.values():
                if rows is not DEAD:
                    rows.queues = array("I", (self._qid(older._names[q]) for q in rows.queues))
            mine = self.segments.get(key)
            if mine is None:
                self.segments[key] = old
                continue
            shift = len(old.starts)
            old.counted += mine.counted
            old.starts += mine.starts
            old.counts += mine.counts
            old.mins += mine.mins
            old.rows.update({b + shift: rows for b, rows in mine.rows.items()})
            old.last = max(old.last, mine.last)
            self.segments[key] = old
        for seg in self.segments.values():  # block numbers moved: each least found again
            for b in seg.rows:
                seg.recompute(b)
        self._dirty.clear()
        self._recount()
        self.inexact |= older.inexact
        for queue, n in older.pending.items():
            self.pending[queue] = self.pending.get(queue, 0) + n

    def to_bytes(self) -> bytes:
        """The count as bytes (:meth:`from_bytes`): a JSON head, then each segment's columns."""
        segments = list(self.segments.items())
        head = {
            "names": self._names,
            "pending": self.pending,
            "segments": [[w, i, *s.head()] for (w, i), s in segments],
        }
        raw = json.dumps(head).encode()
        return b"".join([_LEN.pack(len(raw)), raw, *(c for _, s in segments for c in s.columns())])

    @classmethod
    def from_bytes(cls, payload: bytes, journal: str | None = None) -> PendingTracker:
        """Read :meth:`to_bytes`; raises ``ValueError`` (or ``KeyError``...) if it is not whole."""
        (n,) = _LEN.unpack_from(payload)
        head = json.loads(payload[_LEN.size : _LEN.size + n])
        tracker = cls(journal)
        tracker._names = [str(name) for name in head["names"]]
        tracker._ids = {name: i for i, name in enumerate(tracker._names)}
        tracker.pending = {str(q): int(c) for q, c in head["pending"].items()}
        view = memoryview(payload)[_LEN.size + n :]
        for writer, index, *seg_head in head["segments"]:
            seg, view = Segment.read(seg_head, view)
            tracker.segments[(str(writer), int(index))] = seg
        if len(view):
            raise ValueError("trailing bytes")
        tracker._recount()
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
        key = (loc[0], loc[1])
        seg = self.segments.get(key)
        if seg is None:
            return
        b = seg.block_of(loc[2])
        if b < 0:
            return
        rows = self._rows(key, seg, b)
        i = bisect.bisect_left(rows.offsets, loc[2])
        if i == len(rows.offsets) or rows.offsets[i] != loc[2] or rows.created[i] == DONE:
            return
        created = rows.created[i]
        rows.created[i] = DONE
        rows.live -= 1
        queue = self._names[rows.queues[i]]
        left = self.pending[queue] - 1
        if left:
            self.pending[queue] = left
        else:
            del self.pending[queue]
        if not rows.live and self.journal is not None:
            seg.rows[b], seg.mins[b] = DEAD, DONE  # none pending: its rows go (read back if need be)
            self.held -= len(rows.offsets)
        elif seg.mins[b] == created:
            self._dirty.add((loc[0], loc[1], b))  # its block's least: found again when asked

    def rewind(self, positions: Mapping[str, ChainPosition]) -> None:
        """Forget the records after ``positions`` (read by a step that failed: read again next).

        Never raises: it runs in the handler of the step's own error and at a stop. A segment
        whose blocks to cut cannot be read back from the journal is left whole (logged).
        """
        for key, seg in list(self.segments.items()):
            pos = positions.get(key[0])
            if pos is not None and key[1] < pos.segment:
                continue
            cut = 0 if pos is None or key[1] > pos.segment else pos.offset
            if cut > seg.last:
                continue
            try:
                self._cut(key, seg, cut)
            except (OSError, JournalCorruption) as exc:
                # Left whole, its records stay counted once: read again, saw() skips each (its
                # offset is at or before seg.last), so the count stays right if they read the
                # same. It holds records past the positions, though (a saved count must not).
                self.inexact = True
                log.warning("pending count: cannot cut %s at %d (%s): left whole", key, cut, exc)
        self._recount()

    def _cut(self, key: Seg, seg: Segment, cut: int) -> None:
        """Drop segment ``key``'s records from offset ``cut`` on; reads back first, then changes it."""
        first = max(0, seg.block_of(cut))
        offsets = self._offsets(key, seg, first) if seg.starts[first] < cut else array("q")
        keep = bisect.bisect_left(offsets, cut)
        cuts = [self._rows(key, seg, b, strict=True) for b in range(first, len(seg.starts))]
        for b, rows in enumerate(cuts, first):
            for offset in rows.offsets[keep if b == first else 0 :]:
                self.done((key[0], key[1], offset))
        if keep:
            rows = seg.rows[first]
            if rows is not DEAD:
                del rows.offsets[keep:], rows.created[keep:], rows.queues[keep:]
                seg.recompute(first)
            seg.counts[first] = keep
        whole = first + (keep > 0)
        for b in range(whole, len(seg.starts)):
            seg.rows.pop(b, None)
        del seg.starts[whole:], seg.counts[whole:], seg.mins[whole:]
        seg.last = cut - 1 if seg.starts else -1  # no record between the last kept and the cut

    def _offsets(self, key: Seg, seg: Segment, b: int) -> array[int]:
        """Block ``b``'s records' offsets (read back when it dropped its rows)."""
        rows = self._rows(key, seg, b, strict=True)
        if rows is not DEAD:
            return rows.offsets
        found = read_rows(self.journal, key, seg.starts[b], seg.end_of(b), seg.counts[b])
        return array("q", (offset for offset, _ in found))

    def forget(self, compacted: Compacted, positions: Mapping[str, ChainPosition]) -> None:
        """Drop the compacted segments (every job in them was terminal), and chains gone whole."""
        for seg in [s for s in self.segments if compacted.is_compacted(s) or s[0] not in positions]:
            del self.segments[seg]
        self._recount()

    @property
    def consumed(self) -> int:
        """Records read, in the segments not compacted."""
        return sum(seg.seen for seg in self.segments.values())

    def oldest(self) -> float | None:
        """The creation time of the oldest pending job read, ``None`` when there is none."""
        for writer, index_, block in self._dirty:
            seg = self.segments.get((writer, index_))
            if seg is not None and block < len(seg.mins):
                seg.recompute(block)
        self._dirty.clear()
        least = min((min(seg.mins) for seg in self.segments.values() if seg.mins), default=DONE)
        return None if least == DONE else least

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
            self.segments[seg] = Segment(count)
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
