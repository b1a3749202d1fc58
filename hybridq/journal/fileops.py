"""The file-operations seam: every byte the journal writes goes through a :class:`FileOps`.

Tests swap in an implementation that injects I/O errors or simulates power loss (dropping,
tearing or garbling bytes that were never fsync'd, undoing creates and renames whose directory
was never fsync'd), in the spirit of RocksDB's ``FaultInjectionTestFS`` and SQLite's crash VFS.
The default is a thin layer over :mod:`os`.
"""

from __future__ import annotations

import fcntl
import os

__all__ = ["OS_FILEOPS", "FileOps", "write_all"]

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
