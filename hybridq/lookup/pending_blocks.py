"""One journal segment as :class:`~hybridq.lookup.pending.PendingTracker` holds it: blocks of records.

The tracker must not hold a row per waiting job (issue 29: the forwarder's memory flat with the
backlog). A segment's records are kept in blocks of up to :data:`BLOCK` records and
:data:`BLOCK_BYTES`, each either

* a **summary**: every record of it was a pending job when read and none has finished since.
  Only its first offset, its record count and its least creation time are kept (20 bytes per
  block, about 0.04 bytes per record); or
* **rows**: each record's offset, creation time (``inf`` once terminal) and queue id (20 bytes
  per record), as the tracker kept for every record before.

A block turns from summary into rows when one of its jobs finishes, or when the records read
after a step that failed are dropped: its records are then read back from the journal
(:func:`read_rows`: one read of about :data:`BLOCK_BYTES` plus one record at most; still there
since a segment with a pending job is never compacted). The jobs in it were all pending when
read and none has finished since, so the rows are exactly what reading them as rows would have
given, whatever the ledger says by then. A block whose jobs have all finished drops its rows
(:data:`DEAD`). So what the tracker holds is about 0.04 bytes per waiting job, plus 20 bytes per
record of the blocks of new jobs up to ``ROWS_KEPT`` (below), plus 20 bytes per record of every
block read back or read with terminal records in it while some of its jobs still wait. That has
no cap: a drain's front (about a window's worth), a restart over a partly drained segment, but
also a queue drained while another one in the same segments waits (20 bytes per record of those
blocks).

New blocks are rows while the tracker holds fewer than its ``ROWS_KEPT`` rows (2 MB): a
burn-down's jobs finish before their blocks would ever be read back (about 40,000 instructions
per finished job, mostly the JSON of each record); only the jobs of a backlog past that are
summaries, read back as they drain. A tracker with no journal to read back from keeps every
block as rows.

This module must not import redis or rq.
"""

from __future__ import annotations

import bisect
import json
import math
from array import array
from typing import Any

from hybridq.journal.random_access import SegmentFile

__all__ = ["BLOCK", "BLOCK_BYTES", "DEAD", "Rows", "Segment", "job_fields", "read_rows"]

#: Records per block: a block turned into rows reads at most this many records back.
BLOCK = 512
#: A record at least this far past its block's first starts a new block, so a read-back reads
#: about this much plus one record (512 jobs of 100 KB were one read of 50 MB, 146 MB at its peak).
BLOCK_BYTES = 1 << 20
DONE = math.inf


def job_fields(payload: bytes) -> tuple[str, float] | None:
    """A record's queue and creation time, as ``status`` reads them; ``None`` if it is not a job."""
    try:
        body = json.loads(payload)
        return str(body["queue"]), float(body["created_at"])
    except (ValueError, KeyError, TypeError, OverflowError):
        return None


class Rows:
    """A block's records one by one: offset, creation time (``inf``: not pending), queue id."""

    __slots__ = ("created", "live", "offsets", "queues")

    def __init__(self) -> None:
        self.offsets = array("q")
        self.created = array("d")
        self.queues = array("I")
        #: How many of them are pending.
        self.live = 0

    def add(self, offset: int, created: float, qid: int) -> None:
        """Append a record (``created``: ``inf`` if it is not a pending job)."""
        self.offsets.append(offset)
        self.created.append(created)
        self.queues.append(qid)
        self.live += created != DONE


#: The rows of a block none of whose records is pending any more (shared, never changed).
DEAD = Rows()


