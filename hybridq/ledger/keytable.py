"""Who owns each explicit idempotency key: a table on disk, not a dict in memory (issue 29).

Enqueue-if-absent (docs/enqueue.md) needs, per explicit key, its owner: the ``key`` ledger entry
of the newest job that took it. Kept in memory, that was about 0.5 KB per pending keyed job. The
forwarder keeps it in a SQLite file beside its saved index, ``<journal>/ledger-keys.sqlite``
(WAL, 0600): a derived cache of the ledger's ``key`` entries and of the key store
(``<journal>/keys/``), which stay the durable truth. It sits in the ledger layer, not in the
run table's file: it is part of the ledger's index, loaded and saved with it
(:mod:`hybridq.ledger.saved_index`), and a run table lost or rebuilt must not take it along.
Other readers of the ledger (doctor, lookups) get the same table in memory (``:memory:``).

The rules that keep an owner from being missed (docs/reliability.md, "The key table"):

* **Max-merge.** A row changes only to an entry newer by ``(at, loc, until)`` (as
  :meth:`~hybridq.ledger.index.LedgerIndex.apply` folds ``key`` entries): applying entries again,
  in any order, gives the same table, so a replay over it repairs it.
* **Committed with the saved index.** Rows are written after their ledger append is durable,
  in one transaction that :meth:`mark` commits (or every :data:`COMMIT_ROWS` rows, no fsync):
  what a crash drops was appended to the ledger after the saved index's positions, and the
  next start replays it. (A commit per step wrote a page per row: random keys land on distinct
  B-tree pages; batching 20,000 rows halved the cost per row.)
* **A generation.** Before the saved index is written, :meth:`mark` commits a higher generation
  with fsync (and every row before it); the saved index records the table's id and that
  generation. A start trusts the table only if its id is the saved one's and its generation at
  least the saved one (a crash between the two leaves the table ahead, which is fine: it holds
  at least what the saved index covers); otherwise (missing, damaged, another table, older) it
  empties it and replays the whole ledger.
* **Deletions re-converge.** Only keys past their window are deleted (:meth:`forget_expired`);
  a deletion lost in a crash is done again by the next start's forget.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import operator
import os
import sqlite3
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

from hybridq import crashpoints
from hybridq.errors import JournalIOError
from hybridq.ledger.entries import Entry
from hybridq.ledger.sqlite_errors import sqlite_errno
from hybridq.protocol import EntryKind

__all__ = ["KEYS_TABLE_FILE", "KeyTable", "UnreadKeys"]

log = logging.getLogger("hybridq.ledger")
P = ParamSpec("P")
R = TypeVar("R")


def _mapped(method: Callable[P, R]) -> Callable[P, R]:
    """SQLite's errors as the journal's: ENOSPC (or EDQUOT) for a full disk, EIO otherwise.

    A failed statement or commit may roll the open transaction back: the rows of this run are
    then not all there, so a step retried in this run could miss an owner. The table is
    poisoned (:attr:`KeyTable.failed`): on a full disk the forwarder pauses and opens again as
    a start does, replaying the ledger after the saved index into the table; on any other
    error it stops and the next start does (docs/reliability.md, the key table).
    """

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except sqlite3.Error as exc:
            # Poisoned: rows of this run may be gone, so no mark (and no saved index) may vouch
            # for the table again in this run; the next start replays what it lost.
            table = args[0]
            assert isinstance(table, KeyTable)
            table.failed = True
            code = sqlite_errno(exc, None if table.path is None else os.path.dirname(table.path))
            cause = OSError(code, f"{exc} (docs/reliability.md, the key table)")
            table.error = JournalIOError(KEYS_TABLE_FILE, "the key table", cause)
            raise table.error from exc

    return call


#: The table's file in the journal directory.
KEYS_TABLE_FILE = "ledger-keys.sqlite"
#: Rows written in one transaction at most before it is committed (no fsync) even without a
#: mark: bounds the write-ahead log's uncommitted part.
COMMIT_ROWS = 20_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    key TEXT PRIMARY KEY, at REAL NOT NULL, chain TEXT NOT NULL, seg INTEGER NOT NULL,
    off INTEGER NOT NULL, until REAL, job_id TEXT NOT NULL, outcome TEXT, queue TEXT
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS keys_until ON keys (until) WHERE until IS NOT NULL;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
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


class KeyTable:
    """The owners of explicit idempotency keys (see module docstring).

    Args:
        path: the SQLite file (created 0600 when missing; emptied and made again when damaged),
            or ``None`` for a table in memory (never trusted by a saved index).
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.id = ""
        self.generation = 0
        self._closed = False
        #: What the last :meth:`mark` said the table covers (the saved index's ledger positions,
        #: opaque here): a start checks it against the ledger as it is.
        self.covers = ""
        #: Set by any SQLite error (see :func:`_mapped`): :meth:`mark` refuses from then on.
        self.failed = False
        #: The error that poisoned it (a caller that catches it, e.g. a failed save of the
        #: index, leaves it here for the forwarder's step to raise: it pauses or stops).
        self.error: JournalIOError | None = None
        #: Rows written in the open transaction; rows :meth:`bulk` keeps, not written yet.
        self._written = 0
        self._bulk: list[tuple[Any, ...]] | None = None
        self._db = self._open()

    @classmethod
    def in_journal(cls, journal: str) -> KeyTable:
        """The forwarder's table of a journal directory."""
        return cls(os.path.join(journal, KEYS_TABLE_FILE))

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            db.executescript(_SCHEMA)
            return db
        try:
            try:
                return self._connect()
            except sqlite3.OperationalError:  # locked, read-only, full, unable to open: not damage
                raise
            except sqlite3.DatabaseError as exc:
                log.warning(
                    "the key table %s is damaged (made again, the ledger replayed): %s", self.path, exc
                )
                self._unlink()
                return self._connect()
        except sqlite3.Error as exc:
            code = sqlite_errno(exc, os.path.dirname(self.path))
            cause = OSError(code, f"{exc} (docs/reliability.md, the key table)")
            raise JournalIOError(KEYS_TABLE_FILE, "the key table", cause) from exc

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        # Never through a symlink (OSError ELOOP), as every journal file (docs/journal-format.md);
        # private: SQLite makes its -wal and -shm files with the file's mode.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # mark() fsyncs; a step's commit need not
            db.executescript(_SCHEMA)
            checked = db.execute("PRAGMA quick_check").fetchone()[0]
            meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
        except sqlite3.DatabaseError:
            db.close()
            raise
        if checked != "ok":
            db.close()
            raise sqlite3.DatabaseError(f"quick_check: {checked}")
        if "id" not in meta:  # new: nothing saved can vouch for it
            meta = {"id": uuid.uuid4().hex, "gen": "0"}
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(meta.items()))
        self.id, self.generation = meta["id"], int(meta["gen"])
        self.covers = meta.get("covers", "")
        return db

    def _unlink(self) -> None:
        assert self.path is not None
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + suffix)

    # -- reading ------------------------------------------------------------------------------

    @_mapped
    def get(self, key: str) -> Entry | None:
        """The ``key`` entry of the job owning ``key`` (``None``: nobody owns it)."""
        self._settle()
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

    @_mapped
    def items(self) -> list[tuple[str, Entry]]:
        """Every key and its owner's entry (tests, and a look at a small table: O(keys))."""
        self._settle()
        keys = [key for (key,) in self._db.execute("SELECT key FROM keys ORDER BY key")]
        return [(key, entry) for key in keys if (entry := self.get(key)) is not None]

    def __eq__(self, other: object) -> bool:
        """The same owners (another table's, or a mapping's): what the tests compare."""
        if isinstance(other, KeyTable):
            return self.items() == other.items()
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    @_mapped
    def __len__(self) -> int:
        self._settle()
        return int(self._db.execute("SELECT count(*) FROM keys").fetchone()[0])

    @_mapped
    def windowed(self) -> int:
        """How many keys have a window (their job finished, its segment compacted)."""
        self._settle()
        return int(self._db.execute("SELECT count(*) FROM keys WHERE until IS NOT NULL").fetchone()[0])

    def trusts(self, table_id: str, generation: int) -> bool:
        """Whether this table holds every owner a saved index of ``table_id``/``generation`` covers."""
        return self.path is not None and table_id == self.id and self.generation >= generation

    # -- writing ------------------------------------------------------------------------------

    @_mapped
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

    @_mapped
    def _settle(self) -> None:
        """Write the rows :meth:`bulk` keeps (before anything reads the table)."""
        if self._bulk:
            rows = sorted(self._bulk, key=operator.itemgetter(0))
            self._bulk.clear()
            self._begin(len(rows))
            self._db.executemany(_OWN, rows)

    def _begin(self, rows: int = 1) -> None:
        if self._written >= COMMIT_ROWS:
            self.commit()
        if not self._db.in_transaction:
            self._db.execute("BEGIN")
        self._written += rows

    @_mapped
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

    @_mapped
    def clear(self) -> None:
        """Drop every row (a full replay of the ledger follows), under a new id.

        No saved index made before can vouch for the table again. The file is made anew (a
        ``DELETE`` of every row cost seconds at 200,000).
        """
        if self._bulk:
            self._bulk.clear()
        if self.path is None:
            self._db.execute("DELETE FROM keys")
            return
        self._db.close()
        self._unlink()
        self._written = 0
        self._db = self._connect()

    @_mapped
    def commit(self) -> None:
        """Commit the rows written since the last commit (no fsync; nothing to do if none)."""
        self._settle()
        self._written = 0
        if self._db.in_transaction:
            crashpoints.reached("keys_before_commit")
            self._db.execute("COMMIT")

    @_mapped
    def mark(self, covers: str = "") -> tuple[str, int]:
        """Commit every row and a new generation, with fsync; returns (table id, generation).

        Called before a saved index that records them is written; ``covers``: the ledger
        positions the rows cover (kept as :attr:`covers`). Refused (``JournalIOError``)
        once an SQLite error poisoned the table (:attr:`failed`): its open transaction may have
        been rolled back, and the next start must replay what it lost.
        """
        if self.failed:
            cause = OSError(
                errno.EIO, "an earlier error may have lost rows (docs/reliability.md, the key table)"
            )
            raise JournalIOError(KEYS_TABLE_FILE, "the key table", cause)
        self.commit()
        generation = self.generation + 1
        if self.path is not None:
            self._db.execute("PRAGMA synchronous=FULL")
            try:
                self._db.executemany(
                    "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                    [("gen", str(generation)), ("covers", covers)],
                )
            finally:
                self._db.execute("PRAGMA synchronous=NORMAL")
        self.generation, self.covers = generation, covers
        return self.id, generation

    def close(self) -> None:
        """Commit and close (idempotent); a poisoned table is closed without writing anything."""
        if not self._closed:
            self._closed = True
            try:
                if not self.failed:  # its rows come back from the ledger at the next open
                    self.commit()
            finally:
                self._db.close()


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
