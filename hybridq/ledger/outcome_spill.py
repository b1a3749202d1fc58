"""A :class:`~hybridq.ledger.outcomes.SegmentOutcomes`'s merged arrays on disk: :class:`SpilledArrays`.

The ledger index keeps one map of finished jobs per live journal segment; past a cap on the
offsets it holds in memory (:meth:`LedgerIndex.spill_past
<hybridq.ledger.index.LedgerIndex.spill_past>`), whole maps' sorted arrays move to a file and are
looked up there (issue 29; docs/forwarder.md, "Memory: the bound that holds now").

The file is a runtime representation only, never durable and never trusted across a restart:
a file of this process's in :data:`SPILL_DIR` of the journal's directory (on the journal's disk,
not a tmpfs; a dot name: no journal reader lists it, docs/journal-format.md), named by a token
drawn once a process and the map's serial, removed when its map is dropped or read back. What a
kill leaves there is removed by the next start (:func:`sweep`, under the forwarder's owner lock:
no other process spills into that journal). At most :data:`OPEN_MAX` of them are open at once
(the others are opened again by name when looked up), so any number of spilled maps fits under
``RLIMIT_NOFILE``. A write that would leave less than :func:`margin` free on the disk is refused,
and after a refusal or a failed write nothing is written there for :data:`BACKOFF_S`: the
journal's producers' appends must not meet a disk the spill filled (docs/forwarder.md,
"Memory: the bound that holds now").

Layout: blocks of :data:`SPILL_BLOCK` jobs, block ``j`` at ``j * SPILL_BLOCK * 9``: the
block's offsets (8 bytes each, native order), then their outcome codes (one byte each); the last
block is partly filled. In memory stay the first offset of each block (:attr:`sample`: 8 bytes a
block, 0.016 bytes a job), the count, the last offset, how many jobs have each code
(:attr:`tally`); the last block read, of any file, is kept once for the process (the pushes
ask in offset order). A lookup: the block kept if the offset is within its bounds, else one
``bisect`` of the sample and one ``os.pread`` of a block; then one ``bisect`` in it. What stays
in memory is about 2 KB per spilled map of 100,000 jobs (``tests/unit/test_index_memory.py``).

An error reading the file raises :class:`~hybridq.errors.JournalIOError`: a lookup must never
answer "not finished" for a job that is (it would run again, docs/reliability.md), so the
forwarder stops as for its other journal I/O errors, and so does a file that cannot be opened
again. An error writing it (a full disk), or a write refused, is the caller's to handle: the
map stays in memory (:mod:`hybridq.ledger.outcomes`).

This module must not import redis or rq.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import time
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from typing import NoReturn, SupportsIndex

from hybridq.errors import JournalIOError

__all__ = [
    "BACKOFF_S",
    "OPEN_MAX",
    "SPILL_BLOCK",
    "SPILL_DIR",
    "SpillRefused",
    "SpilledArrays",
    "margin",
    "paused",
    "spill_failed",
    "sweep",
]

log = logging.getLogger("hybridq.ledger")

#: Jobs per block of the file: one lookup reads one block (9 bytes a job: 4.5 KiB).
SPILL_BLOCK = 512
#: The spill files' directory, in the journal's (made 0700 by the first spill).
SPILL_DIR = ".index-spill"
#: Spill files open at once; the least recently used is closed past it (opened again by name).
OPEN_MAX = 32
#: The free space a write must leave on the journal's disk: the larger of these two. 256 MiB is
#: four default segments (64 MiB) of the producers' appends; 5 % keeps a large disk's last
#: twentieth for the journal, where most file systems slow down and operators' alerts fire.
FREE_MIN_BYTES = 256 << 20
FREE_MIN_FRACTION = 0.05
#: Seconds with no write to a spill file after a write failed or was refused for room.
BACKOFF_S = 60.0
#: How the file is named in an error.
_WHAT = "the ledger index's spill file"
#: Blocks written or read per system call when a whole map is written or read back.
_CHUNK_BLOCKS = 64


class SpillRefused(OSError):
    """A write not tried: too little room on the disk, or within :data:`BACKOFF_S` of a failure."""


_SERIALS = itertools.count(1)
#: The last block read, of any file (its file's serial, its index, its offsets and codes): the
#: pushes and the reconcile pass ask in offset order, one segment after another. One for the
#: process, not one a map: 4.5 KiB per spilled segment would be most of what it keeps.
_kept: tuple[int, int, tuple[array[int], bytes]] = (0, -1, (array("Q"), b""))
#: The open descriptors, by file serial, least recently used first (at most :data:`OPEN_MAX`).
_open: OrderedDict[int, int] = OrderedDict()
#: This process's files' names start with it (a forked child draws its own: it never removes
#: its parent's); :func:`sweep` removes the others.
_token = os.urandom(8).hex()
#: The journal directories swept by this process, and their spill directories made.
_swept: set[str] = set()
_made: set[str] = set()
#: No write before this (:func:`time.monotonic`): a write failed or was refused for room.
_resume_at = 0.0
_clock = time.monotonic
#: Warned since the last write that succeeded (one warning an episode).
_warned = False


def _forget_kept(serial: int) -> None:
    global _kept
    if _kept[0] == serial:
        _kept = (0, -1, (array("Q"), b""))


def _forked() -> None:
    global _token
    _token = os.urandom(8).hex()
    while _open:
        os.close(_open.popitem()[1])


os.register_at_fork(after_in_child=_forked)


def margin(directory: str) -> tuple[int, int]:
    """``(free, least)``: the bytes free on ``directory``'s disk and the least a write must leave."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize, max(FREE_MIN_BYTES, int(st.f_blocks * st.f_frsize * FREE_MIN_FRACTION))


