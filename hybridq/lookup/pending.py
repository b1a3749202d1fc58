"""The jobs the forwarder has read and that are not terminal: how many per queue, the oldest.

:class:`PendingTracker` is what :mod:`hybridq.lookup.stats` snapshots for ``hybridq.stats``: fed
the records as the forwarder reads them and the locations that become terminal. It holds no row
per waiting job past :data:`ROWS_KEPT` (:mod:`hybridq.lookup.pending_blocks`: about 0.04 bytes
per record of a block none of whose jobs finished, 16 bytes per queue of a block whose jobs of
that queue did not finish while others did, 20 bytes per record of a queue draining in a
block and of the last blocks read back), so the forwarder's memory does not grow with a
backlog nobody runs, nor with one queue's waiting jobs while another drained beside them.
Per-queue counts and the oldest creation time are exact, unless a block could not be read back
(:attr:`inexact`: too high until the next start counts anew).
:class:`~hybridq.lookup.pending_file.DeferredCount` lets a restarted forwarder push before it
has counted what it had read before (issue 29: a JSON parse of every record of the live journal
stood before the first push); :func:`~hybridq.lookup.pending_file.count_into` counts.

This module must not import redis or rq.
"""

from __future__ import annotations

import bisect
import json
import logging
import struct
from array import array
from collections.abc import Mapping

from hybridq.envelope.model import Envelope
from hybridq.errors import JournalCorruption
from hybridq.journal import ChainPosition, Record, RecordType
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

#: Read-backs after which a block read back is settled: a queue still draining there by then
#: (finishing jobs since the read-back before last) keeps its rows, read back once, not again.
TAKEN_KEPT = 3

