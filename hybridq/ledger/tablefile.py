"""The SQLite file of the ledger's on-disk tables: its connection, its mark, its poison (issue 29).

What the forwarder must index per job outside the Redis window lives on disk, not on its heap:
the owners of idempotency keys (:mod:`hybridq.ledger.keytable`), the failures listed for
requeue (:mod:`hybridq.ledger.failtable`) and the pending duplicates
(:mod:`hybridq.ledger.duptable`). All are tables of one file,
``<journal>/ledger-keys.sqlite`` (WAL, 0600), a derived cache of the ledger, under one protocol
(docs/reliability.md, "The key table"); this class owns that file, the tables are views of it:

* **Ledger first.** Rows are written only after the ledger append they come from is fsync'd.
* **Committed with the saved index.** Rows are written in one transaction that :meth:`mark`
  commits (or every :data:`COMMIT_ROWS` rows, no fsync): what a crash drops was appended to the
  ledger after the saved index's positions, and the next start replays it.
* **A generation.** Before the saved index is written, :meth:`mark` commits a higher generation
  with fsync (and every row before it); the saved index records the file's id and that
  generation. A start trusts the file only if its id is the saved one's and its generation at
  least the saved one; otherwise (missing, damaged, another file, older) it empties it and
  replays the whole ledger.
* **Poison.** Any SQLite error sets :attr:`failed`: no mark (and no saved index) vouches for the
  file again in that run.
* **Checked.** ``PRAGMA quick_check`` reads the whole file (0.17-0.20 s per million keys). The
  forwarder's table (``deferred``) runs it on a thread after open
  (:class:`~hybridq.ledger.filecheck.FileCheck`) and every read waits for its verdict
  (:meth:`confirm`): what the table answers is never acted on before the check passed, while a
  start that asks it nothing (unkeyed jobs) pushes at once. A damaged verdict deletes the file
  and raises (:attr:`damaged`): the forwarder opens again as a start does, replaying the whole
  ledger into a new file.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hybridq import crashpoints
from hybridq.errors import JournalIOError
from hybridq.ledger.filecheck import FileCheck
from hybridq.ledger.sqlite_errors import sqlite_errno
from hybridq.ledger.table_errors import KEYS_TABLE_FILE, SPILL_OP, mapped, spill_dir

if TYPE_CHECKING:
    from hybridq.ledger.table_errors import Poisonable

__all__ = ["COMMIT_ROWS", "KEYS_TABLE_FILE", "SPILL_OP", "TableFile", "mapped", "spill_dir"]

log = logging.getLogger("hybridq.ledger")

#: Rows written in one transaction at most before it is committed (no fsync) even without a
#: mark: bounds the write-ahead log's uncommitted part.
COMMIT_ROWS = 20_000

_META = "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);"


class TableFile:
    """The ledger tables' SQLite file (see module docstring); subclasses add the tables.

    Args:
        path: the SQLite file (created 0600 when missing; emptied and made again when damaged),
            or ``None`` for tables of a reader, in memory, never trusted by a saved index.
        spill: with no path, a private temporary database instead of one in memory: its pages
            in SQLite's cache (2 MB), the rest in a file of the temporary directory, so a
            long-lived reader's memory does not grow with its rows (the dashboard's view).
        deferred: check an existing file on a thread, not at open (the forwarder's table: its
            first push does not wait for a read of the whole file; see module docstring).
    """

    #: The tables' ``CREATE ... IF NOT EXISTS`` statements (the subclass's).
    schema = ""

    def __init__(self, path: str | None = None, *, spill: bool = False, deferred: bool = False) -> None:
        self.path = path
        self.deferred = deferred and path is not None
        #: The integrity check running on a thread (``deferred``), until its verdict is taken.
        self._check: FileCheck | None = None
        #: Set when the check found the file damaged: deleted, the run must open again.
        self.damaged = False
        #: Set when the check could not run (busy, cannot open, I/O): every read refuses.
        self.unchecked = False
        #: Called from the check's thread once its verdict is in (the forwarder's wake-up).
        self.on_checked: Callable[[], None] | None = None
        self.spill = spill and path is None
        self.meta: dict[str, str] = {}
        self.id = ""
        self.generation = 0
        self._closed = False
        #: What the last :meth:`mark` said the file covers (the saved index's ledger positions,
        #: opaque here): a start checks it against the ledger as it is.
        self.covers = ""
        #: Set by any SQLite error (see :func:`mapped`): :meth:`mark` refuses from then on.
        self.failed = False
        #: The error that poisoned it (a caller that catches it, e.g. a failed save of the
        #: index, leaves it here for the forwarder's step to raise: it pauses or stops).
        self.error: JournalIOError | None = None
        #: Rows written in the open transaction.
        self._written = 0
        self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            # "": a private temporary database, its file (opened 0600, O_EXCL, unlinked at once)
            # made only when the cache overflows (docs/http.md, "On a big journal").
            name = "" if self.spill else ":memory:"
            db = sqlite3.connect(name, isolation_level=None, check_same_thread=False)
            db.executescript(self.schema + _META)
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
            db.executescript(self.schema + _META)
            checked = "ok" if self.deferred else db.execute("PRAGMA quick_check").fetchone()[0]
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
        elif self.deferred:  # rows from before: checked on a thread, reads wait for the verdict
            self._check = FileCheck(self.path, done=self._checked, name="hybridq-keys-check")
            self._check.start()
        self.id, self.generation = meta["id"], int(meta["gen"])
        self.covers = meta.get("covers", "")
        #: The file's other values as opened (a table's own, kept by :meth:`_committing`).
        self.meta = meta
        return db

    def _checked(self) -> None:
        if self.on_checked is not None:
            self.on_checked()

    def _unlink(self) -> None:
        assert self.path is not None
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + suffix)

    @property
    def checking(self) -> bool:
        """Whether the deferred check's verdict has not been taken yet (reads wait for it)."""
        return self._check is not None

    def confirm(self, *, wait: bool = True) -> None:
        """Take the deferred check's verdict (waiting for it unless ``wait`` is false).

        Called before every read of the forwarder's table, and at each step without waiting: a
        damaged file is deleted (its rows are a cache of the ledger) and ``JournalIOError``
        (EIO) raised with :attr:`damaged` set; the forwarder then opens again as a start does,
        replaying the whole ledger into a new file (docs/reliability.md, the key table).
        """
        if self.damaged or self.unchecked:  # every later read too (one thread reads: the forwarder's)
            assert self.error is not None
            raise self.error
        check = self._check
        if check is None:
            return
        problem = check.wait() if wait else check.verdict()
        if problem is None:
            return
        if not problem and check.error is None:
            self._check = None
            return
        # The flags before _check is cleared: a read of another thread that finds no check
        # must find them set (never answer from a deleted or unchecked file).
        if problem:
            cause = OSError(errno.EIO, f"damaged ({problem}): made again from the ledger")
            self.error = JournalIOError(KEYS_TABLE_FILE, "the key table", cause)
            self.failed = self.damaged = True
        else:  # could not be checked: not damage (a sound file stays); the run pauses or stops
            assert self.path is not None
            assert check.error is not None
            code = sqlite_errno(check.error, os.path.dirname(self.path))
            cause = OSError(code, f"not checked ({check.error}; docs/reliability.md, the key table)")
            self.error = JournalIOError(KEYS_TABLE_FILE, "the key table", cause)
            self.failed = self.unchecked = True
        self._check = None
        if problem:
            log.warning(
                "the key table %s is damaged (made again, the ledger replayed): %s", self.path, problem
            )
            self._unlink()  # the next open (this run's, or a start's after a crash) makes it anew
        raise self.error

    def _stop_check(self) -> None:
        if self._check is not None:
            self._check.stop()
            self._check = None

    def trusts(self, table_id: str, generation: int) -> bool:
        """Whether this file holds every row a saved index of ``table_id``/``generation`` covers."""
        return self.path is not None and table_id == self.id and self.generation >= generation

    # -- the tables' statements ---------------------------------------------------------------

    def execute(self, sql: str, params: Sequence[Any] = (), *, confirmed: bool = True) -> sqlite3.Cursor:
        """Run a statement of a table of this file as is (a read; the caller maps errors, :func:`mapped`).

        After the deferred check's verdict (:meth:`confirm`) unless ``confirmed`` is false: a
        write, or the open's reads into what the tables keep in memory (made again with them
        when the verdict is damage).
        """
        if confirmed:
            self.confirm()
        return self._db.execute(sql, params)

    def write(self, sql: str, params: Sequence[Any] = (), rows: int = 1) -> sqlite3.Cursor:
        """Run a write in the open transaction (begun if none; committed first past COMMIT_ROWS).

        ``rows``: how many it counts towards :data:`COMMIT_ROWS` (0: a statement completing
        one already counted).
        """
        self._begin(rows)
        return self._db.execute(sql, params)

    def write_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> sqlite3.Cursor:
        """:meth:`write` of one statement for each of ``rows`` (one call: a batch)."""
        self._begin(len(rows))
        return self._db.executemany(sql, rows)

    # -- writing ------------------------------------------------------------------------------

    def _settle(self) -> None:
        """Write rows a table keeps back (before anything reads or commits): none here."""

    def _begin(self, rows: int = 1) -> None:
        if self._written >= COMMIT_ROWS:
            self.commit()
        if not self._db.in_transaction:
            self._db.execute("BEGIN")
        self._written += rows

    @mapped
    def clear(self) -> None:
        """Drop every row (a full replay of the ledger follows), under a new id.

        No saved index made before can vouch for the file again. The file is made anew (a
        ``DELETE`` of every row cost seconds at 200,000).
        """
        self._cleared()
        self._stop_check()  # the file is made anew: nothing of it is read again
        if self.path is None:
            tables = self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
            for (table,) in tables:
                if table != "meta":
                    self._db.execute(f"DELETE FROM {table}")  # noqa: S608 (our own table names)
            return
        self._db.close()
        self._unlink()
        self._written = 0
        self._db = self._connect()

    def _cleared(self) -> None:
        """Forget what the tables keep in memory of their rows (they are all dropped)."""

    def _committing(self) -> None:
        """Write, in the transaction about to commit, what the tables keep of their rows."""

    @mapped
    def commit(self) -> None:
        """Commit the rows written since the last commit (no fsync; nothing to do if none)."""
        self._settle()
        self._written = 0
        if self._db.in_transaction:
            self._committing()
            crashpoints.reached("keys_before_commit")
            self._db.execute("COMMIT")

    @mapped
    def mark(self, covers: str = "") -> tuple[str, int]:
        """Commit every row and a new generation, with fsync; returns (file id, generation).

        Called before a saved index that records them is written; ``covers``: the ledger
        positions the rows cover (kept as :attr:`covers`). Refused (``JournalIOError``)
        once an SQLite error poisoned the file (:attr:`failed`): its open transaction may have
        been rolled back, and the next start must replay what it lost.
        """
        if self.failed:
            cause = OSError(
                errno.EIO, "an earlier error may have lost rows (docs/reliability.md, the key table)"
            )
            raise JournalIOError(KEYS_TABLE_FILE, "the key table", cause)
        self.confirm()  # no saved index vouches for a file before its check passed
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

    def discard(self) -> None:
        """Close without committing what this run wrote (a reader's tables it throws away)."""
        if not self._closed:
            self._closed = True
            self._stop_check()
            with contextlib.suppress(sqlite3.Error):
                self._db.close()

    def close(self) -> None:
        """Commit and close (idempotent); a poisoned file is closed without writing anything."""
        if not self._closed:
            self._closed = True
            self._stop_check()
            try:
                if not self.failed:  # its rows come back from the ledger at the next open
                    self.commit()
            finally:
                self._db.close()


if TYPE_CHECKING:
    # mapped reads and sets the file through the Poisonable Protocol (table_errors cannot import
    # this module, above it) and casts to it: mypy checks here that TableFile has what it names.
    _CONFORMS: type[Poisonable] = TableFile
