"""One journal segment as :class:`~hybridq.lookup.pending.PendingTracker` holds it: blocks of records.

The tracker must not hold a row per waiting job (issue 29: the forwarder's memory flat with the
backlog). A segment's records are kept in blocks of up to :data:`BLOCK` records and
:data:`BLOCK_BYTES`; each block has its first offset, its record count and its least pending
creation time (20 bytes), and its records are held in one of three ways:

* a **summary**: every record of it was a pending job when read and none has finished since.
  Nothing more is kept (about 0.04 bytes per record).
* **rows** for some of its queues, **sums** for the others: each record of a queue with rows is
  held (offset, creation time -- ``inf`` once terminal -- and queue id: 20 bytes); a queue with a
  sum is held as its count and least creation time (16 bytes per queue, in :attr:`Segment.sums`):
  every record of it in the block was pending when read and none has finished since. A record in
  neither is not pending (its queue's jobs there all finished: the queue is *dead* there).
* :data:`DEAD`: none of its records is pending.

The first outcome of a queue held as a sum (or in a summary) reads the block back from the
journal (:func:`read_rows`: one read of about :data:`BLOCK_BYTES` plus one record at most; still
there since a segment with a pending job is never compacted; its finished records may have been
punched, ``hybridq.journal.holes``: those are not read back, and are not pending), and turns
that queue's records into rows (:meth:`Segment.take`), with those of the queues that finished
jobs since the read-back before last (two queues drained together read each block once, not
twice); every other queue stays a sum. Those records were all pending when read and none
finished since, so the rows are exactly what reading them as rows would have given, whatever the
ledger says by then. Once no row of a block is pending they all go (the block keeps its sums, or
is :data:`DEAD`), and a block read back is settled (:meth:`Segment.settle`, no I/O) three
read-backs later, past ``ROWS_KEPT`` (as a closed block is): a rows queue none of whose jobs
there is pending loses its rows, one all of whose jobs there are pending becomes a sum again (a
queue taken along while it drained slowly beside a fast one). A queue drained while another one
whose records share its blocks waits (paused, blocked on a limit, a lower priority, or draining
in bursts) thus costs rows only where it drains, then nothing; the one waiting stays a sum.

New blocks are rows while the tracker holds fewer than its ``ROWS_KEPT`` rows (2 MB): a
burn-down's jobs finish before their blocks would ever be read back (about 40,000 instructions
per finished job, mostly the JSON of each record). Past them, a block read as rows with terminal
records in it (read again after a restart) is *settled* when the next one starts
(:meth:`Segment.settle`): the rows of a queue none of whose jobs there is pending go, those of a
queue all of whose jobs there are pending become its sum. So the tracker holds 20 bytes per
block, and about 130 more per block with sums (measured: a dict entry and its packed sums, 16
bytes per queue); plus 20 bytes per row, i.e. per record of the blocks of new jobs up to
``ROWS_KEPT``, per record of the last three blocks read back (not settled yet), and per record
of a queue in a block where that queue has both finished and waiting jobs (a drain's front, or a
queue that stopped draining mid-block: at most a block's records per queue and block where it
stopped). A terminal record
whose queue the tracker was not told (``saw(loc, None)``) is a row of the queue ``""`` until
its block is dead: a read-back could not tell it from a job of a queue held as a sum. A tracker
with no journal to read back from keeps every block as rows.

This module must not import redis or rq.
"""

from __future__ import annotations

import bisect
import json
import math
import struct
from array import array
from collections.abc import Callable, Iterable
from typing import Any

from hybridq.journal.random_access import SegmentFile

__all__ = ["BLOCK", "BLOCK_BYTES", "DEAD", "Rows", "Segment", "Sums", "job_fields", "read_rows"]

#: Records per block: a block turned into rows reads at most this many records back.
BLOCK = 512
#: A record at least this far past its block's first starts a new block, so a read-back reads
#: about this much plus one record (512 jobs of 100 KB were one read of 50 MB, 146 MB at its peak).
BLOCK_BYTES = 1 << 20
DONE = math.inf
#: A queue's sum in a block: its queue id, its record count, its least creation time.
_SUM = struct.Struct("<IId")

