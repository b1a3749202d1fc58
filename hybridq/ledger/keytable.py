"""Who owns each explicit idempotency key: a table on disk, not a dict in memory (issue 29).

Enqueue-if-absent (docs/enqueue.md) needs, per explicit key, its owner: the ``key`` ledger entry
of the newest job that took it. Kept in memory, that was about 0.5 KB per pending keyed job. The
forwarder keeps it in a SQLite file beside its saved index, ``<journal>/ledger-keys.sqlite``
(WAL, 0600): a derived cache of the ledger's ``key`` entries and of the key store
(``<journal>/keys/``), which stay the durable truth. It sits in the ledger layer, not in the
run table's file: it is part of the ledger's index, loaded and saved with it
(:mod:`hybridq.ledger.saved_index`), and a run table lost or rebuilt must not take it along.
Other readers of the ledger (doctor, lookups) get the same table in memory; the dashboard's
long-lived view in a private temporary database (``spill``).

The rules that keep an owner from being missed (docs/reliability.md, "The key table"): those of
the file (:mod:`hybridq.ledger.tablefile`: ledger first, committed with the saved index, a
generation, poison), and:

* **Max-merge.** A row changes only to an entry newer by ``(at, loc, until)`` (as
  :meth:`~hybridq.ledger.index.LedgerIndex.apply` folds ``key`` entries): applying entries again,
  in any order, gives the same table, so a replay over it repairs it. (A commit per step wrote
  a page per row: random keys land on distinct B-tree pages; batching 20,000 rows halved the
  cost per row.)
* **Deletions re-converge.** Only keys past their window are deleted (:meth:`forget_expired`);
  a deletion lost in a crash is done again by the next start's forget.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import errno
import operator
import os
from collections.abc import Iterator, Mapping
from typing import Any

from hybridq.errors import JournalIOError
from hybridq.ledger import duptable, failtable
from hybridq.ledger.duptable import DuplicateTable
from hybridq.ledger.entries import Entry
from hybridq.ledger.failtable import FailureTable
from hybridq.ledger.tablefile import COMMIT_ROWS, KEYS_TABLE_FILE, TableFile, mapped
from hybridq.protocol import EntryKind

__all__ = ["KEYS_TABLE_FILE", "KeyTable", "UnreadKeys"]


_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    key TEXT PRIMARY KEY, at REAL NOT NULL, chain TEXT NOT NULL, seg INTEGER NOT NULL,
    off INTEGER NOT NULL, until REAL, job_id TEXT NOT NULL, outcome TEXT, queue TEXT
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS keys_until ON keys (until) WHERE until IS NOT NULL;
"""
# The newest entry wins (LedgerIndex._own_key's order): a row is replaced only by a newer one.
_OWN = """
INSERT INTO keys VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (key) DO UPDATE SET
    at = excluded.at, chain = excluded.chain, seg = excluded.seg, off = excluded.off,
    until = excluded.until, job_id = excluded.job_id, outcome = excluded.outcome,
    queue = excluded.queue
WHERE (excluded.at, excluded.chain, excluded.seg, excluded.off, coalesce(excluded.until, 0.0))
    > (keys.at, keys.chain, keys.seg, keys.off, coalesce(keys.until, 0.0))
"""
_GET = "SELECT at, chain, seg, off, until, job_id, outcome, queue FROM keys WHERE key = ?"


