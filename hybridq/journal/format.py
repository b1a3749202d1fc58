"""Constants and byte layout of the journal, shared by the writer and the reader.

The specification is ``docs/journal-format.md``; every constant here is defined there first.
This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

import crc32c as _crc32c

from hybridq.errors import HeaderError as HeaderError  # noqa: PLC0414 - re-exported (the journal imports it from here)

#: Segment file magic (``docs/journal-format.md``, *File header*).
MAGIC = b"HYBRIDQJ"
#: The only on-disk version this code reads and writes.
VERSION = 1
#: Fixed size of a segment file header.
FILE_HEADER_SIZE = 64
#: Fixed size of a record header.
RECORD_HEADER_SIZE = 20
#: Hard maximum of one record's payload; checked before anything is written or allocated.
MAX_PAYLOAD_BYTES = 1 << 20
#: Default size at which a writer seals its segment and starts the next one.
DEFAULT_MAX_SEGMENT_BYTES = 64 << 20
#: Number of seal records that close a segment (two, so one damaged seal is never a torn tail).
SEAL_RECORDS = 2
#: Size of a seal record's payload: last data sequence, data record count.
SEAL_PAYLOAD_SIZE = 16

# magic, version, header size, writer id, salt, previous salt, index, first sequence, reserved
_FILE_HEADER = struct.Struct("<8sHH8s8s8sQQ8x")
_FILE_HEADER_CRC = struct.Struct("<I")
# crc, length, sequence, then one little-endian u32 word: type (low byte) and the unsynced
# distance (high 24 bits; docs/journal-format.md, *Record*)
RECORD_HEADER = struct.Struct("<IIQI")
#: The largest unsynced distance a record can state; larger distances are stored as this.
MAX_UNSYNCED_DISTANCE = (1 << 24) - 1
_SEAL_PAYLOAD = struct.Struct("<QQ")

assert _FILE_HEADER.size + _FILE_HEADER_CRC.size == FILE_HEADER_SIZE
assert RECORD_HEADER.size == RECORD_HEADER_SIZE

SEGMENT_SUFFIX = ".wal"
TMP_SUFFIX = ".tmp"
BROKEN_SUFFIX = ".broken"
SEGMENT_NAME = re.compile(r"\A([0-9a-f]{16})-([0-9]{8})\.wal\Z")


class RecordType(IntEnum):
    """Record types. ``1``-``127`` are data records for the layer above the journal."""

    DATA = 1
    SEAL = 255

    @staticmethod
    def is_data(value: int) -> bool:
        """Whether ``value`` is a data record type the layer above may use."""
        return 1 <= value <= 127


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data``, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def salt_seed(salt: bytes) -> int:
    """The CRC seed of every record in a segment with this ``salt``."""
    return crc32c(salt)


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """A decoded segment file header."""

    writer_id: str
    salt: bytes
    prev_salt: bytes
    index: int
    first_seq: int

    def encode(self) -> bytes:
        """The 64 header bytes, CRC included."""
        body = _FILE_HEADER.pack(
            MAGIC,
            VERSION,
            FILE_HEADER_SIZE,
            bytes.fromhex(self.writer_id),
            self.salt,
            self.prev_salt,
            self.index,
            self.first_seq,
        )
        return body + _FILE_HEADER_CRC.pack(crc32c(body))


def decode_segment_header(data: bytes) -> SegmentHeader:
    """Decode a segment header, raising :class:`HeaderError` with the reason when it is bad."""
    if len(data) < FILE_HEADER_SIZE:
        raise HeaderError(f"file header cut short ({len(data)} of {FILE_HEADER_SIZE} bytes)")
    body = data[: _FILE_HEADER.size]
    (stored_crc,) = _FILE_HEADER_CRC.unpack_from(data, _FILE_HEADER.size)
    magic, version, size, writer, salt, prev_salt, index, first_seq = _FILE_HEADER.unpack(body)
    if magic != MAGIC:
        raise HeaderError("bad magic: not a hybridq journal segment")
    if stored_crc != crc32c(body):
        raise HeaderError("file header checksum mismatch")
    if version != VERSION:
        raise HeaderError(f"unsupported version {version}")
    if size != FILE_HEADER_SIZE:
        raise HeaderError(f"unsupported header size {size}")
    if first_seq < 1:
        raise HeaderError("first sequence number is 0")
    return SegmentHeader(writer.hex(), salt, prev_salt, index, first_seq)


_RECORD_TAIL = struct.Struct("<IQI")  # the header after its CRC: length, sequence, type word
_CRC_FIELD = struct.Struct("<I")


_SEAL_TYPE = int(RecordType.SEAL)
_raw_crc32c = _crc32c.crc32c  # the C function itself: one lookup less per record


def record_problem(
    stored_crc: int, length: int, type_word: int, body: bytes | bytearray | memoryview, seed: int
) -> str | None:
    """Why a record whose header holds these fields is invalid; ``None`` when it is valid.

    The one record checker: the scanner, the repair, and reads by location all use it, so they
    refuse the same bytes (``docs/journal-format.md``, *Record*). ``body`` is the record from
    just after its CRC field to its end; it is only checksummed once the header fields pass.
    Sequence numbers are the caller's to check: only it knows which one is due.
    """
    if length > MAX_PAYLOAD_BYTES:
        return "impossible record length"
    if not type_word >> 8:
        return "unsynced distance is zero"
    if not 1 <= type_word & 0xFF <= 127 and type_word & 0xFF != _SEAL_TYPE:
        return "invalid record type"
    if _raw_crc32c(body, seed) != stored_crc:
        return "checksum mismatch"
    return None


def encode_records(
    seed: int, first_seq: int, rtype: int, payloads: Iterable[bytes], *, synced_seq: int | None = None
) -> bytes:
    """Frame consecutive records (sequence ``first_seq``, ``first_seq + 1``, ...) as one blob.

    Each record is its header then its payload, the CRC seeded with the segment's salt.
    ``synced_seq`` is the chain's highest sequence number known durable as these records are
    written (default: everything before ``first_seq``); each record stores its distance to it.
    """
    pack_tail, pack_crc, crc = _RECORD_TAIL.pack, _CRC_FIELD.pack, _crc32c.crc32c
    frontier = first_seq - 1 if synced_seq is None else synced_seq
    parts: list[bytes] = []
    append = parts.append
    for seq, payload in enumerate(payloads, first_seq):
        distance = min(seq - frontier, MAX_UNSYNCED_DISTANCE)
        body = pack_tail(len(payload), seq, rtype | distance << 8) + payload
        append(pack_crc(crc(body, seed)))
        append(body)
    return b"".join(parts)


def encode_record(seed: int, seq: int, rtype: int, payload: bytes) -> bytes:
    """Frame one record (see :func:`encode_records`)."""
    return encode_records(seed, seq, rtype, (payload,))


def encode_seal(last_data_seq: int, data_count: int) -> bytes:
    """The payload of a seal record."""
    return _SEAL_PAYLOAD.pack(last_data_seq, data_count)


def decode_seal(payload: bytes) -> tuple[int, int]:
    """``(last data sequence, data record count)`` from a seal record's payload."""
    last_seq, count = _SEAL_PAYLOAD.unpack(payload[:SEAL_PAYLOAD_SIZE])
    return int(last_seq), int(count)


def segment_name(writer_id: str, index: int) -> str:
    """File name of segment ``index`` of chain ``writer_id``."""
    return f"{writer_id}-{index:08d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> tuple[str, int] | None:
    """``(writer id, index)`` for a segment file name, ``None`` for any other name."""
    m = SEGMENT_NAME.match(name)
    if m is None:
        return None
    return m.group(1), int(m.group(2))
