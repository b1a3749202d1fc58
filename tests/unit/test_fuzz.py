"""Fuzzing the two decoders that read bytes from outside: the journal reader and the envelope.

Whatever the bytes, the reader raises only the journal's typed errors (or reads cleanly), never
allocates by a length it has not checked, and never yields a record that differs from what was
written; the envelope decoder raises only :class:`EnvelopeError`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hybridq.envelope import Envelope
from hybridq.errors import EnvelopeError, JournalError
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.format import FILE_HEADER_SIZE, MAX_PAYLOAD_BYTES
from hybridq.journal.recovery import verify
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _template() -> tuple[Path, dict[int, bytes], str]:
    """A small sealed journal (built once), its payloads by sequence number, its segment name."""
    root = Path(tempfile.mkdtemp(prefix="hq-fuzz-"))
    written: dict[int, bytes] = {}
    with JournalWriter(root) as writer:
        for i in range(12):
            payload = b"payload-%d-" % i + bytes(range(i * 7 % 50))
            rid = writer.append(payload)
            written[rid.seq] = payload
    [segment] = [p.name for p in root.glob("*.wal")]
    return root, written, segment


TEMPLATE, WRITTEN, SEGMENT = _template()
TEMPLATE_BYTES = (TEMPLATE / SEGMENT).read_bytes()


def _journal_with(raw: bytes) -> Path:
    path = Path(tempfile.mkdtemp(prefix="hq-fuzz-"))
    path.chmod(0o700)
    segment = path / SEGMENT
    segment.write_bytes(raw)
    segment.chmod(0o400)  # sealed, like the template
    return path


def _read_all(path: Path) -> list[tuple[int, bytes]]:
    return [(r.seq, r.payload) for r in JournalReader(str(path)).records()]


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_as_a_segment_raise_only_journal_errors(raw: bytes) -> None:
    path = _journal_with(raw)
    try:
        verify(path)
        records = _read_all(path)
    except JournalError:
        return
    finally:
        shutil.rmtree(path, ignore_errors=True)
    for seq, payload in records:  # a random file that reads cleanly must hold real records
        assert len(payload) <= MAX_PAYLOAD_BYTES
        assert seq >= 0


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(TEMPLATE_BYTES) - 1), st.integers(1, 255)), min_size=1, max_size=8)
)
def test_a_damaged_journal_never_yields_a_record_that_was_not_written(flips: list[tuple[int, int]]) -> None:
    raw = bytearray(TEMPLATE_BYTES)
    for offset, mask in flips:
        raw[offset] ^= mask
    path = _journal_with(bytes(raw))
    records: list[tuple[int, bytes]] = []
    try:
        records.extend((record.seq, record.payload) for record in JournalReader(str(path)).records())
    except JournalError:
        pass  # refused: the point is what came out before, below
    finally:
        shutil.rmtree(path, ignore_errors=True)
    for seq, payload in records:
        assert WRITTEN.get(seq) == payload, (seq, payload)


@FUZZ
@given(st.integers(FILE_HEADER_SIZE, len(TEMPLATE_BYTES)), st.binary(max_size=64))
def test_a_truncated_or_extended_journal_never_yields_a_record_that_was_not_written(
    cut: int, tail: bytes
) -> None:
    path = _journal_with(TEMPLATE_BYTES[:cut] + tail)
    try:
        records = _read_all(path)
    except JournalError:
        records = []
    finally:
        shutil.rmtree(path, ignore_errors=True)
    for seq, payload in records:
        assert WRITTEN.get(seq) == payload


@FUZZ
@given(st.integers(MAX_PAYLOAD_BYTES + 1, 2**32 - 1))
def test_a_length_over_the_cap_is_refused(length: int) -> None:
    """The length is checked against the cap (and the bytes left) before anything is read."""
    raw = bytearray(TEMPLATE_BYTES)
    raw[FILE_HEADER_SIZE + 4 : FILE_HEADER_SIZE + 8] = length.to_bytes(4, "little")
    path = _journal_with(bytes(raw))
    try:
        with pytest.raises(JournalError):
            _read_all(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
ENVELOPE_KEYS = [
    "v",
    "id",
    "func",
    "args",
    "kwargs",
    "queue",
    "key",
    "created_at",
    "timeout",
    "result_ttl",
    "run_at",
]


@FUZZ
@given(st.binary(max_size=512))
def test_envelope_decoder_on_arbitrary_bytes(raw: bytes) -> None:
    with contextlib.suppress(EnvelopeError):
        Envelope.from_bytes(raw)


@FUZZ
@given(
    st.dictionaries(st.sampled_from([*ENVELOPE_KEYS, "retry", "meta", "requeue", "x"]), JSONISH, max_size=14)
)
def test_envelope_decoder_on_arbitrary_json_objects(obj: dict[str, object]) -> None:
    try:
        env = Envelope.from_bytes(json.dumps(obj).encode())
    except EnvelopeError:
        return
    # Whatever decodes re-encodes, and decodes to the same envelope.
    assert Envelope.from_bytes(env.to_bytes()).to_dict() == env.to_dict()
