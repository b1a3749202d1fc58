"""Hole maps: freeing the disk blocks of finished records in a sealed segment (issue 29).

A segment is deleted only once every job in it is durably terminal (docs/reliability.md rule
8), so one job that stays unfinished keeps its whole segment on disk. The layer above may
instead *punch* record-aligned ranges of a **sealed** segment whose records' jobs are all
durably terminal: ``fallocate(PUNCH_HOLE | KEEP_SIZE)`` frees their blocks and every location
(segment, offset) stays valid. The ranges are listed first, durably, in the segment's hole map
(a state file ``<segment>.holes.state`` beside it, ``docs/journal-format.md``, *Hole maps*), and
every reader of the segment skips them as it skips a compacted segment's records: a read of one
record in a hole answers "gone" (:class:`RecordPunched`, a ``FileNotFoundError`` as a deleted
segment's). A crash after the map and before the punch leaves the records on disk, skipped.

The journal does not decide *which* ranges may go (the layer above knows which jobs finished);
it keeps the map, punches, and removes a map with its segment; whether a map left by a crash
fits its segment is :mod:`hybridq.journal.hole_fit`'s to say. This module must not import
redis, rq, click or the job envelope.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import operator
import os
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridq import crashpoints
from hybridq.errors import HeaderError, RecordPunched, StateFileCorrupt

from .fileops import OS_FILEOPS, FileOps
from .format import FILE_HEADER_SIZE, parse_segment_name, segment_name
from .hole_fit import _misfit
from .statefile import STATE_SUFFIX, read_state, write_state

__all__ = [
    "HOLES_SUFFIX",
    "IDS_SUFFIX",
    "Hole",
    "HoleMaps",
    "RecordPunched",
    "add_holes",
    "hole_at",
    "hole_within",
    "holes_of",
    "punch_holes",
    "punch_supported",
    "read_holes",
    "remove_holes",
    "tidy_hole_maps",
]

log = logging.getLogger("hybridq.journal")

#: Appended to a segment's file name to name its hole map (a state file: ``.state`` follows).
HOLES_SUFFIX = ".holes"
#: A segment's ids file, ``<segment>.ids.state``: the ids of the records a layer above punched out
#: of it, kept beside its hole map (the layer above imports this name; a repair backs it up too).
IDS_SUFFIX = ".ids"
_COUNT = struct.Struct("<I")
_HOLE = struct.Struct("<QQQQQ")  # start, end, first sequence, next sequence, data records
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


@dataclass(frozen=True, slots=True)
class Hole:
    """A punched range of whole data records: bytes ``[start, end)``, sequences ``[first_seq, next_seq)``."""

    start: int
    end: int
    first_seq: int
    next_seq: int
    count: int


def _name(writer_id: str, index: int) -> str:
    return segment_name(writer_id, index) + HOLES_SUFFIX


def _decode(path: str, payload: bytes) -> tuple[Hole, ...]:
    if len(payload) < _COUNT.size:
        raise StateFileCorrupt(path, "hole map cut short")
    (n,) = _COUNT.unpack_from(payload)
    if len(payload) != _COUNT.size + n * _HOLE.size:
        raise StateFileCorrupt(path, "hole map length does not match its count")
    holes = tuple(Hole(*_HOLE.unpack_from(payload, _COUNT.size + i * _HOLE.size)) for i in range(n))
    at = FILE_HEADER_SIZE
    for h in holes:
        if h.start < at or h.end <= h.start or h.next_seq - h.first_seq != h.count or h.count < 1:
            raise StateFileCorrupt(path, f"hole map range {h.start}-{h.end} is not valid")
        at = h.end
    return holes


def read_holes(
    directory: str, writer_id: str, index: int, *, fileops: FileOps = OS_FILEOPS
) -> tuple[Hole, ...]:
    """The punched ranges of a segment, sorted; empty when it has no hole map.

    Raises :class:`StateFileCorrupt` when the map is damaged (never read as "no holes": the
    records it lists may be zeros).
    """
    payload = read_state(directory, _name(writer_id, index), fileops=fileops)
    if payload is None:
        return ()
    return _decode(os.path.join(directory, _name(writer_id, index)), payload)


def holes_of(segment_path: str, *, fileops: FileOps = OS_FILEOPS) -> tuple[Hole, ...]:
    """:func:`read_holes` of the segment file at ``segment_path``."""
    parsed = parse_segment_name(os.path.basename(segment_path))
    if parsed is None:
        return ()
    return read_holes(os.path.dirname(segment_path), *parsed, fileops=fileops)


_START = operator.attrgetter("start")


def hole_at(holes: Sequence[Hole], offset: int) -> Hole | None:
    """The range of a map's ``holes`` (sorted, disjoint) that holds ``offset``; ``None`` if none.

    A bisect on the starts: a 64 MiB segment with a failure every 20 jobs has thousands of ranges.
    """
    i = bisect.bisect_right(holes, offset, key=_START) - 1
    return holes[i] if i >= 0 and offset < holes[i].end else None


def hole_within(holes: Sequence[Hole], start: int, end: int) -> Hole | None:
    """The first of a map's ``holes`` (sorted, disjoint) with bytes in ``[start, end]``; ``None`` if none.

    A bisect, then at most two ranges: the last one starting at or before ``start``, and the next.
    """
    i = max(bisect.bisect_right(holes, start, key=_START) - 1, 0)
    for hole in holes[i : i + 2]:
        if hole.start <= end and start < hole.end:
            return hole
    return None


class HoleMaps:
    """Which punched range holds a location (the ``done`` entries of records a scan skipped).

    Each map is read once; one that cannot be read answers "not punched" (the scan reports it).
    """

    def __init__(self, directory: str, *, fileops: FileOps = OS_FILEOPS) -> None:
        self.directory = directory
        self.fileops = fileops
        self._maps: dict[tuple[str, int], tuple[Hole, ...]] = {}

    def hole_at(self, writer_id: str, index: int, offset: int) -> Hole | None:
        """The punched range of segment ``index`` of chain ``writer_id`` that holds ``offset``."""
        holes = self._maps.get((writer_id, index))
        if holes is None:
            try:
                holes = read_holes(self.directory, writer_id, index, fileops=self.fileops)
            except (OSError, StateFileCorrupt):
                holes = ()
            self._maps[(writer_id, index)] = holes
        return hole_at(holes, offset) if holes else None


def _encode(holes: Sequence[Hole]) -> bytes:
    return _COUNT.pack(len(holes)) + b"".join(
        _HOLE.pack(h.start, h.end, h.first_seq, h.next_seq, h.count) for h in holes
    )


def _merge(holes: Iterable[Hole]) -> list[Hole]:
    out: list[Hole] = []
    for h in sorted(holes, key=lambda h: h.start):
        if out and out[-1].end > h.start:
            raise ValueError(f"punched ranges overlap at offset {h.start}")
        if out and out[-1].end == h.start and out[-1].next_seq == h.first_seq:
            last = out.pop()
            out.append(Hole(last.start, h.end, last.first_seq, h.next_seq, last.count + h.count))
        else:
            out.append(h)
    return out


_fallocate = None


def _libc_fallocate() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    global _fallocate
    if _fallocate is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        fn.restype = ctypes.c_int
        _fallocate = fn
    return _fallocate


def _punch(fd: int, start: int, length: int) -> None:
    if _libc_fallocate()(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, start, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_unsupported: set[int] = set()  # st_dev of filesystems that refused a punch (logged once each)


def punch_supported(directory: str) -> bool:
    """Whether punching is known not to fail with ``EOPNOTSUPP`` on ``directory``'s filesystem."""
    try:
        return os.stat(directory).st_dev not in _unsupported
    except OSError:
        return False