class Segment:
    """What the tracker read of one journal segment (see the module's docstring).

    ``counted``: records of a segment counted from its seal (every job in it terminal), held as
    that count only.
    """

    __slots__ = ("counted", "counts", "last", "mins", "rows", "starts")

    def __init__(self, counted: int = 0) -> None:
        self.counted = counted
        #: Per block: its first record's offset, its record count, its least pending creation time.
        self.starts = array("q")
        self.counts = array("I")
        self.mins = array("d")
        #: The blocks held as rows, by block number (:data:`DEAD` once none is pending).
        self.rows: dict[int, Rows] = {}
        #: The last record's offset (-1: none read).
        self.last = -1

    @property
    def seen(self) -> int:
        """Records read of this segment."""
        return self.counted + sum(self.counts)

    def add(self, offset: int, created: float, qid: int, *, summary: bool) -> bool:
        """Append a record; ``summary``: it may go into a summary block (it is a pending job).

        Returns whether it went into a block held as rows.
        """
        b = len(self.starts) - 1
        rows = self.rows.get(b)
        # A summary block holds pending jobs only; a dead one holds no rows (DEAD is shared).
        fits = (
            b >= 0
            and self.counts[b] < BLOCK
            and offset - self.starts[b] < BLOCK_BYTES
            and (rows is not DEAD if rows is not None else summary)
        )
        if not fits:
            b += 1
            self.starts.append(offset)
            self.counts.append(0)
            self.mins.append(DONE)
            if not summary:
                self.rows[b] = Rows()
        self.counts[b] += 1
        rows = self.rows.get(b)
        if rows is not None:
            rows.add(offset, created, qid)
        self.mins[b] = min(self.mins[b], created)
        self.last = offset
        return rows is not None

    def block_of(self, offset: int) -> int:
        """The block whose records' offsets span ``offset`` (-1: before the first, or after the last)."""
        if offset > self.last or not self.starts or offset < self.starts[0]:
            return -1
        return bisect.bisect_right(self.starts, offset) - 1  # in C: once per finished job

    def end_of(self, b: int) -> int:
        """The offset past block ``b``'s last record, or at it (its records are before this, or at it)."""
        return self.starts[b + 1] - 1 if b + 1 < len(self.starts) else self.last

    def recompute(self, b: int) -> None:
        """Block ``b``'s least pending creation time, from its rows.

        Not for a :data:`DEAD` block: either all its jobs finished (its least is ``inf`` already)
        or it could not be read back, and keeps the least it had (too old, not too young).
        """
        rows = self.rows.get(b)
        if rows is not None and rows is not DEAD:
            self.mins[b] = min(rows.created, default=DONE)

    def head(self) -> list[Any]:
        """What :meth:`read` needs besides :meth:`columns`: counted, last, blocks, rows per block."""
        return [
            self.counted,
            self.last,
            len(self.starts),
            [[b, len(r.offsets)] for b, r in self.rows.items()],
        ]

    def columns(self) -> list[bytes]:
        """The blocks' columns, then each held block's rows' (:meth:`read`)."""
        out = [self.starts.tobytes(), self.counts.tobytes(), self.mins.tobytes()]
        for rows in self.rows.values():
            out += [rows.offsets.tobytes(), rows.created.tobytes(), rows.queues.tobytes()]
        return out

    @classmethod
    def read(cls, head: list[Any], view: memoryview) -> tuple[Segment, memoryview]:
        """A segment from :meth:`head` and :meth:`columns` at the start of ``view``, and the rest."""
        counted, last, blocks, held = head
        seg = cls(int(counted))
        seg.last = int(last)

        def column(into: array[Any], count: int) -> None:
            nonlocal view
            size = count * into.itemsize
            into.frombytes(view[:size])
            view = view[size:]
            if len(into) != count:
                raise ValueError("cut short")

        for col in (seg.starts, seg.counts, seg.mins):
            column(col, int(blocks))
        for b, count in held:
            if not 0 <= int(b) < int(blocks):
                raise ValueError("no such block")
            rows = Rows() if count else DEAD
            if count:
                for col in (rows.offsets, rows.created, rows.queues):
                    column(col, int(count))
                rows.live = sum(c != DONE for c in rows.created)
            seg.rows[int(b)] = rows
            seg.recompute(int(b))  # saved before a least that finished was found again
        return seg, view


def read_rows(
    journal: str | None, seg: tuple[str, int], start: int, end: int, count: int
) -> list[tuple[int, bytes]]:
    """The ``count`` data records of segment ``seg`` from ``start`` to ``end`` (both included).

    One read for the whole range (:meth:`SegmentFile.read_data`: a record at a time cost two
    system calls each, about 4 us a finished job over a drain), each record checked. Raises
    :class:`JournalCorruption` or ``OSError`` when they cannot be read, or are not ``count``
    (what the tracker read there).
    """
    if journal is None:
        raise OSError("no journal to read the block from")
    with SegmentFile(journal, *seg) as segment:
        out = segment.read_data(start, end)
    if len(out) != count:
        raise OSError(f"{len(out)} records where {count} were read")
    return out
