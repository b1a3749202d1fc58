"""A :class:`~hybridq.ledger.outcomes.SegmentOutcomes`'s merged arrays on disk: :class:`SpilledArrays`.

The ledger index keeps one map of finished jobs per live journal segment; past a cap on the
offsets it holds in memory (:meth:`LedgerIndex.spill_past
<hybridq.ledger.index.LedgerIndex.spill_past>`), whole maps' sorted arrays move to a file and are
looked up there (issue 29; docs/forwarder.md, "Memory: the bound that holds now").

The file is a runtime representation only, never durable and never trusted across a restart:
an anonymous file (``tempfile.TemporaryFile``) in the ledger's directory, so it is on the
journal's disk (not a tmpfs) and is gone with the process, even one killed. The saved index
keeps writing every map in full (it reads a spilled one back).

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
forwarder stops as for its other journal I/O errors. An error writing it (a full disk) is the
caller's to handle: the map stays in memory (:mod:`hybridq.ledger.outcomes`).

This module must not import redis or rq.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import tempfile
from array import array
from bisect import bisect_left, bisect_right

from hybridq.errors import JournalIOError

__all__ = ["SPILL_BLOCK", "SpilledArrays", "spill_failed"]

log = logging.getLogger("hybridq.ledger")

#: Jobs per block of the file: one lookup reads one block (9 bytes a job: 4.5 KiB).
SPILL_BLOCK = 512
#: How the file is named in an error (it has no name: anonymous).
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
    """The sorted offsets and their codes of one map, in an anonymous file (see module docstring)."""

    __slots__ = ("_fd", "_serial", "directory", "last", "n", "sample", "tally")

    def __init__(self, directory: str) -> None:
        #: Where the file is (a map merged back in memory is written out again there).
        self.directory = directory
        # The file's descriptor alone (no file object: one dropped in a reference cycle could be
        # finalized before this and warn); TemporaryFile names none on Linux (O_TMPFILE).
        with tempfile.TemporaryFile(dir=directory, buffering=0) as file:
            self._fd = os.dup(file.fileno())
        #: Jobs in the file, and the largest offset (the arrays' ``_last``).
        self.n = 0
        self.last = -1
        #: The first offset of each block.
        self.sample = array("Q")
        #: Jobs per outcome code (index: the code).
        self.tally = [0] * 8
        #: Names this file in :data:`_kept` (an ``id`` may be reused once a map is dropped).
        self._serial = next(_SERIALS)

    @classmethod
    def write(cls, directory: str, offsets: array[int], codes: bytearray) -> SpilledArrays:
        """A new file holding the sorted ``offsets`` (at most ``2**64 - 1``) and ``codes``.

        Raises ``OSError`` (a full disk): nothing is kept then.
        """
        spill = cls(directory)
        try:
            spill._put(0, offsets, codes)
        except BaseException:
            spill.close()
            raise
        return spill

    def append(self, offsets: list[int], codes: bytes) -> None:
        """Add sorted offsets past :attr:`last` with their codes; ``OSError``: nothing added."""
        self._put(self.n, array("Q", offsets), codes)

    def _put(self, at: int, offsets: array[int], codes: bytes | bytearray) -> None:
        """Write ``offsets`` and ``codes`` as jobs ``at`` on (``at`` is :attr:`n`): counted once all are."""
        k = SPILL_BLOCK
        first = at - at % k
        if first < at:  # the last block is partly filled: written again, whole
            had, had_codes = self._read_block(first // k)
            offsets, codes = array("Q", had) + array("Q", offsets), bytes(had_codes) + bytes(codes)
        wide = offsets if offsets.typecode == "Q" else array("Q", offsets)
        fd = self._fd
        pad = bytes(8 * k)
        for start in range(0, len(wide), k * _CHUNK_BLOCKS):
            out = bytearray()
            for i in range(start, min(len(wide), start + k * _CHUNK_BLOCKS), k):
                block, block_codes = wide[i : i + k], codes[i : i + k]
                out += block.tobytes()
                out += pad[: 8 * (k - len(block))]  # a partial block (the last) keeps its place
                out += block_codes
            _write_all(fd, out, (first + start) * 9)
        _forget_kept(self._serial)  # the block kept may have been written again
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
        """How many offsets are less than ``end`` (reads at most one block)."""
        j = bisect_left(self.sample, end) - 1
        if j < 0:
            return 0
        return j * SPILL_BLOCK + bisect_left(self._read_block(j)[0], end)

    def read(self, typecode: str) -> tuple[array[int], bytearray]:
        """All the offsets (an array of ``typecode``) and their codes, read back whole."""
        k, fd = SPILL_BLOCK, self._fd
        offsets, codes = array("Q"), bytearray()
        for first in range(0, self.n, k * _CHUNK_BLOCKS):
            count = min(self.n - first, k * _CHUNK_BLOCKS)
            raw = _read_all(fd, first * 9, _size(count))
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
        raw = _read_all(self._fd, j * k * 9, _size(m))
        offsets = array("Q")
        offsets.frombytes(raw[: 8 * m])
        block = offsets, raw[8 * k : 8 * k + m]
        _kept = self._serial, j, block
        return block

    def close(self) -> None:
        """Close the file (it is deleted already: anonymous)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        # A map dropped (its segment compacted, the index replaced): its file goes with it.
        if getattr(self, "_fd", -1) >= 0:
            self.close()


def _size(count: int) -> int:
    """The bytes of ``count`` jobs from a block's start (a partial last block has no padded codes)."""
    k = SPILL_BLOCK
    return count // k * 9 * k + (8 * k + count % k if count % k else 0)


def _write_all(fd: int, data: bytes | bytearray, at: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done


def _read_all(fd: int, at: int, size: int) -> bytes:
    """``size`` bytes at ``at``; any failure (a short read too) is the ledger's I/O error."""
    try:
        raw = os.pread(fd, size, at)
    except OSError as exc:
        raise JournalIOError(_WHAT, "read", exc) from exc
    if len(raw) != size:
        short = OSError(errno.EIO, f"short read: {len(raw)} of {size} bytes at {at}")
        raise JournalIOError(_WHAT, "read", short)
    return raw


_warned = False


def spill_failed(exc: OSError) -> None:
    """Log a failed write of a spill file: a warning the first time, then at debug level.

    The map stays in memory (over the cap). A full disk is reported as a pause by the ledger's
    and the checkpoint's writes already (:mod:`hybridq.forwarder.disk_full`).
    """
    global _warned
    if _warned:
        log.debug("the ledger index's spill file: write failed (%s): kept in memory", exc)
        return
    _warned = True
    log.warning("the ledger index's spill file: write failed (%s): finished jobs kept in memory", exc)
