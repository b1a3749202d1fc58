"""The run table's file: its open (schema, migration, the counts' guard), close and errors.

``<journal>/runs/runs.sqlite`` (WAL, ``synchronous=FULL``, 0600), created without following a
symlink, its directory entries fsync'd before any row is trusted. A file written before
priorities existed (no ``prio`` column) gets the columns added when it is opened (its rows read
as priority 0, no key: they were spilled by a version that ignored both). A damaged file is moved
aside (logged) and a new one made: no job is lost (:mod:`hybridq.forwarder.runs` says why).
SQLite's errors become the journal's (:meth:`RunFile.errors`): one line and exit, or the
disk-full pause.

Apart from :mod:`hybridq.forwarder.runs` (house style: small modules), which keeps the rows and
what it counts of them; :class:`~hybridq.forwarder.runs.RunTable` inherits :class:`RunFile`, so
it is opened, closed and used as before.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
from collections.abc import Iterator

from hybridq.errors import JournalIOError
from hybridq.journal.fileops import OS_FILEOPS

__all__ = ["RUNS_DIR", "RUNS_FILE", "RunFile"]

log = logging.getLogger("hybridq.forwarder")

#: The run table's directory under the journal.
RUNS_DIR = "runs"
RUNS_FILE = "runs.sqlite"
#: SQLite's "database or disk is full".
_SQLITE_FULL = 13
#: SQLite's primary codes for a damaged file: SQLITE_CORRUPT and SQLITE_NOTADB.
_DAMAGE = frozenset({11, 26})


def _free_name(path: str) -> str:
    """``path``, or ``path.2``, ``path.3``, ... the first not taken (an earlier one is kept)."""
    found, n = path, 1
    while os.path.lexists(found):
        n += 1
        found = f"{path}.{n}"
    return found


_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL,
    queue TEXT NOT NULL,
    ord REAL NOT NULL,
    prio INTEGER NOT NULL DEFAULT 0,
    lkey TEXT NOT NULL DEFAULT '',
    lane TEXT NOT NULL DEFAULT '',
    back INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (chain, seg, off)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""
#: The selection's indexes (covering: a limit key the gate refuses is skipped inside the index).
#: ``aged``: each queue's rows in age order; ``picked``: each lane's rows by priority, then age.
_INDEXES = """
DROP INDEX IF EXISTS ready;
CREATE INDEX IF NOT EXISTS aged ON runs(queue, ord, chain, seg, off, lkey, prio);
CREATE INDEX IF NOT EXISTS picked ON runs(queue, lane, prio DESC, ord, chain, seg, off, lkey);
CREATE INDEX IF NOT EXISTS taken_back ON runs(back) WHERE back > 0;
"""
#: The rows per queue and priority, written with the rows at each commit, so that a start reads
#: a dozen numbers, not every row (issue 29: a GROUP BY over a million rows took about 3 s before
#: the first push). A version that does not keep them must not write the rows: the guard
#: (``_GUARD``) names a function only this connection has. Counted once from the rows in a file
#: that has none yet (written before them), in one transaction.
_COUNTS = """
BEGIN;
CREATE TABLE IF NOT EXISTS counts (
    queue TEXT NOT NULL, prio INTEGER NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (queue, prio)) WITHOUT ROWID;
