"""Which errno an SQLite error of a journal file stands for: a full disk (a pause) or not (a stop).

The forwarder pauses on a full disk (ENOSPC, EDQUOT) and stops on any other I/O error
(docs/operations.md, "Disk full"). SQLite reports a write that met ENOSPC as ``SQLITE_FULL``;
a quota (EDQUOT), and ENOSPC met by an fsync, a truncate or the growth of its ``-shm`` file,
arrive as an ``SQLITE_IOERR_*`` whose errno Python's ``sqlite3`` does not expose. For those, a
probe asks the file system itself: if :data:`PROBE_BYTES` cannot be allocated in the file's
directory now, the error is taken for that errno (ENOSPC or EDQUOT); otherwise it is EIO.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import uuid

__all__ = ["FULL_ERRNOS", "PROBE_BYTES", "full_disk_errno", "remove_probes", "sqlite_errno"]

log = logging.getLogger("hybridq.ledger")

#: The probe files' names start so (a dot: no journal reader lists them).
PROBE_PREFIX = ".space-probe-"

#: The primary result codes (``sqlite_errorcode & 0xFF``) looked at here.
SQLITE_IOERR = 10
SQLITE_FULL = 13
#: What the probe allocates: more than a WAL frame or a ``-shm`` page needs (a few KB each).
PROBE_BYTES = 64 * 1024
#: The errnos that mean a full disk or quota.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def sqlite_errno(exc: sqlite3.Error, directory: str | None) -> int:
    """ENOSPC for ``SQLITE_FULL``; for an I/O error, what :func:`full_disk_errno` finds; else EIO.

    ``directory``: where the database file is (``None``: in memory, never a full disk).
    """
    code = getattr(exc, "sqlite_errorcode", None)
    if code is None:
        return errno.EIO
    if code & 0xFF == SQLITE_FULL:
        return errno.ENOSPC
    if code & 0xFF == SQLITE_IOERR and directory is not None:
        return full_disk_errno(directory) or errno.EIO
    return errno.EIO


def full_disk_errno(directory: str) -> int | None:
    """ENOSPC or EDQUOT if :data:`PROBE_BYTES` cannot be allocated in ``directory`` now, else None.

    The probe file (``.space-probe-*``, private, never followed through a symlink) is removed
    at once; the journal's readers ignore names that are not segments. One left behind (a kill
    before its unlink, or an unlink that failed: the answer is kept, not replaced by that
    error) is removed by the forwarder's next open (:func:`remove_probes`).
    """
    path = os.path.join(directory, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # no inode left is a full disk too
        return exc.errno if exc.errno in FULL_ERRNOS else None
    try:
        os.posix_fallocate(fd, 0, PROBE_BYTES)
    except OSError as exc:
        return exc.errno if exc.errno in FULL_ERRNOS else None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
    return None


def remove_probes(directory: str) -> None:
    """Remove the probe files left in ``directory`` (the forwarder's open, under its lock).

    A probe that cannot be removed is logged and left: 64 KB is no reason not to start.
    """
    for name in os.listdir(directory):
        if name.startswith(PROBE_PREFIX):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("a space probe left in %s could not be removed: %s", directory, exc)
