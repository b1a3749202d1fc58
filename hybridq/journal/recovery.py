"""Checking a journal, and recovering it on open: torn tails repaired, dead chains sealed.

Policy: ``docs/journal-format.md`` (*Torn tail and corruption*) and docs/reliability.md rules 10-12.
Recovery never starts over damage it has read: it scans first and raises
:class:`~hybridq.errors.JournalCorruption` before touching a byte if what it scanned is corrupt.
With ``tails_only`` (a daemon's start) it scans each chain's last segment only, so damage
in a sealed segment is found later, by the background check, after a dead chain's torn tail
may have been truncated (its bytes copied to ``*.broken`` first) and the chain sealed: both are
what a full recovery would have done to that tail too, and neither hides the damage.

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hybridq.errors import JournalCorruption, JournalIOError

from .fileops import OS_FILEOPS, FileOps, replace_durably, write_all
from .format import BROKEN_SUFFIX, SEAL_RECORDS, SEGMENT_SUFFIX, TMP_SUFFIX, salt_seed
from .reader import JournalReader, SegmentInfo, TornTail, segment_usage
from .segment import SealError, seal_fd, set_read_only

__all__ = ["RecoveryReport", "VerifyReport", "recover", "verify"]

log = logging.getLogger("hybridq.journal")

_COPY_CHUNK = 1 << 20
#: A segment temp file this old and unlocked is a dead writer's leftover (seconds).
STALE_TMP_S = 60.0


@dataclass
class VerifyReport:
    """What a full check of a journal found (it raised instead if anything is corrupt)."""

    chains: int = 0
    segments: int = 0
    records: int = 0
    bytes: int = 0
    live_chains: int = 0
    torn_tails: list[TornTail] = field(default_factory=list)


@dataclass
class RecoveryReport:
    """What :func:`recover` did."""

    verify: VerifyReport
    repaired: list[TornTail] = field(default_factory=list)
    sealed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    #: Sealed last segments of dead chains a crash left writable, sealed again (read-only).
    resealed: list[str] = field(default_factory=list)


def verify(
    path: str | os.PathLike[str],
    *,
    fileops: FileOps = OS_FILEOPS,
    on_bytes: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check every record of every chain; raise :class:`JournalCorruption` on damage.

    Read-only. A torn tail of a dead writer is reported, not raised: it is the normal result of a
    crash and :func:`recover` repairs it.
    """
    return _verify(JournalReader(path, fileops=fileops), on_bytes)[0]


def _verify(
    reader: JournalReader, on_bytes: Callable[[int], None] | None = None, *, tails_only: bool = False
) -> tuple[VerifyReport, JournalReader]:
    reader.on_bytes = on_bytes
    report = VerifyReport(records=reader.check(tails_only=tails_only))
    report.chains = len(reader.chain_ends)
    report.live_chains = sum(1 for info in reader.chain_ends.values() if info.live)
    report.torn_tails = list(reader.torn_tails)
    report.segments, report.bytes = segment_usage(reader.path)
    return report, reader


def recover(
    path: str | os.PathLike[str], *, fileops: FileOps = OS_FILEOPS, tails_only: bool = False
) -> RecoveryReport:
    """Make the journal consistent for a new reader (its consumer runs this on start).

    1. Check everything (``tails_only``: each chain's last segment, the only one a crash can
       leave torn or unsealed; the caller must check the sealed ones before it trusts them, e.g.
       with :class:`~hybridq.journal.background.BackgroundCheck`, or read them whole, as
       a consumer replaying every record does); on corruption found raise before changing
       anything (with ``tails_only``, damage in a sealed segment is found after steps 2-3).
    2. Delete segment temp files left by dead writers.
    3. For each dead writer's unsealed last segment: back up and truncate a torn tail, then seal
       it, so its chain is closed and the tail is never repaired twice. A sealed last segment a
       crash left writable is sealed again (:func:`_seal_again`).
    """
    checked, reader = _verify(JournalReader(path, fileops=fileops), tails_only=tails_only)
    report = RecoveryReport(verify=checked)
    directory = reader.path
    for name in sorted(os.listdir(directory)):
        if name.endswith(SEGMENT_SUFFIX + TMP_SUFFIX) and _remove_if_unlocked(fileops, directory, name):
            report.removed.append(name)
    if report.removed:
        fileops.fsync_dir(directory)
    # One scan is enough: a chain that changed since (a live writer appended or sealed) is
    # re-checked under its lock by _close_dead_chain before anything is written.
    for info in reader.chain_ends.values():
        if info.sealed and not info.live and _seal_again(fileops, info):
            report.resealed.append(info.path)
        if info.sealed or info.live:
            continue
        if _close_dead_chain(fileops, info):
            if info.torn is not None:
                report.repaired.append(info.torn)
            report.sealed.append(info.path)
    return report


