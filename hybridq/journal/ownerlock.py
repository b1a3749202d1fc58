"""Owner locks: a lock file that makes one process the only owner of a directory, and says who.

The owner holds an exclusive ``flock`` on the file for as long as it runs and writes
``"<owner> pid <pid> on <host>"`` into it, so whoever finds it locked can say who holds it (the
kernel drops the lock when the owner dies, so a stale file never locks anyone out). The layer
above names the file and the owner; this module only knows the protocol.

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator, Sequence

from hybridq.errors import JournalLocked

from .fileops import OS_FILEOPS, SAFE_FLAGS, FileOps

__all__ = ["hold_owner_locks", "lock_owner", "take_owner_lock"]

#: How much of a lock file is read to name its holder.
_HOLDER_BYTES = 512


def _holder(fd: int, unknown: str) -> str:
    return os.pread(fd, _HOLDER_BYTES, 0).decode(errors="replace").strip() or unknown


def take_owner_lock(
    path: str,
    *,
    owner: str,
    busy: str,
    patience_s: float = 0.0,
    dir_fd: int | None = None,
    fileops: FileOps = OS_FILEOPS,
) -> int:
    """Lock ``path`` (created when missing) exclusively and write who holds it; returns the fd.

    Args:
        path: the lock file.
        owner: who takes it, as written into the file (``"<owner> pid <pid> on <host>"``).
        busy: what the refusal says after the holder's name (why only one may hold it).
        patience_s: keep retrying this long (a process probing the lock for an instant, as
            :func:`lock_owner` does, must not make a starting owner give up).
        dir_fd: open the file by its name in this directory (not through the path).
        fileops: the file-operations seam (opens through it only without ``dir_fd``).

    Raises:
        JournalLocked: another process holds it; its message names the holder.
    """
    flags = os.O_RDWR | os.O_CREAT
    if dir_fd is not None:
        fd = os.open(os.path.basename(path), flags | SAFE_FLAGS, 0o600, dir_fd=dir_fd)
    else:
        fd = fileops.open(path, flags, 0o600)
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fileops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            holder = _holder(fd, "another process")
            fileops.close(fd)
            raise JournalLocked(path, f"{holder} ({busy})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{owner} pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def lock_owner(path: str) -> str | None:
    """Who holds the owner lock ``path``, or ``None`` when nobody does (or there is no file)."""
    try:
        fd = os.open(path, os.O_RDONLY | SAFE_FLAGS)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd, "unknown")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def hold_owner_locks(
    paths: Sequence[str], *, owner: str, busy: str, create: bool, fileops: FileOps = OS_FILEOPS
) -> Iterator[None]:
    """Hold the owner locks ``paths`` for the duration, refusing if any is held.

    ``create``: take the first one as :func:`take_owner_lock` does (created when missing, and
    naming ``owner``). The others, and the first one without ``create``, are only locked when
    they exist: with no lock file there is no owner to keep out, and nothing is written.

    Raises:
        JournalLocked: another process holds one of them.
    """
    fds: list[int] = []
    try:
        for n, lock in enumerate(paths):
            if create and n == 0:
                fds.append(take_owner_lock(lock, owner=owner, busy=busy, fileops=fileops))
                continue
            try:
                fd = fileops.open(lock, os.O_RDONLY)
            except FileNotFoundError:
                continue
            fds.append(fd)
            try:
                fileops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise JournalLocked(lock, f"{_holder(fd, 'another process')} ({busy})") from None
        yield
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                fileops.close(fd)
