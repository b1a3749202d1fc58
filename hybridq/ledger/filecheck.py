"""An SQLite file's integrity check, off the forwarder's start path.

``PRAGMA quick_check`` reads the whole file: 0.37 s for the lookup index at a million jobs,
0.17-0.20 s per million keys for the key table (docs/benchmarks.md); at open it held the first
push back by that much. It runs here on a thread of its own, over a read-only connection of its
own (SQLite lets go of the GIL while it reads, and WAL mode lets it read beside the forwarder's
writes). Its users say what is trusted until the verdict: the lookup index counts as rebuilt
(:attr:`hybridq.lookup.index.LookupIndex.building`), the key table's reads wait for it
(:meth:`hybridq.ledger.tablefile.TableFile.confirm`); a damaged file is replaced and rebuilt, as
at open. Only SQLite's "corrupt" and "not a database" (or rows other than ``ok``) are damage: a
check that cannot run (busy, locked, cannot open, an I/O error) is tried again a few times, then
reported as :attr:`FileCheck.error`, never as damage (a sound file must not be deleted).

This module must not import redis or rq.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["FileCheck"]

log = logging.getLogger("hybridq.forwarder")

#: SQLite's primary result codes that say the file itself is damaged.
DAMAGE_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB
#: Tries of a check that could not run, and the pause before each try again (seconds).
TRIES = 3
RETRY_PAUSE = 0.2


def is_damage(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says the file is damaged (not that it could not be read now)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in DAMAGE_CODES


def readonly_uri(path: str) -> str:
    """The ``file:`` URI opening ``path`` read-only: quoted, so ``#``, ``?`` and ``%`` stay in the name."""
    return Path(os.path.abspath(path)).as_uri() + "?mode=ro"


class FileCheck:
    """One ``quick_check`` of the SQLite file at ``path``, on its own thread.

    Args:
        path: the file.
        done: called (on the check's thread) once the verdict is in: the forwarder's wake-up, so
            an idle loop looks at it at once. Must be safe from another thread.
        name: the thread's name.
    """

    def __init__(
        self, path: str, done: Callable[[], None] | None = None, name: str = "hybridq-file-check"
    ) -> None:
        self.path = path
        self._done = done
        self._problem: str | None = None
        #: Why the check could not run (a verdict of ``""``, not one about the file), if it could not.
        self.error: sqlite3.Error | None = None
        self._finished = threading.Event()
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # the connection, between the check and stop()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the check (returns at once)."""
        self._thread.start()

    def verdict(self) -> str | None:
        """``None`` while it runs; then ``""`` for a sound file (or see :attr:`error`), else its damage."""
        return self._problem if self._finished.is_set() else None

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait up to ``timeout`` seconds for the verdict (tests, and a close that needs one)."""
        self._finished.wait(timeout)
        return self.verdict()

    def stop(self) -> None:
        """Interrupt the check and wait for its thread (the index is being closed)."""
        with self._lock:
            self._stopped = True
            if self._db is not None:
                self._db.interrupt()  # thread-safe: the running statement ends with an error
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        problem = ""
        try:
            problem = self._attempts()
        except BaseException as exc:  # a bug, a MemoryError: no verdict, never a reader left waiting
            self.error = sqlite3.OperationalError(f"the check itself failed: {exc!r}")
        finally:
            if self._stopped:
                problem, self.error = "", None  # interrupted: no verdict (nobody asks for one)
            self._problem = problem
            self._finished.set()
        if self._done is not None and not self._stopped:
            self._done()

    def _attempts(self) -> str:
        """The check, tried up to :data:`TRIES` times: its problem (``""``: sound or no verdict)."""
        problem = ""
        for attempt in range(TRIES):
            try:
                problem, self.error = self._check(), None
                break
            except sqlite3.Error as exc:
                if is_damage(exc):  # e.g. "database disk image is malformed" before any row
                    problem, self.error = str(exc), None
                    break
                self.error = exc  # busy, locked, cannot open, I/O: no verdict about the file
            finally:
                with self._lock:
                    if self._db is not None:
                        self._db.close()
                        self._db = None
            if self._stopped:
                break
            if attempt + 1 < TRIES:
                time.sleep(RETRY_PAUSE)
        return problem

    def _check(self) -> str:
        with self._lock:
            if self._stopped:
                return ""
            self._db = sqlite3.connect(
                readonly_uri(self.path), uri=True, timeout=5.0, check_same_thread=False
            )
            db = self._db
        rows = [str(row[0]) for row in db.execute("PRAGMA quick_check").fetchall()]
        return "" if rows == ["ok"] else "; ".join(rows)[:500]
