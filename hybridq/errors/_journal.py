"""The journal's errors, and the lock a second process on one journal meets.

Apart from the other roles' errors only to keep each module short; they are shown, pickled and
documented as ``hybridq.errors.<Name>`` (the package's ``__init__`` sets ``__module__``).
"""

from __future__ import annotations

import errno
import os

from ._base import HybridqError


class JournalError(HybridqError):
    """Something is wrong with the journal."""


class JournalPathError(JournalError):
    """The journal path cannot be used."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"journal path {self.path}: {reason}")


class JournalIOError(JournalError):
    """A write or fsync failed: the append was not acknowledged and the segment is abandoned.

    The outcome is *unknown*, not "not accepted": bytes written before a failed fsync may still
    be read and forwarded. Retry under the same idempotency key (:attr:`idempotency_keys`, set
    when ``enqueue`` raised it): the task then runs once (``docs/guarantees.md``).
    """

    def __init__(self, path: str, op: str, cause: OSError) -> None:
        self.path = path
        self.op = op
        self.errno = cause.errno
        #: The job ids and idempotency keys of the failed ``enqueue`` call (empty for a bare
        #: journal append).
        self.job_ids: tuple[str, ...] = ()
        self.idempotency_keys: tuple[str, ...] = ()
        super().__init__(f"{op} failed on {path}: {cause.strerror or cause}")

    def for_jobs(self, job_ids: tuple[str, ...], idempotency_keys: tuple[str, ...]) -> None:
        """Name the jobs whose enqueue failed, and say what a caller may do."""
        self.job_ids = job_ids
        self.idempotency_keys = idempotency_keys
        advice = "retry with the same idempotency_key and the task runs once"
        self.args = (f"{self.args[0]}; outcome unknown for job(s) {', '.join(job_ids)}: {advice}",)


class JournalCorruption(JournalError):
    """Damage that is not a torn tail; the journal refuses to go on over it.

    Attributes:
        path: the segment (or state) file.
        offset: byte offset of the first damaged byte found.
        first_seq: first sequence number affected (``None`` when unknown).
        last_seq: last sequence number affected (``None`` when unknown or open-ended).
        reason: what is wrong, in a few words.
    """

    def __init__(
        self,
        path: str,
        offset: int,
        reason: str,
        *,
        first_seq: int | None = None,
        last_seq: int | None = None,
    ) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        self.first_seq = first_seq
        self.last_seq = last_seq
        super().__init__(f"journal corruption in {path} at offset {offset}: {reason}; {self.affected}")

    @property
    def affected(self) -> str:
        """The sequence range at risk, in words."""
        if self.first_seq is None:
            return "affected records unknown"
        if self.last_seq is None:
            return f"records from sequence {self.first_seq} on are affected"
        if self.last_seq < self.first_seq:
            return "no record is lost"
        return f"records {self.first_seq}..{self.last_seq} are affected"


class RecordTooLarge(JournalError, ValueError):
    """A payload is over the maximum record size; nothing was written."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"record payload of {size} bytes is over the limit of {limit} bytes")


class JournalClosed(JournalError):
    """The writer has been closed."""

    def __init__(self) -> None:
        super().__init__("journal writer is closed")


class StateFileCorrupt(JournalError):
    """A state file is damaged (bad magic, length or checksum)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"state file {path} is damaged: {reason}")


class RecordPunched(JournalError, FileNotFoundError):
    """The record asked for is in a punched range: gone, as a compacted segment's records are.

    A ``FileNotFoundError`` (``ENOENT``), so every reader that answers "gone" for a deleted
    segment answers the same for a punched record (hybridq.journal.holes).
    """

    def __init__(self, path: str, offset: int) -> None:
        super().__init__(
            errno.ENOENT, f"record at offset {offset} was punched (every job in it finished)", path
        )


class HeaderError(JournalError, ValueError):
    """A segment file header does not decode; the message says why."""


class FileOpError(JournalError):
    """File operation ``op`` failed with ``cause``: raised by steps that name their own op.

    The journal turns it into :class:`JournalIOError` (``journal.fileops.replace_durably``).
    """

    def __init__(self, op: str, cause: OSError) -> None:
        super().__init__(op, cause)
        self.op = op
        self.cause = cause


class SealError(FileOpError):
    """Sealing failed at ``op`` with ``cause``."""


class JournalLocked(HybridqError):
    """Another process holds the lock (for example a second forwarder on one journal)."""

    def __init__(self, path: str, holder: str) -> None:
        self.path = path
        self.holder = holder
        super().__init__(f"{path} is locked by {holder}")
