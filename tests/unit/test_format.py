"""The record format: round trips, and "any truncation is a clean end" (Hypothesis)."""

from __future__ import annotations

import os

import pytest
from hybridq.errors import JournalCorruption
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.format import (
    FILE_HEADER_SIZE,
    MAX_PAYLOAD_BYTES,
    RECORD_HEADER_SIZE,
    HeaderError,
    SegmentHeader,
    decode_segment_header,
    encode_records,
    parse_segment_name,
    segment_name,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.writers import abandon_writer

payloads = st.lists(st.binary(max_size=300), min_size=1, max_size=30)
settings.register_profile(
    "journal", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile("journal")


def test_segment_header_round_trip() -> None:
    header = SegmentHeader("0123456789abcdef", b"saltsalt", bytes(8), 7, 99)
    raw = header.encode()
    assert len(raw) == FILE_HEADER_SIZE
    assert decode_segment_header(raw) == header


@pytest.mark.parametrize(
    ("offset", "reason"),
    [(0, "bad magic"), (8, "checksum"), (30, "checksum"), (61, "checksum")],
)
def test_damaged_segment_header_is_refused(offset: int, reason: str) -> None:
    raw = bytearray(SegmentHeader("0123456789abcdef", b"saltsalt", bytes(8), 0, 1).encode())
    raw[offset] ^= 0x40
    with pytest.raises(HeaderError, match=reason):
        decode_segment_header(bytes(raw))


def test_segment_names_round_trip_and_reject_others() -> None:
    assert parse_segment_name(segment_name("00ff00ff00ff00ff", 12)) == ("00ff00ff00ff00ff", 12)
    for name in ["x.wal", "00ff00ff00ff00ff-00000001.wal.tmp", "../00ff00ff00ff00ff-00000001.wal", "a.state"]:
        assert parse_segment_name(name) is None


def test_record_framing_size() -> None:
    assert len(encode_records(0, 1, 1, [b"abc", b""])) == 2 * RECORD_HEADER_SIZE + 3


@given(items=payloads)
def test_records_round_trip(tmp_path_factory: pytest.TempPathFactory, items: list[bytes]) -> None:
    path = tmp_path_factory.mktemp("j")
    with JournalWriter(path) as writer:
        ids = [writer.append(items[0]), *writer.append_many(items[1:])]
    got = list(JournalReader(path).records())
    assert [r.payload for r in got] == items
    assert [(r.writer_id, r.seq) for r in got] == [(i.writer_id, i.seq) for i in ids]


@given(items=payloads, data=st.data())
def test_any_truncation_is_a_clean_end(
    tmp_path_factory: pytest.TempPathFactory, items: list[bytes], data: st.DataObject
) -> None:
    """Cutting the last, unsealed segment anywhere after its header yields a prefix, never an error."""
    path = tmp_path_factory.mktemp("j")
    writer = JournalWriter(path)
    writer.append_many(items)
    abandon_writer(writer)  # as a crash would: the segment stays unsealed
    (segment,) = [p for p in path.iterdir() if p.suffix == ".wal"]
    size = segment.stat().st_size
    cut = data.draw(st.integers(FILE_HEADER_SIZE, size))
    os.truncate(segment, cut)
    reader = JournalReader(path)
    got = [r.payload for r in reader.records()]
    assert got == items[: len(got)]
    complete = sum(1 for end in _ends(items) if end <= cut)
    assert len(got) == complete
    assert bool(reader.torn_tails) == (cut not in (*_ends(items), FILE_HEADER_SIZE))


def _ends(items: list[bytes]) -> list[int]:
    ends, offset = [], FILE_HEADER_SIZE
    for item in items:
        offset += RECORD_HEADER_SIZE + len(item)
        ends.append(offset)
    return ends


def test_max_payload_is_accepted_and_one_more_byte_is_not(journal_dir) -> None:
    from hybridq.errors import RecordTooLarge

    with JournalWriter(journal_dir) as writer:
        writer.append(b"x" * MAX_PAYLOAD_BYTES)
        with pytest.raises(RecordTooLarge) as info:
            writer.append(b"x" * (MAX_PAYLOAD_BYTES + 1))
        assert info.value.size == MAX_PAYLOAD_BYTES + 1
    assert [len(r.payload) for r in JournalReader(journal_dir).records()] == [MAX_PAYLOAD_BYTES]


def test_a_length_over_the_maximum_is_refused_before_allocating(journal_dir) -> None:
    with JournalWriter(journal_dir) as writer:
        writer.append(b"a")
        writer.append(b"b")
    (segment,) = journal_dir.glob("*.wal")
    raw = bytearray(segment.read_bytes())
    raw[FILE_HEADER_SIZE + 4 : FILE_HEADER_SIZE + 8] = (0xFFFFFFF0).to_bytes(4, "little")
    segment.chmod(0o600)
    segment.write_bytes(bytes(raw))
    segment.chmod(0o400)
    with pytest.raises(JournalCorruption, match="impossible record length"):
        list(JournalReader(journal_dir).records())