Sums = dict[int, tuple[int, float]]


def job_fields(payload: bytes) -> tuple[str, float] | None:
    """A record's queue and creation time, as ``status`` reads them; ``None`` if it is not a job."""
    try:
        body = json.loads(payload)
        return str(body["queue"]), float(body["created_at"])
    except (ValueError, KeyError, TypeError, OverflowError):
        return None


class Rows:
    """A block's records one by one: offset, creation time (``inf``: not pending), queue id."""

    __slots__ = ("created", "live", "next", "offsets", "queues")

    def __init__(self, rows: Iterable[tuple[int, float, int]] = ()) -> None:
        self.offsets = array("q")
        self.created = array("d")
        self.queues = array("I")
        #: How many of them are pending.
        self.live = 0
        #: Where the row after the last one finished is: jobs mostly finish in the order they
        #: were read, so the next to finish is looked for there first (a bisection of the
        #: array makes an int of each probe: about 2.5k instructions a finished job).
        self.next = 0
        for row in rows:
            self.add(*row)

    def add(self, offset: int, created: float, qid: int) -> None:
        """Append a record (``created``: ``inf`` if it is not a pending job)."""
        self.offsets.append(offset)
        self.created.append(created)
        self.queues.append(qid)
        self.live += created != DONE

    def __iter__(self) -> Any:
        return zip(self.offsets, self.created, self.queues, strict=True)


#: The rows of a block none of whose records is pending any more (shared, never changed).
DEAD = Rows()


def per_queue(rows: Iterable[tuple[int, float, int]]) -> tuple[Sums, set[int]]:
    """The pending rows' sum per queue, and the queues with a row not pending."""
    sums: Sums = {}
    ended: set[int] = set()
    for _, created, qid in rows:
        if created == DONE:
            ended.add(qid)
        else:
            count, least = sums.get(qid, (0, DONE))
            sums[qid] = (count + 1, min(least, created))
    return sums, ended