_LEN = struct.Struct("<I")
#: ``RecordType.DATA``, read once: a member read from its Enum class goes through ``EnumType.__getattr__``'s
#: hook on Python 3.11 (about 900 instructions a read, once per job here: docs/benchmarks.md,
#: "The forwarder's writes per job, again").
_DATA = RecordType.DATA


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
        #: The queues with a job finished since the last read-back, and between the two before it.
        self._finishing: set[int] = set()
        self._finished: set[int] = set()
        #: The blocks read back by the last read-backs, oldest first: settled three read-backs on.
        self._taken: list[tuple[Seg, int]] = []
        #: Whether a block could not be read back from the journal: the counts and ``oldest`` may
        #: stay too high (too old) until the next start counts anew (never saved for it).
        self.inexact = False

    def saw(self, loc: Loc, job: tuple[str, float] | None, *, finished: bool = False) -> None:
        """Count the record at ``loc``; ``job``: its queue and creation time if it is a job.

        ``finished``: the job is terminal already. A terminal job's queue lets its rows go once
        its block is settled; ``None`` for it (its queue unknown) keeps its row while its block
        holds a pending job. A record read again (after a step was retried) is counted once.
        """
        seg = self.segments.get((loc[0], loc[1]))
        if seg is None:
            seg = self.segments[(loc[0], loc[1])] = Segment()
        if loc[2] <= seg.last:
            return
        queue, created = job if job is not None else ("", DONE)
        if finished:
            job, created = None, DONE
        summary = job is not None and self.journal is not None and self.held >= ROWS_KEPT
        qid = self._ids.get(queue)
        added = seg.add(loc[2], created, self._qid(queue) if qid is None else qid, summary=summary)
        self.held += added & 1
        if added > 1:
            self._settle(seg, len(seg.starts) - 2)
        if job is not None:
            self.pending[queue] = self.pending.get(queue, 0) + 1

    def _settle(self, seg: Segment, b: int) -> None:
        """Block ``b`` is closed (the next one started): drop its rows where sums say the same."""
        rows = seg.rows.get(b)
        if rows is None or rows is DEAD or self.journal is None:
            return
        if not rows.live:
            seg.rows[b] = DEAD  # terminal records only (read after a restart)
            self.held -= len(rows.offsets)
        elif self.held >= ROWS_KEPT and b not in seg.sums:  # else only a drain's rows: they stay
            seg.settle(b, self._qid(""))
            self.held += len(seg.rows.get(b, DEAD).offsets) - len(rows.offsets)

    def _recount(self) -> None:
        """Count :attr:`held` anew (after a change of many blocks at once)."""
        self.held = sum(len(rows.offsets) for seg in self.segments.values() for rows in seg.rows.values())

    def _qid(self, queue: str) -> int:
        qid = self._ids.get(queue)
        if qid is None:
            qid = self._ids[queue] = len(self._names)
            self._names.append(queue)
        return qid

    def _full(self, key: Seg, seg: Segment, b: int) -> Rows:
        """Block ``b``'s every record as a row (read back unless its rows hold them all).

        Raises ``OSError`` or :class:`JournalCorruption` if it cannot be read back.
        """
        rows = seg.rows.get(b)
        if rows is not None and rows is not DEAD and len(rows.offsets) == seg.counts[b]:
            return rows
        found = read_rows(self.journal, key, seg.starts[b], seg.end_of(b), seg.counts[b])
        return seg.complete(b, found, self._qid)

    def _read_back(self, key: Seg, seg: Segment, b: int, offset: int) -> Rows | None:
        """Block ``b``'s rows with the queue of the pending job at ``offset`` in them (``None``: none is)."""
        self._taken.append((key, b))  # settled before this read-back changes any rows: b may be it
        if len(self._taken) > TAKEN_KEPT:
            self._resettle(*self._taken.pop(0))
        try:
            full = self._full(key, seg, b)
        except (OSError, JournalCorruption) as exc:
            # A stats cache: its jobs stay counted (and its least creation time stays) as they
            # were, too high, until the next start counts anew; inexact keeps a clean stop from
            # saving this count for that start (lookup/pending_file.py).
            log.warning(
                "pending count: cannot read %s block %d back (%s): its jobs stay counted", key, b, exc
            )
            self.inexact = True
            seg.stuck.add(b)
            seg.reshut()
            return None
        i = bisect.bisect_left(full.offsets, offset)
        if i == len(full.offsets) or full.offsets[i] != offset or full.created[i] == DONE:
            return None  # not a pending job (a location told twice, or of a queue dead here)
        # The queues that finished jobs since the read-back before last are draining: taken too, a
        # block is read back once, not once per queue (two queues drained together: 105,000
        # instructions a job, 65,000). One that stopped (paused) goes back to its sum in each
        # block taken along when that block is settled (:meth:`_resettle`).
        taken = {full.queues[i], *self._finishing, *self._finished}
        self._finished, self._finishing = self._finishing, set()
        before = len(seg.rows.get(b, DEAD).offsets)
        rows = seg.take(b, full, taken, self._qid(""))
        self.held += len(rows.offsets) - before
        return rows

    def _resettle(self, key: Seg, b: int) -> None:
        """Settle block ``b`` read back :data:`TAKEN_KEPT` read-backs ago (no I/O).

        A queue taken along there while it drained slowly beside a fast one (paused and resumed,
        a limit, a lower priority) is all pending there once it stopped: back to its sum; the
        fast one all finished there: its rows go. Else each resume cost 2 blocks of rows more,
        without bound (200 cycles of 500 and 5 jobs: 198,464 rows, a row per record).
        """
        if self.held < ROWS_KEPT:
            return  # rows within those kept (as _settle): a queue lagging behind reads nothing again
        seg = self.segments.get(key)
        rows = None if seg is None else seg.rows.get(b)
        if seg is None or rows is None or rows is DEAD or not rows.live or b in seg.stuck:
            return
        if b == len(seg.starts) - 1 and b != seg.shut:
            return  # still takes records: settled when the next block starts
        seg.settle(b, self._qid(""))
        self.held += len(seg.rows.get(b, DEAD).offsets) - len(rows.offsets)

    def take_older(self, older: PendingTracker) -> None:
        """Put ``older``'s records in front of this tracker's (all of them before its own, per segment).

        A restarted forwarder counts what it reads from the start, and what it had read before
        in the background (:func:`~hybridq.lookup.pending_file.count_into`): the two are joined
        once that is done.
        """
        for key, old in older.segments.items():
            for rows in old.rows.values():
                if rows is not DEAD:
                    rows.queues = array("I", (self._qid(older._names[q]) for q in rows.queues))
            for b in list(old.sums):
                old.put_sums(b, {self._qid(older._names[q]): s for q, s in old.sums_of(b).items()})
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
            old.sums.update({b + shift: sums for b, sums in mine.sums.items()})
            old.stuck.update(b + shift for b in mine.stuck)
            old.last = max(old.last, mine.last)
            old.reshut()
            self.segments[key] = old
        for seg in self.segments.values():  # block numbers moved: each least found again
            for b in {*seg.rows, *seg.sums}:
                seg.recompute(b)
        self._dirty.clear()
        self._taken.clear()  # block numbers moved
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
        for seg in tracker.segments.values():  # a queue id names a queue (the file is checksummed)
            ids = [
                *(q for rows in seg.rows.values() for q in rows.queues),
                *(q for b in seg.sums for q in seg.sums_of(b)),
            ]
            if ids and max(ids) >= len(tracker._names):
                raise ValueError("no such queue")
        tracker._recount()
        return tracker

    def saw_record(self, record: Record, env: Envelope | None, index: LedgerIndex) -> None:
        """:meth:`saw` for a record the forwarder read (``env``: the job in it, when it is one)."""
        if record.rtype != _DATA:
            return  # not counted by status either
        loc = (record.writer_id, record.segment_index, record.offset)
        if env is not None:
            self.saw(loc, (env.queue, env.created_at))
        elif index.is_terminal(loc):
            self.saw(loc, job_fields(record.payload), finished=True)
        else:  # a duplicate waiting for its key's owner (read again after a restart)
            self.saw(loc, job_fields(record.payload))

    def done(self, loc: Loc) -> None:
        """The job at ``loc`` is terminal now (idempotent; unknown locations are ignored)."""
        key = (loc[0], loc[1])
        seg = self.segments.get(key)
        if seg is None:
            return
        starts, offset = seg.starts, loc[2]
        # Segment.block_of, written out (once per finished job): most finish in the last block.
        if offset > seg.last or not starts or offset < starts[0]:
            return
        b = len(starts) - 1
        if offset < starts[b]:
            b = bisect.bisect_right(starts, offset) - 1
        rows = seg.rows.get(b)
        if rows is None:
            i = -1
        else:
            i = rows.next  # (checked: any row may finish next)
            if i >= len(rows.offsets) or rows.offsets[i] != offset:
                i = bisect.bisect_left(rows.offsets, offset)
        if rows is None or i == len(rows.offsets) or rows.offsets[i] != offset:
            # Not a row: pending only if its queue is held as a sum (or the block is a summary).
            if b in seg.stuck or (rows is not None and b not in seg.sums):
                return
            rows = self._read_back(key, seg, b, loc[2])
            if rows is None:
                return
            i = bisect.bisect_left(rows.offsets, loc[2])
        created = rows.created[i]
        if created == DONE:
            return
        rows.created[i] = DONE
        rows.live -= 1
        rows.next = i + 1
        qid = rows.queues[i]
        self._finishing.add(qid)
        queue = self._names[qid]
        left = self.pending[queue] - 1
        if left:
            self.pending[queue] = left
        else:
            del self.pending[queue]
        if not rows.live and self.journal is not None:
            self._emptied(seg, b, rows)
            if b in seg.sums:
                self._dirty.add((loc[0], loc[1], b))  # its sums' least: found again when asked
        elif seg.mins[b] == created:
            self._dirty.add((loc[0], loc[1], b))  # its block's least: found again when asked

    def _emptied(self, seg: Segment, b: int, rows: Rows) -> None:
        """None of block ``b``'s rows is pending: they go (but a record not known to be a job's)."""
        if b not in seg.sums:
            seg.rows[b], seg.mins[b] = DEAD, DONE  # none pending: read back if need be
            self.held -= len(rows.offsets)
            return
        unknown = self._qid("")
        kept = Rows(row for row in rows if row[2] == unknown)
        if kept.offsets:
            seg.rows[b] = kept
        else:
            del seg.rows[b]
        self.held -= len(rows.offsets) - len(kept.offsets)

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
        fulls = [self._full(key, seg, b) for b in range(first, len(seg.starts))]
        for rows in fulls:
            for offset, created, qid in rows:
                if offset >= cut and created != DONE:
                    queue = self._names[qid]
                    self.pending[queue] -= 1
                    if not self.pending[queue]:
                        del self.pending[queue]
        keep = bisect.bisect_left(fulls[0].offsets, cut)
        whole = first + (keep > 0)
        for b in range(first, len(seg.starts)):
            seg.rows.pop(b, None)
            seg.sums.pop(b, None)
            seg.stuck.discard(b)
        if keep:  # the block cut in two: its records before the cut, as rows
            rows = Rows(row for n, row in enumerate(fulls[0]) if n < keep)
            seg.rows[first] = rows if rows.live or self.journal is None else DEAD
            seg.counts[first], seg.mins[first] = keep, min(rows.created)
        del seg.starts[whole:], seg.counts[whole:], seg.mins[whole:]
        seg.last = cut - 1 if seg.starts else -1  # no record between the last kept and the cut
        seg.reshut()

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
