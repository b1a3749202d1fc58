"""Atomic, checksummed state files (a reader's checkpoint and the like).

Format: ``docs/journal-format.md`` (*State files*). A state file is replaced, never rewritten in
place (docs/reliability.md rule 6): temp file, fsync, ``os.replace``, fsync the directory
(:func:`~hybridq.journal.fileops.replace_durably`).

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable, Iterator
from typing import Self

from hybridq.errors import StateFileCorrupt

from .fileops import OS_FILEOPS, FileOps, replace_durably, write_all
from .format import crc32c

__all__ = ["MAX_STATE_BYTES", "StatePayload", "open_state", "read_state", "write_state", "write_state_pieces"]

STATE_MAGIC = b"HYBRIDQS"
STATE_VERSION = 1
STATE_SUFFIX = ".state"
#: A state file larger than this is refused on read and on write.
MAX_STATE_BYTES = 64 << 20
_HEADER = struct.Struct("<8sHHI")  # magic, version, reserved, payload length; then CRC u32
_CRC = struct.Struct("<I")
_HEADER_SIZE = _HEADER.size + _CRC.size
#: How much of a state file :func:`open_state` reads at a time.
_CHUNK = 1 << 20


def _path(directory: str, name: str) -> str:
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ValueError(f"invalid state file name {name!r}")
    return os.path.join(directory, name + STATE_SUFFIX)


def encode_state(payload: bytes) -> bytes:
    """The bytes of a state file holding ``payload``."""
    head = _HEADER.pack(STATE_MAGIC, STATE_VERSION, 0, len(payload))
    return head + _CRC.pack(crc32c(payload, crc32c(head))) + payload


def write_state(directory: str, name: str, payload: bytes, *, fileops: FileOps = OS_FILEOPS) -> None:
    """Durably replace state file ``name`` in ``directory`` with ``payload``.

    When this returns, the new contents survive power loss; if it raises or the machine dies
    midway, the old contents are still there, whole.
    """
    if len(payload) > MAX_STATE_BYTES:
        raise ValueError(f"state payload of {len(payload)} bytes is over {MAX_STATE_BYTES}")
    data = encode_state(payload)
    replace_durably(fileops, _path(directory, name), lambda fd: write_all(fileops, fd, data))


def write_state_pieces(
    directory: str, name: str, pieces: Iterable[bytes], *, fileops: FileOps = OS_FILEOPS
) -> int:
    """:func:`write_state` of the payload ``pieces`` joined, never held whole; returns its length.

    Same file, same durability: the pieces go to the temp file as they come, after room for
    the header, whose length and CRC (the header's, continued over the payload: computed from
    the payload's own CRC, :func:`_crc32c_combine`) are written last, before the fsync and the
    rename. A payload over :data:`MAX_STATE_BYTES` raises ``ValueError`` (the old file stays).
    Whatever it raises, the temp file is removed: a refused save (up to 64 MiB written) must
    not take the disk the journal's appends need.
    """
    length, crc = 0, 0

    def fill(fd: int) -> None:
        nonlocal length, crc
        write_all(fileops, fd, bytes(_HEADER_SIZE))
        for piece in pieces:
            length += len(piece)
            if length > MAX_STATE_BYTES:
                raise ValueError(f"state payload of over {MAX_STATE_BYTES} bytes")
            crc = crc32c(piece, crc)
            write_all(fileops, fd, piece)
        head = _HEADER.pack(STATE_MAGIC, STATE_VERSION, 0, length)
        os.lseek(fd, 0, os.SEEK_SET)
        write_all(fileops, fd, head + _CRC.pack(_crc32c_combine(crc32c(head), crc, length)))

    path = _path(directory, name)
    try:
        replace_durably(fileops, path, fill)
    except BaseException:
        with contextlib.suppress(OSError):  # gone already if the rename was done
            fileops.unlink(path + ".tmp")
        raise
    return length


class StatePayload:
    """An open state file whose checksum was checked: its payload read in chunks (:func:`open_state`)."""

    def __init__(self, fd: int, fileops: FileOps, path: str, head: bytes) -> None:
        self._fd, self._ops, self._path, self._head = fd, fileops, path, head

    def chunks(self) -> Iterator[bytes]:
        """The payload, from its start, in chunks of up to 1 MiB.

        Its checksum is computed again as they are handed out: the last one raises
        :class:`StateFileCorrupt` if the bytes read differ from those checked (a second read
        of the file, the media or the page cache may have changed them), so a reader that
        reads it to its end never keeps what it parsed from them (docs/reliability.md rule 12).
        """
        os.lseek(self._fd, _HEADER_SIZE, os.SEEK_SET)
        (stored,) = _CRC.unpack_from(self._head, _HEADER.size)
        crc, read = crc32c(self._head[: _HEADER.size]), 0
        while data := self._ops.read(self._fd, _CHUNK):
            crc, read = crc32c(data, crc), read + len(data)
            yield data
        if crc != stored or read != _HEADER.unpack_from(self._head)[3]:
            raise StateFileCorrupt(self._path, "changed since its checksum was checked")

    def close(self) -> None:
        """Close the file."""
        self._ops.close(self._fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_state(directory: str, name: str, *, fileops: FileOps = OS_FILEOPS) -> StatePayload | None:
    """:func:`read_state` that never holds the payload whole: checked, then read in chunks.

    The whole file's checksum is checked (reading it once) before this returns, so a damaged
    file raises :class:`StateFileCorrupt` before any of it is used (docs/reliability.md rule
    12); the fd keeps the checked file even if it is replaced meanwhile. The bytes read by
    :meth:`StatePayload.chunks` are checked again as read (the last chunk raises if they differ).
    ``None``: no file.
    """
    path = _path(directory, name)
    try:
        fd = fileops.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        head = _check_whole(path, fd, fileops)
    except BaseException:
        fileops.close(fd)
        raise
    return StatePayload(fd, fileops, path, head)


def _check_whole(path: str, fd: int, fileops: FileOps) -> bytes:
    """The open file's header; raises :class:`StateFileCorrupt` unless it and the checksum are right."""
    size = os.fstat(fd).st_size
    if size > MAX_STATE_BYTES + _HEADER_SIZE:
        raise StateFileCorrupt(path, f"{size} bytes is over the maximum")
    head = fileops.read(fd, _HEADER_SIZE)
    if len(head) < _HEADER_SIZE:
        raise StateFileCorrupt(path, "cut short")
    (stored,) = _CRC.unpack_from(head, _HEADER.size)
    length = _check_header(path, head, size)
    crc, read = crc32c(head[: _HEADER.size]), 0
    while data := fileops.read(fd, _CHUNK):
        crc, read = crc32c(data, crc), read + len(data)
    if read != length:
        raise StateFileCorrupt(path, f"length {length} does not match the file size")
    if crc != stored:
        raise StateFileCorrupt(path, "checksum mismatch")
    return head


def _check_header(path: str, head: bytes, size: int) -> int:
    """The payload length the header ``head`` gives; raises :class:`StateFileCorrupt` if wrong."""
    magic, version, _, length = _HEADER.unpack_from(head)
    if magic != STATE_MAGIC:
        raise StateFileCorrupt(path, "bad magic")
    if version != STATE_VERSION:
        raise StateFileCorrupt(path, f"unsupported version {version}")
    if length != size - _HEADER_SIZE:
        raise StateFileCorrupt(path, f"length {length} does not match the file size")
    return int(length)


#: CRC32C's polynomial, reflected.
_POLY = 0x82F63B78


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of ``a + b`` from ``crc1`` of ``a``, ``crc2`` of ``b`` and ``len(b)``.

    zlib's ``crc32_combine`` (CRC32C's polynomial): ``crc1`` shifted through ``len2`` zero
    bytes by squaring the one-zero-bit operator, O(log ``len2``).
    """
    if len2 == 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two
    odd = _gf2_square(even)  # four
    while True:
        even = _gf2_square(odd)  # the first pass: one zero byte
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def read_state(directory: str, name: str, *, fileops: FileOps = OS_FILEOPS) -> bytes | None:
    """The payload of state file ``name``, or ``None`` if it does not exist.

    Raises :class:`StateFileCorrupt` when the file exists but is damaged: a damaged state file
    is never treated as missing (docs/reliability.md rule 12).
    """
    path = _path(directory, name)
    try:
        fd = fileops.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_STATE_BYTES + _HEADER_SIZE:
            raise StateFileCorrupt(path, f"{size} bytes is over the maximum")
        chunks = []
        while data := fileops.read(fd, size + 1):
            chunks.append(data)
        raw = b"".join(chunks)
    finally:
        fileops.close(fd)
    if len(raw) < _HEADER_SIZE:
        raise StateFileCorrupt(path, "cut short")
    magic, version, _, length = _HEADER.unpack_from(raw)
    (stored,) = _CRC.unpack_from(raw, _HEADER.size)
    if magic != STATE_MAGIC:
        raise StateFileCorrupt(path, "bad magic")
    if version != STATE_VERSION:
        raise StateFileCorrupt(path, f"unsupported version {version}")
    if length != len(raw) - _HEADER_SIZE:
        raise StateFileCorrupt(path, f"length {length} does not match the file size")
    payload = raw[_HEADER_SIZE:]
    if crc32c(payload, crc32c(raw[: _HEADER.size])) != stored:
        raise StateFileCorrupt(path, "checksum mismatch")
    return payload
