"""The dashboard's view of the ledger, read incrementally: one per server, shared by every page.

Each page used to read the whole ledger (5 s for the failed list of a 200,000-job journal, and
the renders held the GIL against the API). This view keeps what it parsed -- a
:class:`~hybridq.ledger.store.LedgerIndex` (the failed list, folded exactly as ``failed_jobs`` folds
it), where each job's entries are in the ledger (for its trace), and the outcomes of the last
minutes (throughput) -- and reads only the records appended since. Ledger chains only grow;
when a segment it read was deleted (compaction) or the compaction state changed, it reads
everything again.

Its tables (the failures listed, the keys, and where each job's entries are) are a private
temporary SQLite database, not one in memory: the server's memory does not grow with the
failures it lists nor with the ledger it read (docs/http.md, "On a big journal"). An error of
that database (the temporary directory full or not writable) may have rolled back rows of
records already read past, so the view reads everything again at the next question; if the
temporary directory cannot hold them, it keeps them in memory from then on (one log line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from hybridq.errors import JournalCorruption, JournalError, JournalIOError, RecordPunched
from hybridq.journal import JournalReader, Record, RecordType
from hybridq.journal.reader import list_chains, read_record_at
from hybridq.journal.records import Loc
from hybridq.ledger.compacted import Compacted, load_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import ledger_dir
from hybridq.ledger.tablefile import SPILL_OP, TableFile, mapped
from hybridq.ops.failures import FailedJob, failed_job, listed, listed_each
from hybridq.protocol import EntryKind

__all__ = ["LedgerView"]

log = logging.getLogger("hybridq.http")

_T = TypeVar("_T")

#: Entries read before their places are written (one statement for each batch).
_PLACES_BATCH = 2000
#: Where each job's ledger entries are: a table of the view's tables' file (``n``: the order
#: they were read in, which is ledger order).
_PLACES = """
CREATE TABLE IF NOT EXISTS places (
    job TEXT NOT NULL, n INTEGER NOT NULL, chain TEXT NOT NULL, seg INTEGER NOT NULL,
    off INTEGER NOT NULL, PRIMARY KEY (job, n)
) WITHOUT ROWID;
"""


@mapped
def _create_places(file: TableFile) -> None:
    file.execute(_PLACES)


@mapped
def _add_places(file: TableFile, rows: list[tuple[str, int, str, int, int]]) -> None:
    file.write_many("INSERT INTO places VALUES (?, ?, ?, ?, ?)", rows)


@mapped
def _places_of(file: TableFile, job_id: str) -> list[Loc]:
    rows = file.execute("SELECT chain, seg, off FROM places WHERE job = ? ORDER BY n", (job_id,))
    return [(str(chain), int(seg), int(off)) for chain, seg, off in rows]


class LedgerView:
    """The ledger as the dashboard needs it; thread-safe (one lock around reading and asking)."""

    def __init__(self, journal: str, window_s: float = 300.0) -> None:
        self.journal = journal
        self.window_s = window_s
        self._lock = threading.Lock()
        self._reader: JournalReader | None = None
        self._compacted: Compacted | None = None
        self._first: dict[str, int] = {}
        #: Whether the tables are a temporary database (False once it failed: in memory).
        self._spill = True
        self._index = LedgerIndex(keys=self._tables())
        #: Where the entries read and not yet in the ``places`` table are (job id, order, chain,
        #: segment, offset); :attr:`_read_n` counts the entries read.
        self._places: list[tuple[str, int, str, int, int]] = []
        self._read_n = 0
        self._requeued: set[str] = set()
        self._recent: deque[tuple[float, str, str]] = deque()
        #: Per ledger chain, the first segment read: once it is gone, what it said is stale.
        self._read_from: dict[str, int] = {}
        #: Full reads so far (the first one, and one per compaction or vanished segment).
        self.rebuilds = 0

    # -- questions ---------------------------------------------------------------------------

    def failed(self, _journal: str | None = None) -> list[FailedJob]:
        """The failures listed now, oldest first (what :func:`hybridq.failed_jobs` returns)."""
        return self._asking(lambda: listed(self._index))

    def failed_briefly(self, brief: Callable[[FailedJob], _T | None]) -> list[_T]:
        """``brief`` of each failure listed now (in no set order; ``None`` answers are left out).

        Each failure's :class:`FailedJob` is made and dropped in turn: a page that lists 40,000
        failures keeps only what ``brief`` keeps of each (docs/http.md, "On a big journal").
        """

        def each() -> list[_T]:
            out: list[_T] = []

            def visit(failed: FailedJob) -> None:
                kept = brief(failed)
                if kept is not None:
                    out.append(kept)

            listed_each(self._index, visit)
            return out

        return self._asking(each)

    def failures_at(self, locs: list[Loc]) -> list[FailedJob | None]:
        """The failure listed at each of ``locs`` now (``None``: none, or requeued since)."""

        def each() -> list[FailedJob | None]:
            entries = [self._index.failed.get(loc) for loc in locs]
            return [None if entry is None else failed_job(entry) for entry in entries]

        return self._asking(each)

    def _asking(self, ask: Callable[[], _T], *, vanished: bool = False) -> _T:
        """``ask`` the tables, after reading what was appended; read again if they lost rows.

        ``vanished``: ``ask`` reads ledger records back, and a segment may have gone since (the
        ledger's compaction): read everything again once.
        """
        with self._lock:
            for attempt in range(2):
                self._refresh()
                try:
                    return ask()
                except JournalIOError as exc:
                    # Reading rows back may write the cache's pages out: the same full or
                    # unwritable temporary directory, and the same fall-back as _refresh's.
                    self._compacted = None  # the tables may have lost rows: read it all again
                    if attempt or not self._spilled_away(exc):
                        raise
                except (OSError, JournalError):
                    if attempt or not vanished:
                        raise
                    self._compacted = None  # a ledger segment vanished since: read it all again
            raise AssertionError("unreachable")  # pragma: no cover

    def entries(self, job_id: str) -> list[Entry]:
        """The ledger entries of ``job_id``, in ledger order (read back by their location).

        An entry punched out of the ledger since it was read (issue 29, docs/journal.md) is left
        out, as a read of the whole ledger again would leave it (every reader skips a mapped
        range): no rebuild for it.
        """

        def read() -> list[Entry]:
            out: list[Entry] = []
            for at in _places_of(self._index.keys, job_id):
                with contextlib.suppress(RecordPunched):
                    out.append(self._read(at))
            return out

        return self._asking(read, vanished=True)

    def was_requeued(self, job_id: str) -> bool:
        """Whether a ``requeued`` entry names ``job_id``."""
        with self._lock:
            self._refresh()
            return job_id in self._requeued

    def recent(self, now: float | None = None) -> dict[str, dict[str, int]]:
        """Per queue, ``succeeded``/``failed``/``cancelled`` outcomes in the last ``window_s``."""
        now = time.time() if now is None else now
        with self._lock:
            self._refresh(now)
            cutoff = now - self.window_s
            self._recent = deque(sorted(r for r in self._recent if r[0] >= cutoff))
            out: dict[str, dict[str, int]] = {}
            for _, queue, outcome in self._recent:
                per = out.setdefault(queue, {"succeeded": 0, "failed": 0, "cancelled": 0})
                per[outcome] = per.get(outcome, 0) + 1
            return out

    # -- reading -----------------------------------------------------------------------------

    def _refresh(self, now: float | None = None) -> None:
        """Fold in what was appended since; everything again after a compaction."""
        now = time.time() if now is None else now
        for attempt in range(3):
            compacted = load_compacted(self.journal)
            if compacted != self._compacted or self._vanished():
                self._restart(compacted)
            try:
                self._tail(now - self.window_s)
            except JournalIOError as exc:
                # A failed statement rolls back the open transaction: rows of records the reader
                # is past may be gone (a failure listed again, a requeue forgotten). Read it all
                # again; in memory if the temporary directory could not hold them.
                self._compacted = None
                if attempt == 2 or not self._spilled_away(exc):
                    raise
            except (JournalCorruption, FileNotFoundError):
                if attempt == 2:
                    raise
                self._compacted = None  # a segment vanished under the reader: read it all again
            else:
                return

    def _spilled_away(self, exc: JournalIOError) -> bool:
        """Whether ``exc`` is the temporary database's: then keep the tables in memory from now on.

        Permanent for this server (one log line): a temporary directory that filled once may
        fill again, and rows lost in a rolled-back transaction cost a full read each time.
        """
        if not self._spill or exc.op != SPILL_OP:
            return False
        self._spill = False
        log.warning("the dashboard's ledger view keeps its tables in memory from now on: %s", exc)
        return True

    def _vanished(self) -> bool:
        """Whether a ledger segment read before was deleted since (the ledger's own compaction)."""
        directory = ledger_dir(self.journal)
        if not self._read_from:
            return False
        if not os.path.isdir(directory):
            return True
        chains = list_chains(directory)
        return any(w not in chains or chains[w][0] > first for w, first in self._read_from.items())

    def _restart(self, compacted: Compacted) -> None:
        self.rebuilds += 1
        self._compacted = compacted
        self._first = {writer: indices[0] for writer, indices in list_chains(self.journal).items()}
        self._reader = None
        self._index.keys.discard()  # its temporary file goes now, not at the collector's next pass
        self._index = LedgerIndex(keys=self._tables())
        self._places = []
        self._read_n = 0
        self._requeued = set()
        self._recent = deque()
        self._read_from = {}

    def _tables(self) -> KeyTable:
        """The view's tables: the index's, and where each job's entries are, in one file."""
        tables = KeyTable(spill=self._spill)
        try:
            _create_places(tables)
        except JournalIOError as exc:  # (a temporary directory not writable at all)
            tables.discard()
            if not self._spilled_away(exc):
                raise
            tables = KeyTable(spill=False)
            _create_places(tables)
        return tables

    def _tail(self, cutoff: float) -> None:
        if self._reader is None:
            directory = ledger_dir(self.journal)
            if not os.path.isdir(directory):
                return
            self._reader = JournalReader(directory)
        for record in self._reader.records():
            if record.rtype == RecordType.DATA:
                self._fold(record, cutoff)
                if len(self._places) >= _PLACES_BATCH:
                    self._add_places()
        self._add_places()

    def _add_places(self) -> None:
        if self._places:
            _add_places(self._index.keys, self._places)
            self._places = []

    def _fold(self, record: Record, cutoff: float) -> None:
        try:
            entry = Entry.from_bytes(record.payload)
        except (ValueError, KeyError, TypeError):
            return  # passed its checksum, so a bug: skipped as read_ledger skips it
        self._read_n += 1
        self._places.append(
            (entry.job_id, self._read_n, record.writer_id, record.segment_index, record.offset)
        )
        self._read_from.setdefault(record.writer_id, record.segment_index)
        if entry.kind == EntryKind.REQUEUED:
            self._requeued.add(entry.job_id)
        writer, segment = entry.loc[0], entry.loc[1]
        if writer not in self._first:  # a chain that appeared since the last full read?
            chains = list_chains(self.journal)
            if writer in chains:
                self._first[writer] = chains[writer][0]
        assert self._compacted is not None
        first = self._first.get(writer, sys.maxsize)
        gone = self._compacted.is_compacted((writer, segment)) or segment < first
        # Counted as status counts (docs/dashboard.md): not a failure ``under`` a success, nor a
        # success ``over`` a failure of a compacted segment (a mark the harvest appended for a
        # late success, or compaction's copy of one: status keeps such a job failed).
        if (
            entry.kind == EntryKind.DONE
            and not entry.dup
            and entry.under is None
            and not (gone and entry.over is not None)
            and entry.at >= cutoff
        ):
            self._recent.append((entry.at, entry.queue or "?", entry.outcome or "failed"))
        if gone:
            self._index.apply_compacted(entry)  # as load_index folds it
            return
        self._index.apply(entry)

    def _read(self, at: Loc) -> Entry:
        record = read_record_at(ledger_dir(self.journal), *at)
        return Entry.from_bytes(record.payload)
