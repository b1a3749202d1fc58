"""The errors of the ledger tables' SQLite file, as the journal's, and the poison they set.

:class:`~hybridq.ledger.tablefile.TableFile` (the file's connection, mark and check) and its
tables wrap every method that reaches SQLite in :func:`mapped`: an SQLite error becomes the
``JournalIOError`` the forwarder already pauses on (a full disk) or stops on (anything else),
and poisons the file for the rest of the run (docs/reliability.md, "The key table"). A reader's
temporary database (``spill``) names the temporary directory instead, where its file is. Kept
apart from the file's class so its tables' modules and the file share one rule, without the
file's lifecycle. This module must not import redis or rq.
"""

from __future__ import annotations

import functools
import os
import sqlite3
from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar, cast

from hybridq.errors import JournalIOError
from hybridq.ledger.sqlite_errors import sqlite_errno

__all__ = ["KEYS_TABLE_FILE", "SPILL_OP", "Poisonable", "mapped", "spill_dir"]

P = ParamSpec("P")
R = TypeVar("R")

#: The file in the journal directory (its name from when it held only key owners).
KEYS_TABLE_FILE = "ledger-keys.sqlite"

#: The ``op`` of the JournalIOError of a reader's temporary database (``spill``).
SPILL_OP = "a reader's temporary table"


class Poisonable(Protocol):
    """What :func:`mapped` reads and sets of the file (:class:`~hybridq.ledger.tablefile.TableFile`)."""

    path: str | None
    spill: bool
    failed: bool
    error: JournalIOError | None

    @property
    def checking(self) -> bool:
        """Whether the deferred check's verdict has not been taken yet."""
        ...

    def confirm(self, *, wait: bool = True) -> None:
        """Take the deferred check's verdict (raises when the file is damaged or unchecked)."""
        ...


def spill_dir() -> str:
    """Where SQLite puts a temporary database's file: the first of its candidates it can write."""
    # Named, not used: SQLite makes the file (0600, O_EXCL, unlinked at once), this only says where.
    candidates = ("/var/tmp", "/usr/tmp", "/tmp")  # noqa: S108
    for where in (os.environ.get("SQLITE_TMPDIR"), os.environ.get("TMPDIR"), *candidates):
        if where and os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK):
            return where
    return "."


def mapped(method: Callable[P, R]) -> Callable[P, R]:
    """SQLite's errors as the journal's: ENOSPC (or EDQUOT) for a full disk, EIO otherwise.

    A failed statement or commit may roll the open transaction back: the rows of this run are
    then not all there, so a step retried in this run could miss an owner or a failure. The
    file is poisoned (:attr:`~hybridq.ledger.tablefile.TableFile.failed`): on a full disk the
    forwarder pauses and opens again as a start does, replaying the ledger after the saved index
    into the file; on any other error it stops and the next start does (docs/reliability.md, the
    key table). The method's object is the file or a table of it (its :attr:`file`).
    """

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except sqlite3.Error as exc:
            owner = cast("Poisonable", getattr(args[0], "file", args[0]))
            if owner.checking and not isinstance(exc, sqlite3.OperationalError):
                # Damage met before the check's verdict (corrupt, not a database): the verdict
                # decides, a damaged file is made again (confirm raises) rather than stopping
                # every start at the same page.
                owner.confirm()
            # Poisoned: rows of this run may be gone, so no mark (and no saved index) may vouch
            # for the file again in this run; the next start replays what it lost.
            owner.failed = True
            if owner.spill:  # a reader's temporary database: its file is in the temporary directory
                # No probe of the directory's room (it would leave files in a shared directory).
                cause = OSError(sqlite_errno(exc, None), f"{exc} (set SQLITE_TMPDIR or TMPDIR to move it)")
                owner.error = JournalIOError(spill_dir(), SPILL_OP, cause)
                raise owner.error from exc
            code = sqlite_errno(exc, None if owner.path is None else os.path.dirname(owner.path))
            cause = OSError(code, f"{exc} (docs/reliability.md, the key table)")
            owner.error = JournalIOError(KEYS_TABLE_FILE, "the key table", cause)
            raise owner.error from exc

    return call