def paused() -> bool:
    """Whether writes are held back now (:data:`BACKOFF_S` after a failure or a refusal)."""
    return _clock() < _resume_at


def _pause() -> None:
    global _resume_at
    _resume_at = _clock() + BACKOFF_S


def _room(directory: str, size: int) -> None:
    """Raise :class:`SpillRefused` unless ``size`` bytes may be written in ``directory`` now."""
    if paused():
        raise SpillRefused(errno.ENOSPC, f"no write for {BACKOFF_S:.0f} s after a failure or a full disk")
    free, least = margin(directory)
    if free - size < least:
        _pause()
        raise SpillRefused(
            errno.ENOSPC, f"{free >> 20} MiB free on the journal's disk, less than {least >> 20} MiB"
        )


def _written() -> None:
    """A write succeeded: a later failure warns again."""
    global _resume_at, _warned
    _resume_at, _warned = 0.0, False


def sweep(directory: str) -> None:
    """Remove the spill files of other processes in ``directory`` (a journal's), once a process.

    They are a killed forwarder's (only the forwarder holding the journal's owner lock spills
    into it, ``hybridq/forwarder/dirlock.py``), never read again. One that cannot be removed
    is logged and left.
    """
    if not directory or directory in _swept:
        return
    _swept.add(directory)
    where = os.path.join(directory, SPILL_DIR)
    try:
        names = os.listdir(where)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("%s: the old spill files could not be listed: %s", where, exc)
        return
    for name in names:
        if not name.startswith(_token + "-"):
            try:
                os.unlink(os.path.join(where, name))
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("%s: an old spill file could not be removed: %s", where, exc)


def _spill_dir(directory: str) -> str:
    """The spill directory of ``directory``, made (0700) if missing; never through a symlink."""
    where = os.path.join(directory, SPILL_DIR)
    if where not in _made:
        try:
            os.mkdir(where, 0o700)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(where).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", where) from None
        _made.add(where)
    return where