def add_holes(
    directory: str, writer_id: str, index: int, new: Iterable[Hole], *, fileops: FileOps = OS_FILEOPS
) -> int:
    """:func:`punch_holes`, the bytes punched only."""
    return punch_holes(directory, writer_id, index, new, fileops=fileops)[0]


def punch_holes(
    directory: str, writer_id: str, index: int, new: Iterable[Hole], *, fileops: FileOps = OS_FILEOPS
) -> tuple[int, tuple[Hole, ...]]:
    """Durably add ``new`` to a sealed segment's hole map, then punch them.

    Returns the bytes punched and the map written (what :func:`read_holes` reads next; empty
    when none was: nothing new, or a filesystem without punch support), so that the layer above
    uses it without reading it again.

    The map first (``docs/reliability.md`` rule 8: what replaces the records is durable before
    they go), then the punch, then an fsync. Each range must be whole data records of the
    segment whose jobs are all durably terminal: that is the caller's to know. On a filesystem
    without punch support the map stands and nothing more is punched (logged once). A crash at
    any point leaves either the old map (records all there) or the new one (records skipped,
    punched or not: :func:`tidy_hole_maps` punches them again at the next start).
    """
    path = os.path.join(directory, segment_name(writer_id, index))
    new = list(new)
    st = os.stat(path)
    if not new or st.st_dev in _unsupported:
        return 0, ()
    if st.st_mode & stat.S_IWUSR:
        raise ValueError(f"segment {index} of chain {writer_id} is not sealed: its records cannot be punched")
    holes = tuple(_merge([*read_holes(directory, writer_id, index, fileops=fileops), *new]))
    if holes[-1].end > st.st_size:
        raise ValueError(f"punched range ends past the end of {path}")
    write_state(directory, _name(writer_id, index), _encode(holes), fileops=fileops)
    crashpoints.reached("punch_after_map")
    return _punch_ranges(fileops, path, st.st_dev, new), holes


