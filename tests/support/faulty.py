"""A :class:`FileOps` that injects I/O errors, for the S7 tests (docs/reliability.md).

:class:`FaultyFileOps` counts every call of the operations below and makes the ``nth`` call of
one chosen operation raise ``OSError(err)`` (``errno.EIO`` or ``errno.ENOSPC``), then behaves
normally again (or keeps failing for ``count`` consecutive calls). With ``torn=True`` a failing
``write`` first writes the first half of its data, as a device that fails part-way would.
Nothing else is changed: every other call goes straight to the real :class:`FileOps`.
:class:`CallSpy` only lists the calls, for tests of an order of operations.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from typing import Any

from hybridq.journal.fileops import FileOps

#: The operations whose calls are counted and can be made to fail.
FAULTABLE = ("open", "write", "fdatasync", "fsync", "replace", "fsync_dir")


class FaultyFileOps(FileOps):
    """Fail call number ``nth`` (1-based) of ``op`` with ``OSError(err)``.

    Args:
        op: one of :data:`FAULTABLE`, or ``None`` to only count calls.
        nth: which call of ``op`` fails first.
        err: the errno raised, ``errno.EIO`` or ``errno.ENOSPC``.
        count: how many consecutive calls fail from the ``nth`` on.
        torn: for ``write`` only: write half of the data before raising.

    Attributes:
        calls: calls seen so far, per operation.
        injected: how many errors were raised.
    """

    def __init__(
        self,
        op: str | None = None,
        nth: int = 1,
        err: int = errno.EIO,
        *,
        count: int = 1,
        torn: bool = False,
    ) -> None:
        if op is not None and op not in FAULTABLE:
            raise ValueError(f"cannot inject into {op!r}; choose from {FAULTABLE}")
        if err not in (errno.EIO, errno.ENOSPC):
            raise ValueError("inject EIO or ENOSPC")
        self.op, self.nth, self.err, self.count, self.torn = op, nth, err, count, torn
        self.calls: Counter[str] = Counter()
        self.injected = 0

    def _fails(self, op: str) -> bool:
        self.calls[op] += 1
        return op == self.op and self.nth <= self.calls[op] < self.nth + self.count

    def _raise(self) -> None:
        self.injected += 1
        raise OSError(self.err, os.strerror(self.err))

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if self._fails("open"):
            self._raise()
        return super().open(path, flags, mode)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self._fails("write"):
            if self.torn and len(data) > 1:
                super().write(fd, memoryview(data)[: len(data) // 2])
            self._raise()
        return super().write(fd, data)

    def fdatasync(self, fd: int) -> None:
        if self._fails("fdatasync"):
            self._raise()
        super().fdatasync(fd)

    def fsync(self, fd: int) -> None:
        if self._fails("fsync"):
            self._raise()
        super().fsync(fd)

    def replace(self, src: str, dst: str) -> None:
        if self._fails("replace"):
            self._raise()
        super().replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        if self._fails("fsync_dir"):
            self._raise()
        super().fsync_dir(path)


class CallSpy(FileOps):
    """Lists the calls made, by name, and where each ``write`` starts and ends in its file."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.spans: list[tuple[int, int]] = []

    def __getattribute__(self, name: str) -> object:
        attr = super().__getattribute__(name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args: Any) -> object:
            self.names.append(name)
            if name == "write":
                at = os.lseek(args[0], 0, os.SEEK_CUR)
                self.spans.append((at, at + len(args[1])))
            return attr(*args)

        return call