class Segment:
    """What the tracker read of one journal segment (see the module's docstring).

    ``counted``: records of a segment counted from its seal (every job in it terminal), held as
    that count only.
    """

    __slots__ = ("counted", "counts", "last", "mins", "rows", "shut", "starts", "stuck", "sums")

    def __init__(self, counted: int = 0) -> None:
        self.counted = counted
        #: Per block: its first record's offset, its record count, its least pending creation time.
        self.starts = array("q")
        self.counts = array("I")
        self.mins = array("d")
        #: The blocks with rows, by block number (:data:`DEAD` once none is pending).
        self.rows: dict[int, Rows] = {}
        #: The blocks with queues held as sums (packed :data:`_SUM` each), by block number.
        self.sums: dict[int, bytes] = {}
        #: Blocks that could not be read back: their summary or sums stay as they are (never saved).
        self.stuck: set[int] = set()
        #: The last record's offset (-1: none read).
        self.last = -1
        #: The last block when it takes no more records (it has sums, or is stuck), else -1.
        self.shut = -1

    @property
    def seen(self) -> int:
        """Records read of this segment."""
        return self.counted + sum(self.counts)

    def add(self, offset: int, created: float, qid: int, *, summary: bool) -> int:
        """Append a record; ``summary``: it may go into a summary block (it is a pending job).

        Returns 1 if it went into a block held as rows, plus 2 if it started a block.
        """
        # Once per record the forwarder reads: written out (no min() call, one look at the rows,
        # Rows.add inline), about 2k instructions less a job (docs/benchmarks.md, "The
        # forwarder's writes per job, again").
        starts, counts = self.starts, self.counts
        b = len(starts) - 1
        rows = self.rows.get(b)
        # A summary holds pending jobs only; a block with sums says a record not in its rows is
        # not pending unless its queue has a sum, so it takes none (:attr:`shut`; nor DEAD, shared).
        fits = (
            b >= 0
            and counts[b] < BLOCK
            and offset - starts[b] < BLOCK_BYTES
            and b != self.shut
            and (rows is not DEAD if rows is not None else summary)
        )
        if not fits:
            b += 1
            starts.append(offset)
            counts.append(1)
            self.mins.append(created)
            if not summary:
                self.rows[b] = Rows()
            rows = self.rows.get(b)
        else:
            counts[b] += 1
            if created < self.mins[b]:  # noqa: PLR1730 - no min() call: once per record read
                self.mins[b] = created
        self.last = offset
        if rows is None:
            return 2 * (not fits)
        rows.offsets.append(offset)
        rows.created.append(created)
        rows.queues.append(qid)
        if created != DONE:
            rows.live += 1
        return 1 + 2 * (not fits)

    def block_of(self, offset: int) -> int:
        """The block whose records' offsets span ``offset`` (-1: before the first, or after the last)."""
        if offset > self.last or not self.starts or offset < self.starts[0]:
            return -1
        return bisect.bisect_right(self.starts, offset) - 1  # in C: once per finished job

    def end_of(self, b: int) -> int:
        """The offset past block ``b``'s last record, or at it (its records are before this, or at it)."""
        return self.starts[b + 1] - 1 if b + 1 < len(self.starts) else self.last

    def sums_of(self, b: int) -> Sums:
        """Block ``b``'s queues held as sums: count and least creation time by queue id."""
        packed = self.sums.get(b, b"")
        return {qid: (count, least) for qid, count, least in _SUM.iter_unpack(packed)}

    def put_sums(self, b: int, sums: Sums) -> None:
        """Hold ``sums`` as block ``b``'s (none: the block has no queue held as a sum)."""
        if sums:
            self.sums[b] = b"".join(_SUM.pack(q, c, least) for q, (c, least) in sorted(sums.items()))
        else:
            self.sums.pop(b, None)
        self.reshut()

    def reshut(self) -> None:
        """Find :attr:`shut` again (after the blocks, their sums or :attr:`stuck` changed)."""
        b = len(self.starts) - 1
        self.shut = b if b in self.sums or b in self.stuck else -1

    def recompute(self, b: int) -> None:
        """Block ``b``'s least pending creation time, from its rows and sums.

        Not for a :data:`DEAD` block (its least is ``inf`` already), nor a summary: one that
        could not be read back keeps the least it had (too old, not too young).
        """
        rows = self.rows.get(b)
        if rows is DEAD or (rows is None and b not in self.sums):
            return
        least = min(rows.created, default=DONE) if rows is not None else DONE
        self.mins[b] = min([least, *(m for _, m in self.sums_of(b).values())])

    def complete(self, b: int, found: list[tuple[int, bytes]], qid: Callable[[str], int]) -> Rows:
        """Block ``b``'s every record as a row, from ``found`` (its records read back).

        ``found`` may lack records punched since they were read (every job in them finished:
        :func:`read_rows`); their rows, if held, are kept, else they are not rows (not pending).
        Raises ``OSError`` if they do not agree with what the block holds (not the records read).
        """
        rows = self.rows.get(b)
        known = (
            {}
            if rows is None
            else dict(zip(rows.offsets, zip(rows.created, rows.queues, strict=True), strict=True))
        )
        summary = rows is None and b not in self.sums
        sums = self.sums_of(b)
        counts = dict.fromkeys(sums, 0)
        out = Rows()
        for offset, payload in found:
            row = known.pop(offset, None) if known else None
            if row is not None:
                out.add(offset, *row)
                continue
            fields = job_fields(payload) if summary or sums else None
            queue = qid("" if fields is None else fields[0])
            if fields is None or not (summary or queue in sums):
                out.add(offset, DONE, queue)
                continue
            if not summary:
                counts[queue] += 1
            out.add(offset, fields[1], queue)
        if any(counts[q] != count for q, (count, _) in sums.items()):
            raise OSError(f"block {b}'s records are not those it holds")
        if known:
            # Rows not read back: only finished ones may be missing (punched, hybridq.journal.holes).
            if len(found) >= self.counts[b] or any(created != DONE for created, _ in known.values()):
                raise OSError(f"block {b}'s records are not those it holds")
            out = Rows(sorted([*out, *((offset, *row) for offset, row in known.items())]))
        return out

    def take(self, b: int, full: Rows, queues: set[int], unknown: int) -> Rows:
        """Turn ``queues``' records of block ``b`` into rows (``full``: :meth:`complete`'s).

        The rows of a queue none of whose jobs there is pending go (``unknown``: the queue of
        records not known to be jobs, whose rows stay); the other queues stay sums.
        """
        before = self.rows.get(b)
        if before is None and b not in self.sums:  # a summary: every queue of it a sum
            present = set(full.queues)  # in C; a summary read back for its only queue: no sums
            present.discard(unknown)
            sums = {} if present <= queues else per_queue(full)[0]
        else:
            sums = self.sums_of(b)
        taken = queues & sums.keys()  # not a queue dead here: its rows would come back
        sums = {q: s for q, s in sums.items() if q not in taken}
        if before is None and not sums:
            rows = full  # a summary taken whole
        else:
            keep = taken | {unknown} | ({q for _, c, q in before if c != DONE} if before else set())
            rows = Rows(row for row in full if row[2] in keep)
        self.rows[b] = rows
        self.put_sums(b, sums)
        return rows

    def settle(self, b: int, unknown: int) -> None:
        """Hold closed block ``b``'s rows as sums where that is exact (its sums kept, added to).

        Only the rows of a queue with pending and not pending records there stay (and those of
        ``unknown``); a block of rows only none of whose records is terminal stays rows.
        """
        sums, ended = per_queue(self.rows[b])
        mixed = (set(sums) & ended) | {unknown}
        if not ended and b not in self.sums:
            return  # rows of new jobs, within the rows kept: the drain that follows reads nothing
        for q in mixed:
            sums.pop(q, None)
        for q, (count, least) in self.sums_of(b).items():  # a queue is rows or a sum, not both
            more, other = sums.get(q, (0, DONE))
            sums[q] = (count + more, min(least, other))
        kept = Rows(row for row in self.rows[b] if row[2] in mixed)
        if kept.offsets:
            self.rows[b] = kept
        else:
            del self.rows[b]
        self.put_sums(b, sums)

    def head(self) -> list[Any]:
        """What :meth:`read` needs besides :meth:`columns`: counted, last, blocks, rows and sums."""
        return [
            self.counted,
            self.last,
            len(self.starts),
            [[b, len(r.offsets)] for b, r in self.rows.items()],
            [[b, [[q, c, least] for q, (c, least) in self.sums_of(b).items()]] for b in self.sums],
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
        counted, last, blocks, held, sums = head
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
        for b, queues in sums:
            if not 0 <= int(b) < int(blocks) or not queues:
                raise ValueError("no such block")
            seg.put_sums(int(b), {int(q): (int(c), float(least)) for q, c, least in queues})
        for b in {*seg.rows, *seg.sums}:
            seg.recompute(b)  # saved before a least that finished was found again
        seg.reshut()
        return seg, view


def read_rows(
    journal: str | None, seg: tuple[str, int], start: int, end: int, count: int
) -> list[tuple[int, bytes]]:
    """The ``count`` data records of segment ``seg`` from ``start`` to ``end`` (both included).

    One read for the whole range (:meth:`SegmentFile.read_data`: a record at a time cost two
    system calls each, about 4 us a finished job over a drain), each record checked. Raises
    :class:`JournalCorruption` or ``OSError`` when they cannot be read, or are not ``count``
    (what the tracker read there); fewer only when some were punched since.
    """
    if journal is None:
        raise OSError("no journal to read the block from")
    with SegmentFile(journal, *seg) as segment:
        out, punched = segment.read_present(start, end)
    # Punched records (hybridq.journal.holes: their jobs all finished) are not read back.
    if len(out) > count or (len(out) < count and not punched):
        raise OSError(f"{len(out)} records where {count} were read")
    return out