DELETE FROM counts;
INSERT INTO counts SELECT queue, prio, count(*) FROM runs GROUP BY queue, prio;
INSERT OR REPLACE INTO meta VALUES ('counts', '1');
COMMIT;
"""
#: The counts' guard: an index that never holds a row (``back`` is never negative), whose
#: condition names ``hq_counts_kept``. Every insert, delete or update of a row by key prepares that
#: condition, so a connection without the function (a version that does not keep the counts)
#: fails at its first write ("unknown function: hq_counts_kept()", one line, exit 1); on this
#: connection ``back < 0`` is false first and the function is never called. It replaced two
#: triggers that called the function for every row in and out, about 12k instructions a job
#: (docs/benchmarks.md, "The forwarder's writes per job, again"); a file that has them gets the
#: index, then loses them, in one transaction (the index's build reads the rows once: 0.12 s for
#: a million rows, warm). Not guarded: a ``DELETE FROM runs`` with no ``WHERE`` (SQLite empties the
#: table without the index; no hybridq version issues one).
_GUARD = """
BEGIN;
CREATE INDEX IF NOT EXISTS counts_kept ON runs(back) WHERE back < 0 AND hq_counts_kept();
DROP TRIGGER IF EXISTS counts_kept_in;
DROP TRIGGER IF EXISTS counts_kept_out;
COMMIT;
"""
#: Columns added to a file written before they existed (``ALTER TABLE ... ADD COLUMN``: O(1)).
_ADDED = (
    ("prio", "INTEGER NOT NULL DEFAULT 0"),
    ("lkey", "TEXT NOT NULL DEFAULT ''"),
    ("lane", "TEXT NOT NULL DEFAULT ''"),
    ("back", "INTEGER NOT NULL DEFAULT 0"),
)


class RunFile:
    """The run table's file (see the module docstring).

    Its state is :class:`~hybridq.forwarder.runs.RunTable`'s, which inherits it.
    """

    path: str
    _db: sqlite3.Connection | None

    def open(self) -> None:
        """Open (or create) the file; a damaged one is moved aside (logged: no job is lost)."""
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700, exist_ok=True)
            OS_FILEOPS.fsync_dir(os.path.dirname(directory))
        try:
            self._connect()
        except sqlite3.DatabaseError as exc:
            self.close()
            code = getattr(exc, "sqlite_errorcode", None)
            if code is not None and code & 0xFF not in _DAMAGE:
                with self.errors():  # a full or failing disk: the file is kept, as it is healthy
                    raise
            aside = _free_name(f"{self.path}.damaged")
            log.error(
                "run table %s is damaged (%s): moved to %s; the reconcile pass delivers the "
                "jobs it held again",
                self.path,
                exc,
                aside,
            )
            os.replace(self.path, aside)
            for suffix in ("-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.unlink(self.path + suffix)
            with self.errors():
                self._connect()

    def _connect(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db = db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA cache_size=-8000")  # 8 MB of page cache, whatever the backlog
        db.create_function("hq_counts_kept", 0, _counts_kept, deterministic=True)
        db.executescript(_SCHEMA)
        _migrate(db)
        db.executescript(_INDEXES)
        db.executescript(_GUARD)
        if db.execute("SELECT 1 FROM meta WHERE name = 'counts'").fetchone() is None:
            db.executescript(_COUNTS)
        # The file and its WAL exist now: their entries are durable before any row is trusted
        # (rows fsync'd into a file a power cut unlinks would be jobs read as pushed).
        OS_FILEOPS.fsync_dir(os.path.dirname(self.path))
        self._reset()  # (sqlite3.DatabaseError: open() moves a damaged file aside)

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """SQLite's errors as the journal's: one line and exit, or a disk-full pause (ENOSPC).

        A traceback and a restart would only meet the same error again (a crash loop).
        """
        try:
            yield
        except sqlite3.Error as exc:
            full = getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL
            if full and self._db is not None and not self._db.in_transaction:
                # SQLite rolled the whole transaction back (a full disk under its cache's spill):
                # begin again with the counts the file has, or the next statements would each
                # commit alone -- rows without their counts, never pushed after a crash.
                with contextlib.suppress(sqlite3.Error):
                    self._reset()
            cause = OSError(errno.ENOSPC if full else errno.EIO, f"{exc} (docs/forwarder.md, the run table)")
            raise JournalIOError(self.path, "the run table", cause) from exc

    def close(self) -> None:
        """Commit what is pending and close. Idempotent."""
        if self._db is not None:
            try:
                if self._db.in_transaction:
                    self._db.execute("COMMIT")
            finally:
                self._db.close()
                self._db = None

    @property
    def is_open(self) -> bool:
        """Whether :meth:`open` opened the file and :meth:`close` has not closed it since."""
        return self._db is not None

    @property
    def db(self) -> sqlite3.Connection:
        """The open connection (always inside a transaction that :meth:`commit` ends)."""
        assert self._db is not None, "the run table is not open"
        return self._db

    def _reset(self) -> None:
        """Begin a transaction and read the counts (:class:`~hybridq.forwarder.runs.RunTable`'s)."""
        raise NotImplementedError


def _counts_kept() -> int:
    """The guard's function (see ``_GUARD``): present on this version's connections only."""
    return 1


def _migrate(db: sqlite3.Connection) -> None:
    """Add the columns a file written before priorities lacks (its rows: priority 0, no key)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    for name, kind in _ADDED:
        if name not in have:
            db.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")
