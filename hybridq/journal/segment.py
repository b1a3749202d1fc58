"""An open segment's state, and sealing a segment (shared by the writer and recovery).

Format: ``docs/journal-format.md`` (*Seal*). This module must not import redis, rq, click or the
job envelope.
"""

from __future__ import annotations

import contextlib
import os
from _thread import LockType

from hybridq.errors import JournalIOError, SealError

from .fileops import FileOps, write_all
from .format import SEAL_RECORDS, RecordType, encode_records, encode_seal, salt_seed

__all__ = [
    "OpenSegment",
    "SealError",
    "as_oserror",
    "close_quietly",
    "seal_fd",
    "set_read_only",
]


class OpenSegment:
    """An open segment file and its group-commit state (guarded by the writer's condition)."""

    __slots__ = (
        "data_count",
        "error",
        "fd",
        "gens",
        "index",
        "last_data_seq",
        "next_seq",
        "open_gen",
        "path",
        "salt",
        "seed",
        "size",
        "synced_gen",
        "synced_seq",
        "syncing",
        "writer_id",
        "written_seq",
    )

    def __init__(
        self, *, fd: int, path: str, writer_id: str, index: int, salt: bytes, first_seq: int
    ) -> None:
        self.fd = fd
        self.path = path
        self.writer_id = writer_id
        self.index = index
        self.salt = salt
        self.seed = salt_seed(salt)
        self.next_seq = first_seq
        self.size = 0
        self.data_count = 0
        self.last_data_seq = 0
        self.written_seq = first_seq - 1  # highest sequence fully written to the fd
        self.synced_seq = first_seq - 1  # highest sequence covered by a completed fsync
        self.syncing = False  # an fsync (or a seal) is running on fd
        self.error: JournalIOError | None = None  # set once: the segment is poisoned
        # Group commit by generation: appends join ``open_gen``; the fsync that covers them
        # starts by closing it (``open_gen += 1``); ``synced_gen`` is the last one completed.
        # Each waiting appender parks on a lock of its own, listed under its generation, so an
        # fsync wakes only the appenders it covered (they return without taking the sync lock
        # again), plus one appender of the next generation to lead its fsync.
        self.open_gen = 1
        self.synced_gen = 0
        self.gens: dict[int, list[LockType]] = {}


def as_oserror(exc: BaseException) -> OSError:
    """``exc`` itself if it is an OSError, else an OSError describing it (for JournalIOError)."""
    return exc if isinstance(exc, OSError) else OSError(0, f"{type(exc).__name__}: {exc}")


def seal_fd(
    ops: FileOps,
    fd: int,
    seed: int,
    next_seq: int,
    last_data_seq: int,
    data_count: int,
    *,
    synced_seq: int | None = None,
) -> int:
    """Seal an open segment: two seal records, then :func:`make_read_only`. Returns bytes written."""
    payload = encode_seal(last_data_seq, data_count)
    blob = encode_records(seed, next_seq, RecordType.SEAL, [payload] * SEAL_RECORDS, synced_seq=synced_seq)
    op = "stat"
    try:
        start = os.fstat(fd).st_size
        op = "write"
        try:
            write_all(ops, fd, blob)
        except OSError:
            # Rule 2: take a partial seal back off, so the segment simply ends unsealed; if
            # that fails too, recovery treats the partial seal as a torn tail.
            with contextlib.suppress(OSError):
                ops.ftruncate(fd, start)
            raise
    except OSError as exc:
        raise SealError(op, exc) from exc
    make_read_only(ops, fd)
    return len(blob)


def make_read_only(ops: FileOps, fd: int) -> None:
    """The end of a seal, its records written: fdatasync, read-only, fsync (raises :class:`SealError`).

    The order matters (``docs/journal-format.md``, *Seal*): the seal records are durable before
    the mode says "sealed", so a sealed mode never stands over a missing seal after a crash.
    """
    try:
        ops.fdatasync(fd)
    except OSError as exc:
        raise SealError("fsync", exc) from exc
    set_read_only(ops, fd)


def set_read_only(ops: FileOps, fd: int) -> None:
    """The mode that says "sealed", then fsync (raises :class:`SealError`): only over fdatasync'd bytes."""
    op = "chmod"
    try:
        ops.fchmod(fd, 0o400)
        op = "fsync"
        ops.fsync(fd)
    except OSError as exc:
        raise SealError(op, exc) from exc


def close_quietly(ops: FileOps, fd: int) -> None:
    """Close ``fd``, ignoring errors (the fd is gone either way)."""
    with contextlib.suppress(OSError):
        ops.close(fd)