class KeyTable(TableFile):
    """The owners of explicit idempotency keys (see module docstring), and the file's owner.

    The file (:class:`~hybridq.ledger.tablefile.TableFile`: its connection, mark and poison)
    holds the listed failures too: :attr:`failures` (:mod:`hybridq.ledger.failtable`), and the
    pending duplicates: :attr:`duplicates` (:mod:`hybridq.ledger.duptable`).

    Args:
        path: the SQLite file (created 0600 when missing; emptied and made again when damaged),
            or ``None`` for a table in memory (never trusted by a saved index).
    """

    schema = _SCHEMA + failtable.SCHEMA + duptable.SCHEMA

    def __init__(self, path: str | None = None, *, spill: bool = False, deferred: bool = False) -> None:
        #: Rows :meth:`bulk` keeps, not written yet.
        self._bulk: list[tuple[Any, ...]] | None = None
        #: The failures listed for requeue: a table of the same file.
        self.failures = FailureTable(self)
        #: The pending duplicates: a table of the same file (:mod:`hybridq.ledger.duptable`).
        self.duplicates = DuplicateTable(self)
        super().__init__(path, spill=spill, deferred=deferred)
        try:
            self.failures.opened()
            self.duplicates.opened()
        except BaseException:
            self.discard()  # its connection closed now, not by the collector (e.g. found damaged)
            raise

    @classmethod
    def in_journal(cls, journal: str) -> KeyTable:
        """The forwarder's table of a journal directory, checked on a thread (``deferred``).

        Damage met while it opens waits for the check; found damaged, the file is deleted and
        made again (empty: the saved index no longer trusts it, the whole ledger is replayed).
        """
        path = os.path.join(journal, KEYS_TABLE_FILE)
        try:
            return cls(path, deferred=True)
        except JournalIOError as exc:
            # confirm() deletes a damaged file (EIO): anything else stands (a full disk: ENOSPC)
            if exc.errno != errno.EIO or os.path.exists(path):
                raise
            return cls(path, deferred=True)

    # -- reading ------------------------------------------------------------------------------

    @mapped
    def get(self, key: str) -> Entry | None:
        """The ``key`` entry of the job owning ``key`` (``None``: nobody owns it)."""
        self._settle()
        self.confirm()  # "nobody owns it" only from a file whose check passed
        row = self._db.execute(_GET, (key,)).fetchone()
        if row is None:
            return None
        at, chain, seg, off, until, job_id, outcome, queue = row
        return Entry(
            EntryKind.KEY,
            job_id,
            (chain, seg, off),
            key=key,
            at=at,
            until=until,
            outcome=outcome,
            queue=queue,
        )

    @mapped
    def items(self) -> list[tuple[str, Entry]]:
        """Every key and its owner's entry (tests, and a look at a small table: O(keys))."""
        self._settle()
        self.confirm()
        keys = [key for (key,) in self._db.execute("SELECT key FROM keys ORDER BY key")]
        return [(key, entry) for key in keys if (entry := self.get(key)) is not None]

    def __eq__(self, other: object) -> bool:
        """The same owners and failures (another table's), or owners (a mapping's): what tests compare."""
        if isinstance(other, KeyTable):
            return (
                self.items() == other.items()
                and self.failures == other.failures
                and self.duplicates == other.duplicates
            )
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    @mapped
    def __len__(self) -> int:
        self._settle()
        # Not after the check's verdict: a count (figures, forgetting) pushes nothing.
        return int(self._db.execute("SELECT count(*) FROM keys").fetchone()[0])

    @mapped
    def windowed(self) -> int:
        """How many keys have a window (their job finished, its segment compacted)."""
        self._settle()
        # Not after the check's verdict: what it deletes re-converges (docs/reliability.md, the key
        # table, rule 5), and a damaged file is made again with every row anyway.
        return int(self._db.execute("SELECT count(*) FROM keys WHERE until IS NOT NULL").fetchone()[0])

    # -- writing ------------------------------------------------------------------------------

    @mapped
    def own(self, entry: Entry) -> bool:
        """Make ``entry``'s job the owner of its key if it is newer; whether it changed anything."""
        if entry.key is None:
            return False
        loc = entry.loc
        row = (entry.key, entry.at, *loc, entry.until, entry.job_id, entry.outcome, entry.queue)
        if self._bulk is not None:
            self._bulk.append(row)
            if len(self._bulk) >= COMMIT_ROWS:
                self._settle()
            return True
        self._begin()
        return self._db.execute(_OWN, row).rowcount > 0

    @contextlib.contextmanager
    def bulk(self) -> Iterator[None]:
        """Within it, :meth:`own` keeps rows and writes them in key order, many at a time.

        For a replay (neighbouring keys share B-tree pages: about 40% less per row than one by
        one); :meth:`own` then returns ``True`` for any entry with a key.
        """
        self._bulk = []
        try:
            yield
        finally:
            try:
                self._settle()
            finally:
                self._bulk = None

    @mapped
    def _settle(self) -> None:
        """Write the rows :meth:`bulk` keeps, and delete the settled duplicates' (before a read)."""
        self.duplicates.flush()
        if self._bulk:
            rows = sorted(self._bulk, key=operator.itemgetter(0))
            self._bulk.clear()
            self._begin(len(rows))
            self._db.executemany(_OWN, rows)

    @mapped
    def forget_expired(self, now: float, most: int | None = None) -> int:
        """Forget keys whose window ended before ``now``; beyond ``most`` keys left, the oldest.

        Only keys with a window count. Returns how many were forgotten.
        """
        self._settle()
        self._begin()
        gone = self._db.execute("DELETE FROM keys WHERE until IS NOT NULL AND until < ?", (now,)).rowcount
        if most is not None:
            excess = self.windowed() - most
            if excess > 0:
                gone += self._db.execute(
                    "DELETE FROM keys WHERE key IN (SELECT key FROM keys WHERE until IS NOT NULL"
                    " ORDER BY until LIMIT ?)",
                    (excess,),
                ).rowcount
        return int(gone)

    def _cleared(self) -> None:
        if self._bulk:
            self._bulk.clear()
        self.failures.cleared()
        self.duplicates.cleared()

    def _committing(self) -> None:
        self.failures.committing()


class UnreadKeys(KeyTable):
    """The key table of a reader that never looks at key owners: it keeps none.

    ``load_index(..., keys=False)`` (job status, doctor, the failed list, cancels, ops status):
    their index costs no SQLite row per key entry (about 6 µs each, 0.4 µs before the table).
    """

    def own(self, entry: Entry) -> bool:
        """Keep nothing (whether the entry has a key, as if it were kept)."""
        return entry.key is not None

    def get(self, key: str) -> Entry | None:  # noqa: ARG002
        """Refused: this index does not know the owners."""
        raise RuntimeError("this ledger index was loaded without its key owners (keys=False)")
