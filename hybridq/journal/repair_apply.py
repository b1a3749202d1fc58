"""Applying a journal repair plan: back up, remove the chain's dropped segments, cut and seal.

Every file changed or removed is first copied or moved into the backup directory, and every
step is durable before the next (docs/reliability.md rules 5 and 6), so a repair cut short
leaves a journal that is either repaired or still refused, never one that hides a loss. This
module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from collections.abc import Callable, Iterator

from hybridq.errors import JournalIOError, JournalLocked, StateFileCorrupt

from .fileops import FileOpError, FileOps, replace_durably, write_all
from .format import SEGMENT_SUFFIX, TMP_SUFFIX, parse_segment_name, segment_name
from .holes import HOLES_SUFFIX, IDS_SUFFIX, trim_holes
from .reader import list_chains
from .recovery import STALE_TMP_S
from .repair_plan import CHUNK_BYTES, ChainPlan, Cut, FileId
from .repair_report import RepairReport
from .segment import seal_fd
from .statefile import STATE_SUFFIX, read_state, write_state

__all__ = [
    "BACKUP_PREFIX",
    "IDS_SUFFIX",
    "LIVE_WRITER",
    "REPORT_NAME",
    "apply_chain",
    "check_not_live",
    "make_backup_dir",
    "write_report",
]

#: Backups go into ``<journal>/repair-backup-<UTC timestamp>/``: a subdirectory, so the names in
#: it are never taken for segments (``list_chains`` reads only the journal directory itself).
BACKUP_PREFIX = "repair-backup-"
#: The report written into the backup directory.
REPORT_NAME = "repair-report.json"


def _chain_is_live(ops: FileOps, directory: str, writer_id: str, last_index: int) -> bool:
    """Whether a writer still appends to this chain (how recovery tells, ``scan._settle``).

    Live: its last segment is flock'ed, or a segment temp file of the chain is locked or young
    (a writer between creating it and locking it, or rotating right now).
    """
    candidates = [os.path.join(directory, segment_name(writer_id, last_index))]
    candidates.extend(
        os.path.join(directory, name)
        for name in os.listdir(directory)
        if name.startswith(writer_id + "-") and name.endswith(SEGMENT_SUFFIX + TMP_SUFFIX)
    )
    for path in candidates:
        try:
            fd = ops.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            if path.endswith(TMP_SUFFIX) and time.time() - os.fstat(fd).st_mtime < STALE_TMP_S:
                return True
            try:
                ops.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            ops.flock(fd, fcntl.LOCK_UN)
        finally:
            ops.close(fd)
    return False


LIVE_WRITER = "a live journal writer (a running producer); stop it, then run the repair again"


def check_not_live(ops: FileOps, directory: str, plan: ChainPlan) -> None:
    """Refuse a plan that would touch a live writer's segment, or its chain's end."""
    touches_end = bool(plan.removals) or any(c.index == plan.last_index for c in plan.cuts)
    if touches_end and _chain_is_live(ops, directory, plan.writer_id, plan.last_index):
        last = os.path.join(directory, segment_name(plan.writer_id, plan.last_index))
        raise JournalLocked(last, LIVE_WRITER)


def _fail(path: str, op: str, exc: OSError) -> JournalIOError:
    return JournalIOError(path, op, exc)


def make_backup_dir(ops: FileOps, directory: str) -> str:
    """Create a new, empty backup directory in ``directory``, durably; returns its path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for attempt in range(1000):
        name = BACKUP_PREFIX + stamp + (f"-{attempt}" if attempt else "")
        backup = os.path.join(directory, name)
        try:
            ops.mkdir(backup, 0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _fail(backup, "mkdir", exc) from exc
        try:
            ops.fsync_dir(directory)  # rule 5: the new directory entry is durable
        except OSError as exc:
            raise _fail(directory, "directory fsync", exc) from exc
        return backup
    raise JournalIOError(directory, "mkdir", FileExistsError(17, "too many repair backups this second"))


#: The copy leaves a hole where a run of this many bytes, at an offset that is a multiple of it,
#: reads all zeros: a page, the smallest block a punch frees (docs/journal.md, "Finished records
#: punched out of pinned segments"); a larger block of zeros is a run of these.
HOLE_BLOCK = 4096


def _data_runs(chunk: bytes, base: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` indices in ``chunk`` (read at offset ``base``) of its runs that are not all zeros.

    Only blocks of :data:`HOLE_BLOCK` aligned on the file's offsets count as zeros; a partial
    block at either end of ``chunk`` counts too (the next chunk starts where it ends).
    """
    n = len(chunk)
    if chunk.count(0) == n:
        return
    run = -1
    i = 0
    while i < n:
        j = min(n, (base + i) // HOLE_BLOCK * HOLE_BLOCK + HOLE_BLOCK - base)
        if chunk.count(0, i, j) == j - i:
            if run >= 0:
                yield run, i
                run = -1
        elif run < 0:
            run = i
        i = j
    if run >= 0:
        yield run, n


def _copier(ops: FileOps, src_fd: int, size: int, *, mode: int | None = None) -> Callable[[int], None]:
    """Fills a new file with the first ``size`` bytes of ``src_fd`` (then makes it ``mode``).

    Every byte is read (``pread``: the page cache, always right), and the blocks that read all
    zeros become holes: the new file (opened ``O_APPEND``) is extended over them by
    ``ftruncate`` instead of written, so a repair takes no disk for the ranges punched out of
    the segment, in the backup nor in the cut segment, and the copy reads the same bytes. The
    filesystem's own hole reports (``SEEK_DATA``/``SEEK_HOLE``) are not asked: some called
    dirty data a hole (OpenZFS 2.1 and 2.2.0-2.2.1), which would have zeroed records in the
    cut segment and in its backup both.
    """

    def fill(out: int) -> None:
        done = 0  # the new file's length
        pos = 0
        while pos < size:
            chunk = os.pread(src_fd, min(CHUNK_BYTES, size - pos), pos) or _shrank()
            view = memoryview(chunk)
            for start, end in _data_runs(chunk, pos):
                if pos + start > done:
                    _extend(ops, out, pos + start)
                write_all(ops, out, view[start:end])
                done = pos + end
            pos += len(chunk)
        if done < size:
            _extend(ops, out, size)
        if mode is not None:
            try:
                ops.fchmod(out, mode)
            except OSError as exc:
                raise FileOpError("chmod", exc) from exc

    return fill


def _extend(ops: FileOps, out: int, length: int) -> None:
    """Make the file ``out`` ``length`` bytes long, the bytes added a hole (they read as zeros)."""
    try:
        ops.ftruncate(out, length)
    except OSError as exc:
        raise FileOpError("ftruncate", exc) from exc


def _shrank() -> bytes:
    # The source is locked and was checked unchanged: only damage can make it shrink now.
    raise OSError(5, "file shrank while being copied")


def _check_unchanged(ops: FileOps, path: str, fd: int, fid: FileId) -> None:
    try:
        ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise JournalLocked(path, LIVE_WRITER) from None
    if FileId.of(os.fstat(fd)) != fid:
        raise JournalLocked(path, "a process that changed it during the repair; run the repair again")


def _lock_unchanged(ops: FileOps, path: str, fid: FileId) -> int:
    """Open and exclusively lock a segment that must be as the scan saw it; returns the fd."""
    try:
        fd = ops.open(path, os.O_RDONLY)
    except OSError as exc:
        raise _fail(path, "open", exc) from exc
    try:
        _check_unchanged(ops, path, fd, fid)
    except BaseException:
        ops.close(fd)
        raise
    return fd


def apply_chain(ops: FileOps, directory: str, backup: str, plan: ChainPlan) -> None:
    """Move the chain's dropped segments into the backup, last first, then cut and seal.

    Every step leaves a journal that is either repaired or still refused (never one that hides
    a loss): segments go from the chain's end, and a cut segment is replaced atomically by a
    sealed copy of its good prefix (temp file, fsync, rename, directory fsync; docs/reliability.md
    rules 5 and 6) after the original is copied into the backup.
    """
    indices = list_chains(directory).get(plan.writer_id, [])
    if not indices or indices[-1] != plan.last_index:
        raise JournalLocked(
            os.path.join(directory, segment_name(plan.writer_id, plan.last_index)),
            "a writer that changed the chain during the repair; run the repair again",
        )
    fds: dict[str, int] = {}
    try:
        for path, fid in [*plan.removals, *((c.path, c.fid) for c in plan.cuts)]:
            fds[path] = _lock_unchanged(ops, path, fid)
            _backup_holes(ops, backup, path)
        for path, _ in reversed(plan.removals):
            dest = os.path.join(backup, os.path.basename(path))
            op = "rename"
            try:
                ops.replace(path, dest)
                op = "directory fsync"
                ops.fsync_dir(backup)
                ops.fsync_dir(directory)
            except OSError as exc:
                raise _fail(path, op, exc) from exc
            _remove_side_files(ops, backup, path)
        for cut in reversed(plan.cuts):
            _cut(ops, backup, cut, fds[cut.path])
    finally:
        for fd in fds.values():
            with contextlib.suppress(OSError):
                ops.close(fd)


def _backup_holes(ops: FileOps, backup: str, path: str) -> None:
    """Copy the hole map and ids file of the segment at ``path`` into the backup, durably, before it.

    A punched segment reads only with its map (docs/journal-format.md, hole maps): without it,
    ``journal dump`` of the backup would read its punched ranges as damage. A segment's
    ids file is the only record of the ids punched out of it (docs/journal.md): a segment moved
    aside without it would orphan it, and the next punch pass would delete it.
    """
    directory, name = os.path.split(path)
    for suffix in (HOLES_SUFFIX, IDS_SUFFIX):
        try:
            payload = read_state(directory, name + suffix, fileops=ops)
        except StateFileCorrupt:
            continue  # damaged: nothing trustworthy to keep (the scan or the ids check reports it)
        if payload is not None:
            write_state(backup, name + suffix, payload, fileops=ops)


def _remove_side_files(ops: FileOps, backup: str, path: str) -> None:
    """Delete the hole map and ids file of the segment moved aside from ``path``, after it.

    Each only if :func:`_backup_holes` copied it into the backup: after the segment (its rename,
    both directory fsyncs), as a map goes after its segment (docs/reliability.md rule 8), then a
    directory fsync (rule 5). A damaged one stays: the ids check reports it (and moves it aside).
    """
    directory, name = os.path.split(path)
    removed = False
    for suffix in (HOLES_SUFFIX, IDS_SUFFIX):
        side = os.path.join(directory, name + suffix + STATE_SUFFIX)
        if not os.path.exists(os.path.join(backup, name + suffix + STATE_SUFFIX)):
            continue
        try:
            ops.unlink(side)
            removed = True
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise _fail(side, "unlink", exc) from exc
    if removed:
        try:
            ops.fsync_dir(directory)
        except OSError as exc:
            raise _fail(directory, "directory fsync", exc) from exc


def _cut(ops: FileOps, backup: str, cut: Cut, src: int) -> None:
    """Copy the segment into the backup, then replace it by a sealed copy of its good prefix."""
    name = os.path.basename(cut.path)
    flags = os.O_EXCL | os.O_APPEND
    original = os.path.join(backup, name)
    copy = _copier(ops, src, cut.fid.size, mode=stat.S_IMODE(cut.fid.mode))
    # Created in place (no rename); its directory fsync makes it durable before the cut.
    replace_durably(ops, original, copy, tmp=original, flags=flags)
    prefix = _copier(ops, src, cut.offset)
    parsed = parse_segment_name(name)
    if parsed is not None:  # its punched ranges past the cut go first (hybridq.journal.holes)
        trim_holes(os.path.dirname(cut.path), *parsed, cut.offset, fileops=ops)

    def sealed_prefix(out: int) -> None:
        prefix(out)
        # Its seal states every record durable (no ``synced_seq``), as recovery's seal of a dead
        # chain does: every byte of this new file is written through ``out``, so the seal's
        # fdatasync covers them all (a write-back error since the open is reported to it), and
        # if it fails the file is never renamed over the segment (replace_durably raises first).
        seal_fd(ops, out, cut.seed, cut.seal_seq, cut.last_data_seq, cut.data_count)

    tmp = os.path.join(backup, name + ".new")
    replace_durably(ops, cut.path, sealed_prefix, tmp=tmp, flags=flags, also_sync=(backup,))


def write_report(ops: FileOps, backup: str, report: RepairReport) -> None:
    """Write the report into the backup directory, durably, before the first change."""
    path = os.path.join(backup, REPORT_NAME)
    data = json.dumps(report.to_dict(), indent=1).encode() + b"\n"
    replace_durably(ops, path, lambda fd: write_all(ops, fd, data), tmp=path, flags=os.O_EXCL)
