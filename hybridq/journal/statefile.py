"""Atomic, checksummed state files (a reader's checkpoint and the like).

Format: ``docs/journal-format.md`` (*State files*). A state file is replaced, never rewritten in
place (docs/reliability.md rule 6): temp file, fsync, ``os.replace``, fsync the directory
(:func:`~hybridq.journal.fileops.replace_durably`).

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import os
import struct

from hybridq.errors import StateFileCorrupt

from .fileops import OS_FILEOPS, FileOps, replace_durably, write_all
from .format import crc32c

__all__ = ["MAX_STATE_BYTES", "read_state", "write_state"]

STATE_MAGIC = b"HYBRIDQS"
STATE_VERSION = 1
STATE_SUFFIX = ".state"
#: A state file larger than this is refused on read and on write.
MAX_STATE_BYTES = 64 << 20
_HEADER = struct.Struct("<8sHHI")  # magic, version, reserved, payload length; then CRC u32
_CRC = struct.Struct("<I")
_HEADER_SIZE = _HEADER.size + _CRC.size


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