def _seal_again(ops: FileOps, info: SegmentInfo) -> bool:
    """Seal again a dead chain's sealed last segment that a kill or a failed fsync left writable.

    The mode says "sealed" to every reader (docs/journal-format.md, *Seal*), a consumer's check
    of a position saved at a chain's sealed end among them: left writable, such a position is
    refused at every start (and what it saved replayed again). A kill between the seal's
    fdatasync and its chmod leaves one so, as does a kill while a punch holds it ``u+w``
    (:func:`hybridq.journal.holes._writable`), or a seal whose fdatasync failed (EIO) and whose
    writer gave up on it. In that last case the seal records, and the records the writer had
    not fsynced yet, may be only in the page cache, and a later fsync can report success without
    writing them: a mode put over them could outlive them. So they are written again, in place,
    the same bytes (from :func:`_not_known_durable` to the end), then fdatasync, read-only,
    fsync (the order of :func:`~hybridq.journal.segment.make_read_only`). A crash at any step
    leaves the segment as it was (the same bytes, sealed, writable) or sealed read-only over a
    durable seal; a reader never sees it change. Only under the segment's flock (a live writer
    holds it until its own chmod) and only if it is as scanned.

    The bytes read back may not be the ones scanned: pages whose write-back failed can be
    evicted, and a read then returns what the disk holds (zeros, say). So once they are
    fdatasync'd the segment is read again, and the mode set only if it still reads as the
    scan read it; if not (or if damage is read while looking for where to write from) it stays
    writable (one warning), and the next start reads it as it is now (a torn tail to repair, or
    damage to refuse), as it would have without this.
    Returns whether it sealed it.
    """
    if not _writable(info.path):
        return False  # the common case (or gone), looked at before any open (root's is not refused)
    with _locked(ops, info.path, os.O_RDWR, missing_ok=True) as locked:
        if locked is None:
            return False  # gone, or its writer is sealing it now: it chmods it itself
        fd, st = locked
        if not st.st_mode & stat.S_IWUSR or st.st_size != info.end_offset:
            return False
        done = _not_known_durable(ops, info)
        if done is not None:
            _write_again(ops, fd, info, done)
            try:
                ops.fdatasync(fd)
            except OSError as exc:
                raise JournalIOError(info.path, "fsync", exc) from exc
        if done is None or not _as_scanned(ops, info):
            log.warning(
                "journal: %s: sealed but left writable by a crash, and no longer reads as it did "
                "(its pages lost?); left writable for the next start",
                info.path,
            )
            return False
        try:
            set_read_only(ops, fd)
        except SealError as exc:
            raise JournalIOError(info.path, exc.op, exc.cause) from exc.cause
        log.warning("journal: %s: sealed but left writable by a crash; sealed again", info.path)
        return True


def _write_again(ops: FileOps, fd: int, info: SegmentInfo, done: int) -> None:
    """Write the segment's bytes from ``done`` to its scanned end again, in place, as read back.

    A read that returns nothing before that end fails it (:class:`JournalIOError`): bytes not
    written again must not be taken for durable ones.
    """
    op = "seek"
    try:
        os.lseek(fd, done, os.SEEK_SET)
        while done < info.end_offset:
            op = "read"
            chunk = _read_some(fd, min(_COPY_CHUNK, info.end_offset - done), done)
            op = "write"
            write_all(ops, fd, chunk)
            done += len(chunk)
    except OSError as exc:
        raise JournalIOError(info.path, op, exc) from exc


def _read_some(fd: int, size: int, offset: int) -> bytes:
    """``pread``; nothing read (the file shorter than asked) is an error, not a last chunk."""
    chunk = os.pread(fd, size, offset)
    if not chunk:
        raise OSError(errno.EIO, "read returned nothing before the scanned end")
    return chunk


def _as_scanned(ops: FileOps, info: SegmentInfo) -> bool:
    """Whether the segment reads now as the start's scan read it: sealed at the same end, same records.

    An error reading it is the start's (:class:`JournalIOError`); damage is only "not as scanned".
    """
    reader = JournalReader(os.path.dirname(info.path), fileops=ops)
    try:
        now = reader.segment_info(info.writer_id, info.index)
    except JournalCorruption:
        return False
    except OSError as exc:
        raise JournalIOError(info.path, "read", exc) from exc
    seen = (info.sealed, info.end_offset, info.next_seq, info.data_count, info.last_data_seq)
    return (now.sealed, now.end_offset, now.next_seq, now.data_count, now.last_data_seq) == seen


def _not_known_durable(ops: FileOps, info: SegmentInfo) -> int | None:
    """Where the bytes of a sealed segment that may not be on disk start: its seal, or a record before.

    Its records state the last sequence their writer had fsynced (docs/journal-format.md,
    *Record*): the records after it were made durable only by the seal's fdatasync, if it did
    not fail. The smaller of what its seal and its last data record state: a writer's seal
    states its own frontier, but recovery's, and a repair's, state every record durable. A
    punched segment's were durable: a hole map is written only for a sealed, fsynced one (and
    writing its records again would write its punched ranges back, as zeros on disk).
    None if the segment no longer reads as scanned (damage); an error reading it raises
    :class:`JournalIOError`.
    """
    synced = min(info.seal_synced_seq, info.data_synced_seq)
    if info.punched or synced >= info.next_seq - SEAL_RECORDS - 1:
        return info.seal_offset
    reader = JournalReader(os.path.dirname(info.path), fileops=ops)
    try:
        for record in reader.segment_records(info.writer_id, info.index):
            if record.seq > synced:
                return record.offset
    except JournalCorruption:
        return None
    except OSError as exc:
        raise JournalIOError(info.path, "read", exc) from exc
    return info.seal_offset