def _punch_ranges(fileops: FileOps, path: str, dev: int, holes: Iterable[Hole]) -> int:
    """Punch ``holes`` (listed in the map already) out of the sealed segment at ``path``; fsync it."""
    fd = fileops.open(path, os.O_RDONLY)
    try:
        try:
            wfd = _writable(fileops, fd, path)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open {path} to punch it: {exc.strerror}") from exc
        try:
            freed = 0
            for h in holes:
                _punch(wfd, h.start, h.end - h.start)
                freed += h.end - h.start
            crashpoints.reached("punch_after_punch")
            fileops.fsync(wfd)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # The map stands (its records are finished: skipped either way); no more tries.
            _unsupported.add(dev)
            log.warning(
                "journal: %s: this filesystem cannot punch holes; finished records stay on disk", path
            )
            return 0
        finally:
            fileops.close(wfd)
    finally:
        fileops.close(fd)
    return freed


def _writable(fileops: FileOps, fd: int, path: str) -> int:
    """A write fd on the sealed (0400) segment open as ``fd``.

    Write permission is checked at open only: the mode is ``u+w`` for two system calls, and a
    crash between them leaves a sealed segment writable, which :func:`tidy_hole_maps` puts back
    (its hole map says it was sealed).
    """
    try:
        return fileops.open(path, os.O_WRONLY)
    except PermissionError:
        pass
    fileops.fchmod(fd, 0o600)
    try:
        crashpoints.reached("punch_writable")
        return fileops.open(path, os.O_WRONLY)
    finally:
        fileops.fchmod(fd, 0o400)
        fileops.fsync(fd)


def trim_holes(
    directory: str, writer_id: str, index: int, end: int, *, fileops: FileOps = OS_FILEOPS
) -> None:
    """Drop the ranges past ``end`` from a segment's map: ``journal repair`` cuts the segment there.

    Called before the cut: a crash between leaves the old segment, its damage still found.
    """
    holes = read_holes(directory, writer_id, index, fileops=fileops)
    kept = [h for h in holes if h.end <= end]
    if len(kept) == len(holes):
        return
    if not kept:
        remove_holes(directory, writer_id, index, fileops=fileops)
        fileops.fsync_dir(directory)
        return
    write_state(directory, _name(writer_id, index), _encode(kept), fileops=fileops)


def remove_holes(directory: str, writer_id: str, index: int, *, fileops: FileOps = OS_FILEOPS) -> bool:
    """Remove a segment's hole map (after the segment itself); whether there was one."""
    try:
        fileops.unlink(os.path.join(directory, _name(writer_id, index) + STATE_SUFFIX))
    except FileNotFoundError:
        return False
    return True


def tidy_hole_maps(directory: str, *, fileops: FileOps = OS_FILEOPS) -> list[str]:
    """After a crash: remove hole maps whose segment is gone; make sealed segments read-only again.

    A map without its segment was left by a crash between the segment's deletion and the map's.
    A writable segment with a map was left by a crash while it was opened to punch (only sealed
    segments get a map). The ranges of every map are punched again (a crash may have come
    between the map and the punch; punching a hole again changes nothing). Both only for a map
    that fits its segment (:func:`_misfit`): one that does not is left for the scan to report,
    its bytes untouched. Returns the names of the maps removed.
    """
    removed: list[str] = []
    suffix = HOLES_SUFFIX + STATE_SUFFIX
    for name in sorted(os.listdir(directory)):
        if not name.endswith(suffix):
            continue
        seg = os.path.join(directory, name[: -len(suffix)])
        try:
            st = os.stat(seg, follow_symlinks=False)
        except FileNotFoundError:
            with contextlib.suppress(FileNotFoundError):
                fileops.unlink(os.path.join(directory, name))
                removed.append(name)
            continue
        parsed = parse_segment_name(os.path.basename(seg))
        if parsed is None:
            continue
        try:
            holes = read_holes(directory, *parsed, fileops=fileops)
            problem = _misfit(seg, holes, fileops=fileops)
        except (OSError, StateFileCorrupt, HeaderError) as exc:
            problem = str(exc)
        if problem is not None:
            # Left as it is: the scan reports it (a map off the records is corruption) rather
            # than this start punching, or sealing, on a map it cannot trust.
            log.warning("journal: %s: hole map not applied at the start: %s", name, problem)
            continue
        if st.st_mode & stat.S_IWUSR:
            fd = fileops.open(seg, os.O_RDONLY)
            try:
                fileops.fchmod(fd, 0o400)
                fileops.fsync(fd)
            finally:
                fileops.close(fd)
        if st.st_dev not in _unsupported:  # a crash after the map, before the punch: punch again
            _punch_ranges(fileops, seg, st.st_dev, holes)
    if removed:
        fileops.fsync_dir(directory)
    return removed
