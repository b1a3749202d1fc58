"""The file-operations seam: every byte the journal writes goes through a :class:`FileOps`.

Tests swap in an implementation that injects I/O errors or simulates power loss (dropping,
tearing or garbling bytes that were never fsync'd, undoing creates and renames whose directory
was never fsync'd), in the spirit of RocksDB's ``FaultInjectionTestFS`` and SQLite's crash VFS.
The default is a thin layer over :mod:`os`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Sequence

from hybridq.errors import FileOpError, JournalIOError

__all__ = ["OS_FILEOPS", "FileOpError", "FileOps", "replace_durably", "write_all"]

#: Flags every journal file is opened with: no symlink following, not inherited by children.
SAFE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class FileOps:
    """Thin wrappers over the system calls the journal makes. Subclass to inject faults."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """``open(2)`` with ``O_NOFOLLOW | O_CLOEXEC`` added."""
        return os.open(path, flags | SAFE_FLAGS, mode)

    def read(self, fd: int, size: int) -> bytes:
        """``read(2)``."""
        return os.read(fd, size)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        """``write(2)``; may write less than asked (see :func:`write_all`)."""
        return os.write(fd, data)

    def fdatasync(self, fd: int) -> None:
        """``fdatasync(2)``: makes written data (and the file size) durable."""
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        """``fsync(2)``: makes written data and all inode metadata durable."""
        os.fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        """``ftruncate(2)``."""
        os.ftruncate(fd, length)

    def fchmod(self, fd: int, mode: int) -> None:
        """``fchmod(2)``."""
        os.fchmod(fd, mode)

    def close(self, fd: int) -> None:
        """``close(2)``."""
        os.close(fd)

    def flock(self, fd: int, operation: int) -> None:
        """``flock(2)``; raises :class:`BlockingIOError` when ``LOCK_NB`` would block."""
        fcntl.flock(fd, operation)

    def replace(self, src: str, dst: str) -> None:
        """``rename(2)`` (atomically replaces ``dst``); durable only after :meth:`fsync_dir`."""
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        """``unlink(2)``; durable only after :meth:`fsync_dir`."""
        os.unlink(path)

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        """``mkdir(2)``; durable only after :meth:`fsync_dir` of its parent."""
        os.mkdir(path, mode)

    def fsync_dir(self, path: str) -> None:
        """Fsync a directory, making creates, renames and unlinks in it durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | SAFE_FLAGS)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: The default, real implementation.
OS_FILEOPS = FileOps()


def write_all(ops: FileOps, fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data``, looping over short writes (docs/reliability.md rule 2).

    Raises the :class:`OSError` of the call that failed; the caller decides what a partial write
    means for the file (the writer truncates back or abandons the segment).
    """
    view = memoryview(data)
    while view:
        written = ops.write(fd, view)
        if written <= 0:  # pragma: no cover - write(2) returns -1 via OSError, never 0 for files
            raise OSError(5, "write returned 0")
        view = view[written:]


def replace_durably(
    ops: FileOps,
    path: str,
    fill: Callable[[int], object],
    *,
    tmp: str | None = None,
    flags: int = os.O_TRUNC,
    keep_open: bool = False,
    also_sync: Sequence[str] = (),
) -> int:
    """Durably make ``path`` the file ``fill(fd)`` writes (docs/reliability.md rules 5 and 6).

    Temp file, ``fill``, fsync, rename over ``path``, fsync of ``path``'s directory (then of each
    directory in ``also_sync``): after a crash at any point ``path`` is either whole and old or
    whole and new. With ``tmp=path`` the file is created in place (pass ``os.O_EXCL``) and
    there is no rename. Every step goes through ``ops`` (the fault-injection seam).

    Args:
        ops: the file-operations seam.
        path: the file to create or replace.
        fill: writes the contents to the fd; a :class:`FileOpError` it raises names its op,
            any other :class:`OSError` is a failed ``write``.
        tmp: the temp file (default ``path + ".tmp"``).
        flags: added to ``O_WRONLY | O_CREAT`` when creating the temp file.
        keep_open: return the fd (the caller closes it) instead of closing it; it is closed
            when this raises.
        also_sync: more directories to fsync once the rename is durable.

    Returns:
        The fd when ``keep_open``, else ``-1``.

    Raises:
        JournalIOError: a step failed (its ``op`` says which); ``path`` was not replaced unless
            the op is ``directory fsync``.
    """
    tmp = path + ".tmp" if tmp is None else tmp
    op = "create"
    try:
        fd = ops.open(tmp, os.O_WRONLY | os.O_CREAT | flags, 0o600)
        try:
            op = "write"
            fill(fd)
            op = "fsync"
            ops.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                ops.close(fd)
            raise
        if not keep_open:
            ops.close(fd)
            fd = -1
        try:
            if tmp != path:
                op = "rename"
                ops.replace(tmp, path)
            op = "directory fsync"
            ops.fsync_dir(os.path.dirname(path))
            for directory in also_sync:
                ops.fsync_dir(directory)
        except BaseException:
            if keep_open:
                with contextlib.suppress(OSError):
                    ops.close(fd)
            raise
    except FileOpError as exc:
        raise JournalIOError(path, exc.op, exc.cause) from exc.cause
    except OSError as exc:
        raise JournalIOError(path, op, exc) from exc
    return fd