@contextlib.contextmanager
def _locked(
    ops: FileOps, path: str, flags: int, *, missing_ok: bool = False
) -> Iterator[tuple[int, os.stat_result] | None]:
    """``path`` open with ``flags`` under its flock, taken without waiting, and its stat; closed after.

    None when a start must leave it alone: a live writer holds the lock, or it became read-only
    (sealed by its writer) after the scan and a write open is refused, or (``missing_ok``) it is
    gone. Any other error of the open raises :class:`JournalIOError`.
    """
    try:
        fd = ops.open(path, flags)
    except FileNotFoundError as exc:
        if not missing_ok:
            raise JournalIOError(path, "open", exc) from exc
        yield None
        return
    except PermissionError as exc:
        writable = _writable(path)
        if writable is False or (writable is None and missing_ok):
            yield None
            return
        raise JournalIOError(path, "open", exc) from exc
    except OSError as exc:
        raise JournalIOError(path, "open", exc) from exc
    try:
        try:
            ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield fd, os.fstat(fd)
    finally:
        ops.close(fd)


def _writable(path: str) -> bool | None:
    """Whether ``path``'s mode lets its owner write it; None if it is gone.

    Any other error of the ``stat`` raises :class:`JournalIOError`: an I/O error is not a
    sealed segment, and must not pass for one.
    """
    try:
        return bool(os.stat(path).st_mode & stat.S_IWUSR)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalIOError(path, "stat", exc) from exc


def _remove_if_unlocked(ops: FileOps, directory: str, name: str) -> bool:
    path = os.path.join(directory, name)
    try:
        fd = ops.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        # A writer opens its temp file and then locks it: between the two it is unlocked but
        # alive. Only a temp file both unlocked and old is a dead writer's leftover.
        if time.time() - os.fstat(fd).st_mtime < STALE_TMP_S:
            return False
        try:
            ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live writer is creating this segment right now
        ops.unlink(path)
        return True
    finally:
        ops.close(fd)


def _close_dead_chain(ops: FileOps, info: SegmentInfo) -> bool:
    """Truncate a torn tail (after a backup) and seal the last segment of a dead chain."""
    with _locked(ops, info.path, os.O_RDWR | os.O_APPEND) as locked:
        if locked is None:
            return False  # its writer holds it, or sealed it (read-only) after our scan: not dead
        fd, st = locked
        if not st.st_mode & stat.S_IWUSR:
            return False  # sealed meanwhile
        torn = info.torn
        if torn is not None:
            if st.st_size != torn.offset + torn.dropped_bytes:
                return False  # changed since the scan; the next recovery looks again
            backup = _back_up(ops, info.path, fd, st.st_size)
            op = "truncate"
            try:
                ops.ftruncate(fd, torn.offset)
                op = "fsync"
                ops.fsync(fd)
            except OSError as exc:
                raise JournalIOError(info.path, op, exc) from exc
            log.warning(
                "journal: torn tail in %s at offset %d: %d bytes dropped (none was acknowledged); "
                "backup in %s",
                info.path,
                torn.offset,
                torn.dropped_bytes,
                backup,
            )
            if torn.unsynced_records:
                # Power loss wrote some unsynced pages and not others. Those records were never
                # acknowledged, but say so loudly: bit rot in records written after the last
                # fsync that any later record witnessed would look the same (docs/journal.md).
                log.error(
                    "journal: %s: %d valid-looking records after offset %d were never durable "
                    "(written after a record that was lost before its fsync); dropped, kept in %s",
                    info.path,
                    torn.unsynced_records,
                    torn.offset,
                    backup,
                )
        elif st.st_size != info.end_offset:
            return False
        try:
            # It states every record durable, as the records a writer acknowledged are: a later
            # scan then refuses damage in them, never cuts it as a torn tail. If its fdatasync
            # fails, the next start's _seal_again rewrites from the last data record's frontier.
            seal_fd(ops, fd, salt_seed(info.salt), info.next_seq, info.last_data_seq, info.data_count)
        except SealError as exc:
            raise JournalIOError(info.path, exc.op, exc.cause) from exc.cause
        return True


def _back_up(ops: FileOps, path: str, fd: int, size: int) -> str:
    """Copy a segment to ``*.broken`` durably before it is truncated (etcd's ``Repair``)."""
    backup = path + BROKEN_SUFFIX

    def fill(out: int) -> None:
        done = 0
        while done < size:
            chunk = os.pread(fd, min(_COPY_CHUNK, size - done), done)
            if not chunk:
                break
            write_all(ops, out, chunk)
            done += len(chunk)

    replace_durably(ops, backup, fill, tmp=backup + TMP_SUFFIX)
    return backup