class SpilledArrays:
    """The sorted offsets and their codes of one map, in a file of its own (see module docstring)."""

    __slots__ = ("_owner", "_serial", "directory", "last", "n", "sample", "tally")

    def __init__(self, directory: str) -> None:
        #: Names this file in :data:`_kept` and :data:`_open` (an ``id`` may be reused).
        self._serial = next(_SERIALS)
        #: The token of the process that made the file (the module's string, shared); empty
        #: once closed. With :attr:`directory` and the serial it names the file (:attr:`path`):
        #: no string of its own, about 190 bytes a map.
        self._owner = ""
        #: The journal directory it is in (a map merged back in memory is written out again there).
        self.directory = directory
        #: Jobs in the file, and the largest offset (the arrays' ``_last``).
        self.n = 0
        self.last = -1
        #: The first offset of each block.
        self.sample = array("Q")
        #: Jobs per outcome code (index: the code).
        self.tally = [0] * 8
        where = _spill_dir(directory)
        name = f"{_token}-{self._serial}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(os.path.join(where, name), flags, 0o600)
        except FileNotFoundError:  # the directory removed meanwhile: made again
            _made.discard(where)
            fd = os.open(os.path.join(_spill_dir(directory), name), flags, 0o600)
        self._owner = _token
        _opened(self._serial, fd)

    @property
    def path(self) -> str:
        """The file's path (empty once closed)."""
        if not self._owner:
            return ""
        return os.path.join(self.directory, SPILL_DIR, f"{self._owner}-{self._serial}")

    @classmethod
    def write(cls, directory: str, offsets: array[int], codes: bytearray) -> SpilledArrays:
        """A new file holding the sorted ``offsets`` (at most ``2**64 - 1``) and ``codes``.

        Raises ``OSError`` (a full disk; :class:`SpillRefused`: not tried): nothing is kept then.
        """
        _room(directory, _size(len(offsets)))
        try:
            spill = cls(directory)
        except OSError:
            _pause()
            raise
        try:
            spill._put(0, offsets, codes)
        except BaseException:
            spill.close()  # a partial file removed
            raise
        return spill

    def append(self, offsets: list[int], codes: bytes) -> None:
        """Add sorted offsets past :attr:`last` with their codes; ``OSError``: nothing added."""
        _room(self.directory, 9 * (len(offsets) + SPILL_BLOCK))
        self._put(self.n, array("Q", offsets), codes)

    @property
    def _fd(self) -> int:
        """The file's descriptor: open in :data:`_open`, or opened again by name (``OSError``)."""
        fd = _open.get(self._serial)
        if fd is None:
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(self.path, flags)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE) or not _open:
                    raise
                while _open:  # the process's descriptors used up elsewhere: ours given back first
                    os.close(_open.popitem()[1])
                fd = os.open(self.path, flags)
            _opened(self._serial, fd)
        else:
            _open.move_to_end(self._serial)
        return fd

    def _put(self, at: int, offsets: array[int], codes: bytes | bytearray) -> None:
        """Write ``offsets`` and ``codes`` as jobs ``at`` on (``at`` is :attr:`n`): counted once all are.

        A failed write holds writes back (:data:`BACKOFF_S`).
        """
        k = SPILL_BLOCK
        first = at - at % k
        if first < at:  # the last block is partly filled: written again, whole
            had, had_codes = self._read_block(first // k)
            offsets, codes = array("Q", had) + array("Q", offsets), bytes(had_codes) + bytes(codes)
        wide = offsets if offsets.typecode == "Q" else array("Q", offsets)
        pad = bytes(8 * k)
        try:
            fd = self._fd
            for start in range(0, len(wide), k * _CHUNK_BLOCKS):
                out = bytearray()
                for i in range(start, min(len(wide), start + k * _CHUNK_BLOCKS), k):
                    block, block_codes = wide[i : i + k], codes[i : i + k]
                    out += block.tobytes()
                    out += pad[: 8 * (k - len(block))]  # a partial block (the last) keeps its place
                    out += block_codes
                _write_all(fd, out, (first + start) * 9)
        except OSError:
            _pause()
            raise
        finally:
            _forget_kept(self._serial)  # the block kept may have been written again
        _written()
        del self.sample[first // k :]
        self.sample.extend(wide[::k])
        for code in range(1, 8):
            self.tally[code] += codes.count(code, at - first)
        self.n = first + len(wide)
        if len(wide):
            self.last = wide[-1]

    def code_of(self, offset: int) -> int:
        """The code of ``offset`` (0: not in the file); reads at most one block.

        The block kept first, if it is this file's and ``offset`` within its bounds (the blocks
        hold disjoint ranges: it can be in no other), without a bisect of the sample.
        """
        serial, _, (offsets, codes) = _kept
        if serial != self._serial or not offsets or not offsets[0] <= offset <= offsets[-1]:
            j = bisect_right(self.sample, offset) - 1
            if j < 0:
                return 0
            offsets, codes = self._read_block(j)
        i = bisect_left(offsets, offset)
        return codes[i] if i < len(offsets) and offsets[i] == offset else 0

    def set_code(self, offset: int, code: int) -> bool:
        """Change the code of ``offset`` in place (a rank upgrade); ``False`` if it is not here.

        ``OSError``: the file is unchanged (one byte written, or none).
        """
        j = bisect_right(self.sample, offset) - 1
        if j < 0:
            return False
        offsets, codes = self._read_block(j)
        i = bisect_left(offsets, offset)
        if i >= len(offsets) or offsets[i] != offset:
            return False
        _write_all(self._fd, bytes((code,)), j * SPILL_BLOCK * 9 + 8 * SPILL_BLOCK + i)
        self.tally[codes[i]] -= 1
        self.tally[code] += 1
        _forget_kept(self._serial)
        return True

    def below(self, end: int) -> int:
        """How many offsets are less than ``end`` (reads at most one block; none past :attr:`last`)."""
        if end > self.last:
            return self.n
        j = bisect_left(self.sample, end) - 1
        if j < 0:
            return 0
        return j * SPILL_BLOCK + bisect_left(self._read_block(j)[0], end)

    def read(self, typecode: str) -> tuple[array[int], bytearray]:
        """All the offsets (an array of ``typecode``) and their codes, read back whole."""
        k = SPILL_BLOCK
        offsets, codes = array("Q"), bytearray()
        for first in range(0, self.n, k * _CHUNK_BLOCKS):
            count = min(self.n - first, k * _CHUNK_BLOCKS)
            raw = _read_all(self, first * 9, _size(count))
            for at in range(0, count, k):
                m, start = min(k, count - at), at * 9
                offsets.frombytes(raw[start : start + 8 * m])
                codes += raw[start + 8 * k : start + 8 * k + m]
        return (offsets if typecode == "Q" else array(typecode, offsets)), codes

    def _read_block(self, j: int) -> tuple[array[int], bytes]:
        """Block ``j``'s offsets and codes (the one kept, or one ``pread``)."""
        global _kept
        serial, at, block = _kept
        if at == j and serial == self._serial:
            return block
        k = SPILL_BLOCK
        m = min(k, self.n - j * k)
        raw = _read_all(self, j * k * 9, _size(m))
        offsets = array("Q")
        offsets.frombytes(raw[: 8 * m])
        block = offsets, raw[8 * k : 8 * k + m]
        _kept = self._serial, j, block
        return block

    def close(self) -> None:
        """Close the file and remove it (idempotent; never a file of another process's)."""
        fd = _open.pop(self._serial, None)
        path, owner, self._owner = self.path, self._owner, ""
        if fd is not None:
            os.close(fd)
        if owner and owner == _token:
            try:
                os.unlink(path)
            except OSError as exc:  # gone already, or left for the next start's sweep
                log.debug("%s: not removed: %s", path, exc)

    def __del__(self) -> None:
        # A map dropped (its segment compacted, the index replaced): its file goes with it.
        if getattr(self, "_owner", ""):
            self.close()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # A copy would name the same file: the first closed would remove it under the other.
        raise TypeError("a spilled map's file cannot be copied or pickled (it is this process's only)")


def _opened(serial: int, fd: int) -> None:
    """Keep ``fd`` open for file ``serial``, closing the least recently used past :data:`OPEN_MAX`."""
    _open[serial] = fd
    while len(_open) > OPEN_MAX:
        os.close(_open.popitem(last=False)[1])


def _size(count: int) -> int:
    """The bytes of ``count`` jobs from a block's start (a partial last block has no padded codes)."""
    k = SPILL_BLOCK
    return count // k * 9 * k + (8 * k + count % k if count % k else 0)


def _write_all(fd: int, data: bytes | bytearray, at: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done


def _read_all(spill: SpilledArrays, at: int, size: int) -> bytes:
    """``size`` bytes of ``spill``'s file at ``at``; any failure (an open, a short read): an I/O error."""
    try:
        raw = os.pread(spill._fd, size, at)
    except OSError as exc:
        raise JournalIOError(_WHAT, "read", exc) from exc
    if len(raw) != size:
        short = OSError(errno.EIO, f"short read: {len(raw)} of {size} bytes at {at}")
        raise JournalIOError(_WHAT, "read", short)
    return raw


def spill_failed(exc: OSError) -> None:
    """Log a failed or refused write of a spill file: a warning, then debug until a write succeeds.

    The map stays in memory (over the cap). A full disk is reported as a pause by the ledger's
    and the checkpoint's writes already (:mod:`hybridq.forwarder.disk_full`).
    """
    global _warned
    what = "not written" if isinstance(exc, SpillRefused) else "write failed"
    if _warned:
        log.debug("the ledger index's spill file: %s (%s): kept in memory", what, exc)
        return
    _warned = True
    log.warning(
        "the ledger index's spill file: %s (%s): finished jobs kept in memory, no spill for %.0f s",
        what,
        exc,
        BACKOFF_S,
    )
