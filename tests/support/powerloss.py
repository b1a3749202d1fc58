"""Simulated power loss for the journal's file-operations seam (docs/reliability.md S3, S4, S13).

:class:`PowerLossFileOps` is modelled on RocksDB's ``FaultInjectionTestFS`` and SQLite's crash
VFS. Every operation goes through to the real file system, while the class remembers what a real
disk would still hold after the power went out:

* per file, the size made durable by the last ``fdatasync``/``fsync`` (and the mode made durable
  by the last ``fsync``); an ``O_TRUNC`` open or an ``ftruncate`` is assumed to reach the disk at
  once (the ext4 "zero-length file" worst case) while the bytes written afterwards do not;
* per directory, the creates (of files and directories), renames and unlinks done since its last
  ``fsync_dir`` (fsync(2): the file's own fsync does not persist its directory entry), with a
  copy of the durable contents of a file a rename overwrote or an unlink removed, so that the
  operation can be undone. A rename across directories is two entries, an unlink in the source
  and a create in the destination, each undone unless its own directory was fsync'd: the file
  can come back in both, or be in neither (the source synced, the destination not). A directory
  whose create is undone goes with everything in it, while the other unsynced entries of its
  parent are kept (the worst order: nothing but the parent's fsync orders them).

:meth:`PowerLossFileOps.crash` then turns the real files into a state the disk could be in after
power loss: it closes the file behind every fd handed out (which releases their flocks, so the
writer is "dead"; the fd numbers stay taken, on /dev/null, until :meth:`release`),
loses the unsynced bytes of every file (``drop``: cut at the durable size; ``tear``: keep a random
prefix of them; ``garble``: overwrite them, or a random part of them, with random bytes), keeps or
reverts each unsynced mode change at random, and undoes, newest first, every directory operation
no ``fsync_dir`` made durable. From then on every call raises ``OSError(EIO)``, so a writer that
is still running can neither write nor close an fd number the OS may have reused. One lock is
taken by every operation and by the crash, so a crash from another thread is atomic with respect
to them. Only ``LOCK_NB`` flocks may go through this class (a blocking one would hold the lock).

``crash_at=N`` makes the class crash itself (in ``crash_mode``) when the (N+1)-th operation
starts, after N have completed; sweeping N over a workload's :attr:`op_count` crashes after each
step of a protocol (S13). Real ``fsync`` calls are skipped unless ``real_sync=True``: durability
here is simulated, so they would only cost time.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import threading
from dataclasses import dataclass

from hybridq.journal.fileops import FileOps

__all__ = ["MODES", "PowerLossFileOps"]

#: What happens to the bytes written since a file's last sync.
MODES = ("drop", "tear", "garble")


@dataclass
class _File:
    """What the simulated disk holds durably for one file (followed across renames)."""

    path: str
    durable_size: int
    mode: int
    durable_mode: int


@dataclass
class _DirOp:
    """A create, rename or unlink in ``directory`` that no ``fsync_dir`` has made durable yet."""

    directory: str
    kind: str  # "create" | "mkdir" | "rename" (in one directory) | "unlink"
    path: str  # the created / renamed-to / unlinked name
    src: str = ""  # for renames: the old name
    saved: tuple[bytes, int] | None = None  # durable contents and mode of what was overwritten


def _eio() -> OSError:
    return OSError(errno.EIO, "simulated power loss: the machine is off")


class PowerLossFileOps(FileOps):
    """A :class:`FileOps` that can simulate power loss (see the module docstring).

    Args:
        crash_at: crash when the operation after this many completed ones starts (None: never).
        crash_mode: the mode of that crash, one of :data:`MODES`.
        rng: randomness for crashes (tear points, garbage bytes, mode changes).
        real_sync: also call the real ``fsync``/``fdatasync`` (slower; changes nothing simulated).
    """

    def __init__(
        self,
        *,
        crash_at: int | None = None,
        crash_mode: str = "drop",
        rng: random.Random | None = None,
        real_sync: bool = False,
    ) -> None:
        if crash_mode not in MODES:
            raise ValueError(f"unknown crash mode {crash_mode!r}")
        self.crash_at = crash_at
        self.crash_mode = crash_mode
        self.rng = rng or random.Random(0)
        self.real_sync = real_sync
        self.op_count = 0  # operations started (and not refused) so far
        self.crashed = False
        self._lock = threading.RLock()
        self._fds: dict[int, _File] = {}
        self._files: dict[str, _File] = {}  # current path -> file
        self._pending: list[_DirOp] = []  # oldest first
        self._zombies: list[int] = []  # fds of the crashed machine, now on /dev/null

    # -- bookkeeping ---------------------------------------------------------------------------

    def _begin(self) -> None:
        """Refuse every call after a crash; crash here if this is the armed operation."""
        if self.crashed:
            raise _eio()
        if self.crash_at is not None and self.op_count >= self.crash_at:
            self._crash(self.crash_mode, self.rng)
            raise _eio()
        self.op_count += 1

    def _track(self, path: str) -> _File:
        """The record of an existing file; one seen for the first time counts as durable."""
        f = self._files.get(path)
        if f is None:
            st = os.stat(path, follow_symlinks=False)
            f = self._files[path] = _File(
                path, st.st_size, stat.S_IMODE(st.st_mode), stat.S_IMODE(st.st_mode)
            )
        return f

    def _durable_copy(self, path: str) -> tuple[bytes, int]:
        """The contents and mode the disk holds durably for ``path`` (before it goes away)."""
        f = self._track(path)
        with open(path, "rb") as fh:
            return fh.read(f.durable_size), f.durable_mode

    # -- the FileOps interface -----------------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        with self._lock:
            self._begin()
            path = os.path.abspath(path)
            existed = os.path.lexists(path)
            fd = super().open(path, flags, mode)
            if existed:
                f = self._track(path)
                if flags & os.O_TRUNC:
                    f.durable_size = 0
            else:
                perm = stat.S_IMODE(os.fstat(fd).st_mode)
                f = self._files[path] = _File(path, 0, perm, perm)
                self._pending.append(_DirOp(os.path.dirname(path), "create", path))
            self._fds[fd] = f
            return fd

    def read(self, fd: int, size: int) -> bytes:
        with self._lock:
            self._begin()
            return super().read(fd, size)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        with self._lock:
            self._begin()
            return super().write(fd, data)

    def fdatasync(self, fd: int) -> None:
        with self._lock:
            self._begin()
            if self.real_sync:
                super().fdatasync(fd)
            self._fds[fd].durable_size = os.fstat(fd).st_size

    def fsync(self, fd: int) -> None:
        with self._lock:
            self._begin()
            if self.real_sync:
                super().fsync(fd)
            f = self._fds[fd]
            f.durable_size, f.durable_mode = os.fstat(fd).st_size, f.mode

    def ftruncate(self, fd: int, length: int) -> None:
        with self._lock:
            self._begin()
            super().ftruncate(fd, length)
            f = self._fds[fd]
            f.durable_size = min(f.durable_size, length)

    def fchmod(self, fd: int, mode: int) -> None:
        with self._lock:
            self._begin()
            super().fchmod(fd, mode)
            self._fds[fd].mode = stat.S_IMODE(os.fstat(fd).st_mode)

    def close(self, fd: int) -> None:
        with self._lock:
            self._begin()
            self._fds.pop(fd, None)
            super().close(fd)

    def flock(self, fd: int, operation: int) -> None:
        with self._lock:
            self._begin()
            super().flock(fd, operation)

    def replace(self, src: str, dst: str) -> None:
        with self._lock:
            self._begin()
            src, dst = os.path.abspath(src), os.path.abspath(dst)
            moving = self._track(src)
            saved = self._durable_copy(dst) if os.path.lexists(dst) else None
            # Across directories: what the source loses, as the disk holds it at the rename.
            source = self._durable_copy(src) if os.path.dirname(src) != os.path.dirname(dst) else None
            super().replace(src, dst)
            self._files.pop(dst, None)
            del self._files[src]
            moving.path, self._files[dst] = dst, moving
            if source is None:
                self._pending.append(_DirOp(os.path.dirname(dst), "rename", dst, src, saved))
            else:
                self._pending.append(_DirOp(os.path.dirname(src), "unlink", src, saved=source))
                self._pending.append(_DirOp(os.path.dirname(dst), "create", dst, saved=saved))

    def unlink(self, path: str) -> None:
        with self._lock:
            self._begin()
            path = os.path.abspath(path)
            saved = self._durable_copy(path)
            super().unlink(path)
            del self._files[path]
            self._pending.append(_DirOp(os.path.dirname(path), "unlink", path, saved=saved))

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        with self._lock:
            self._begin()
            path = os.path.abspath(path)
            super().mkdir(path, mode)
            self._pending.append(_DirOp(os.path.dirname(path), "mkdir", path))

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            self._begin()
            if self.real_sync:
                super().fsync_dir(path)
            path = os.path.abspath(path)
            self._pending = [op for op in self._pending if op.directory != path]

    # -- the crash -----------------------------------------------------------------------------

    def crash(self, mode: str, rng: random.Random) -> None:
        """Cut the power now (see the module docstring); every later call raises EIO."""
        if mode not in MODES:
            raise ValueError(f"unknown crash mode {mode!r}")
        with self._lock:
            if self.crashed:
                raise RuntimeError("already crashed")
            self._crash(mode, rng)

    def release(self) -> None:
        """After a crash, once nothing uses them any more: close the fds left on /dev/null."""
        with self._lock:
            for fd in self._zombies:
                os.close(fd)
            self._zombies = []

    def _crash(self, mode: str, rng: random.Random) -> None:
        self.crashed = True
        # Close every file the writer had open (releasing its flocks: it is dead now), but keep
        # the fd numbers taken, pointing at /dev/null, so a stray os.fstat() of a writer still
        # running neither fails nor reaches a file that reused the number. release() frees them.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in self._fds:
            os.dup2(devnull, fd)
        os.close(devnull)
        self._zombies, self._fds = list(self._fds), {}
        for f in self._files.values():
            size = os.stat(f.path, follow_symlinks=False).st_size
            if size > f.durable_size:
                os.chmod(f.path, 0o600)  # a sealed (0400) file may have lost bytes too
                self._lose_unsynced(f, size, mode, rng)
            # An unsynced mode change may or may not have reached the disk.
            os.chmod(f.path, f.mode if rng.random() < 0.5 else f.durable_mode)
        # Nothing but an fsync of its parent orders a new directory's entry before the parent's
        # other entries: the worst case is taken, those kept and the new directory gone.
        fresh = {op.directory for op in self._pending if op.kind == "mkdir"}
        for op in reversed(self._pending):
            if op.directory in fresh and op.kind != "mkdir":
                continue
            if op.kind == "create":
                os.unlink(op.path)
            elif op.kind == "mkdir":
                shutil.rmtree(op.path)
            elif op.kind == "rename":
                os.replace(op.path, op.src)
            if op.saved is not None:  # the overwritten target or the unlinked file comes back
                data, file_mode = op.saved
                fd = os.open(op.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, data)
                os.fchmod(fd, file_mode)
                os.close(fd)
        self._pending.clear()
        self._files.clear()

    @staticmethod
    def _lose_unsynced(f: _File, size: int, mode: str, rng: random.Random) -> None:
        """Drop, tear or garble the bytes of ``f`` past its durable size."""
        if mode == "drop":
            os.truncate(f.path, f.durable_size)
        elif mode == "tear":
            os.truncate(f.path, f.durable_size + rng.randrange(size - f.durable_size + 1))
        else:
            start, end = f.durable_size, size
            if rng.random() < 0.5:  # only a random part of the unsynced bytes
                start = rng.randrange(start, end)
                end = rng.randrange(start, end) + 1
            fd = os.open(f.path, os.O_WRONLY)
            try:
                os.pwrite(fd, rng.randbytes(end - start), start)
            finally:
                os.close(fd)
