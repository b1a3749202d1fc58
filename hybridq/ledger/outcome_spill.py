"""A :class:`~hybridq.ledger.outcomes.SegmentOutcomes`'s merged arrays on disk: :class:`SpilledArrays`.

The ledger index keeps one map of finished jobs per live journal segment; past a cap on the
offsets it holds in memory (:meth:`LedgerIndex.spill_past
<hybridq.ledger.index.LedgerIndex.spill_past>`), whole maps' sorted arrays move to a file and are
looked up there (issue 29; docs/forwarder.md, "Memory: the bound that holds now").

The file is a runtime representation only, never durable and never trusted across a restart:
one file a spilled map, of this process's, in the journal's ``.index-spill`` directory. Where it
is, its name, its descriptor (a few kept open, the others opened again by name), its removal (with
its map, or by the next start's sweep) and the room a write must leave on the disk are
:mod:`hybridq.ledger.spill_files`'s; this module is the file's layout, its reads and its writes.

Layout: blocks of :data:`SPILL_BLOCK` jobs, block ``j`` at ``j * SPILL_BLOCK * 9``: the
block's offsets (8 bytes each, native order), then their outcome codes (one byte each); the last
block is partly filled. In memory stay the first offset of each block (:attr:`sample`: 8 bytes a
block, 0.016 bytes a job), the count, the last offset, how many jobs have each code
(:attr:`tally`); the last block read, of any file, is kept once for the process (the pushes
ask in offset order). A lookup: the block kept if the offset is within its bounds, else one
``bisect`` of the sample and one ``os.pread`` of a block; then one ``bisect`` in it. What stays
in memory is about 2.4 KB per spilled map of 100,000 jobs (``tests/unit/test_index_memory.py``).

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
import os
from array import array
from bisect import bisect_left, bisect_right
from typing import NoReturn, SupportsIndex

from hybridq.errors import JournalIOError
from hybridq.ledger import spill_files

__all__ = ["SPILL_BLOCK", "SpilledArrays"]

#: Jobs per block of the file: one lookup reads one block (9 bytes a job: 4.5 KiB).
SPILL_BLOCK = 512
#: How the file is named in an error.
_WHAT = "the ledger index's spill file"
#: Blocks written or read per system call when a whole map is written or read back.
_CHUNK_BLOCKS = 64

_SERIALS = itertools.count(1)
#: The last block read, of any file (its file's serial, its index, its offsets and codes): the
#: pushes and the reconcile pass ask in offset order, one segment after another. One for the
#: process, not one a map: 4.5 KiB per spilled segment would be most of what it keeps.
_kept: tuple[int, int, tuple[array[int], bytes]] = (0, -1, (array("Q"), b""))


def _forget_kept(serial: int) -> None:
    global _kept
    if _kept[0] == serial:
        _kept = (0, -1, (array("Q"), b""))


class SpilledArrays:
    """The sorted offsets and their codes of one map, in a file of its own (see module docstring)."""

    __slots__ = ("_owner", "_serial", "directory", "last", "n", "sample", "tally")

    def __init__(self, directory: str) -> None:
        #: Names this file in :data:`_kept` and among the open descriptors (an ``id`` may be reused).
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
        self._owner = spill_files.create(directory, self._serial)

    @property
    def path(self) -> str:
        """The file's path (empty once closed)."""
        return spill_files.path(self.directory, self._owner, self._serial)

    @classmethod
    def write(cls, directory: str, offsets: array[int], codes: bytearray) -> SpilledArrays:
        """A new file holding the sorted ``offsets`` (at most ``2**64 - 1``) and ``codes``.

        Raises ``OSError`` (a full disk; :class:`~hybridq.ledger.spill_files.SpillRefused`: not
        tried): nothing is kept then.
        """
        spill_files.room(directory, _size(len(offsets)))
        try:
            spill = cls(directory)
        except OSError:
            spill_files.pause()
            raise
        try:
            spill._put(0, offsets, codes)
        except BaseException:
            spill.close()  # a partial file removed
            raise
        return spill

    def append(self, offsets: list[int], codes: bytes) -> None:
        """Add sorted offsets past :attr:`last` with their codes; ``OSError``: nothing added."""
        spill_files.room(self.directory, 9 * (len(offsets) + SPILL_BLOCK))
        self._put(self.n, array("Q", offsets), codes)

    @property
    def _fd(self) -> int:
        """The file's descriptor: open already, or opened again by name (``OSError``)."""
        return spill_files.descriptor(self.directory, self._owner, self._serial)

    def _put(self, at: int, offsets: array[int], codes: bytes | bytearray) -> None:
        """Write ``offsets`` and ``codes`` as jobs ``at`` on (``at`` is :attr:`n`): counted once all are.

        A failed write holds writes back (:data:`~hybridq.ledger.spill_files.BACKOFF_S`).
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
            spill_files.pause()
            raise
        finally:
            _forget_kept(self._serial)  # the block kept may have been written again
        spill_files.written()
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
        path, owner, self._owner = self.path, self._owner, ""
        spill_files.release(self._serial, owner, path)

    def __del__(self) -> None:
        # A map dropped (its segment compacted, the index replaced): its file goes with it.
        if getattr(self, "_owner", ""):
            self.close()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # A copy would name the same file: the first closed would remove it under the other.
        raise TypeError("a spilled map's file cannot be copied or pickled (it is this process's only)")


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
