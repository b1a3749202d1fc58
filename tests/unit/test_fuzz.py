"""Fuzzing the two decoders that read bytes from outside: the journal reader and the envelope.

Whatever the bytes, the reader raises only the journal's typed errors (or reads cleanly), never
allocates by a length it has not checked, and never yields a record that differs from what was
written; the envelope decoder raises only :class:`EnvelopeError`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hybridq.envelope import Envelope
from hybridq.errors import EnvelopeError, JournalError
from hybridq.journal import JournalReader
from hybridq.journal.format import FILE_HEADER_SIZE, MAX_PAYLOAD_BYTES
from hybridq.journal.recovery import verify
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzzing import journal_with, make_template_journal, read_all

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


_TEMPLATE_DIR = tempfile.mkdtemp(prefix="hq-fuzz-")
atexit.register(shutil.rmtree, _TEMPLATE_DIR, ignore_errors=True)
TEMPLATE = make_template_journal(Path(_TEMPLATE_DIR))
WRITTEN, SEGMENT, TEMPLATE_BYTES = TEMPLATE.written, TEMPLATE.segment, TEMPLATE.raw


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_as_a_segment_raise_only_journal_errors(raw: bytes) -> None:
    path = journal_with(raw, SEGMENT)
    try:
        verify(path)
        records = read_all(path)
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
    path = journal_with(bytes(raw), SEGMENT)
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
    path = journal_with(TEMPLATE_BYTES[:cut] + tail, SEGMENT)
    try:
        records = read_all(path)
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
    path = journal_with(bytes(raw), SEGMENT)
    try:
        with pytest.raises(JournalError):
            read_all(path)
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


# Findings of the atheris tier (scripts/fuzz), kept as regression tests. Each of these decoded
# into something to_bytes() refuses, or raised past EnvelopeError (the forwarder skips a record
# that raises EnvelopeError; anything else stops it on that record, restart after restart).
VALID = {"v": 1, "id": "j", "func": "tasks.add", "queue": "q", "key": "k", "created_at": 17}


def _with(**fields: object) -> bytes:
    return json.dumps({**VALID, **fields}).encode()


@pytest.mark.parametrize(
    "raw",
    [
        _with(kwargs={"c": 1}).replace(b"1}", b"1e6300}"),  # found by atheris: an infinite float
        _with(args=[float("nan")]),  # NaN, as json.dumps writes it
        _with(meta={"x": float("-inf")}),
        _with(result_ttl="Infinity"),  # found by atheris: a string that float() reads as inf
        _with(run_at="nan"),
        _with(created_at=10**400),  # float() of it raises OverflowError
        _with(retry={"max_attempts": 2, "backoff": 10**400}),
    ],
    ids=["1e6300", "NaN", "-Infinity", "string-Infinity", "string-nan", "huge-int", "huge-backoff"],
)
def test_an_envelope_number_that_cannot_be_written_back_is_refused(raw: bytes) -> None:
    with pytest.raises(EnvelopeError):
        Envelope.from_bytes(raw)


@pytest.mark.parametrize("retry", [1, "x", [1, 2], True])
def test_an_envelope_whose_retry_is_not_an_object_is_refused(retry: object) -> None:
    """Found by atheris: ``"retry": 1`` raised AttributeError from ``Retry.from_json``."""
    with pytest.raises(EnvelopeError):
        Envelope.from_bytes(_with(retry=retry))


def _nested(depth: int) -> bytes:
    return _with(args=[]).replace(b"[]", b"[" * depth + b"]" * depth)


@pytest.mark.parametrize("depth", [101, 960, 990, 5000])
def test_an_envelope_nested_too_deep_is_refused(depth: int) -> None:
    """990 levels raised RecursionError out of json.loads; 960 decoded, then raised RecursionError
    (not NotSerializable) when encoded again 60 frames deeper. The cap is 100 levels."""
    with pytest.raises(EnvelopeError):
        Envelope.from_bytes(_nested(depth))


def test_an_envelope_nested_within_the_cap_round_trips() -> None:
    env = Envelope.from_bytes(_nested(50))
    assert Envelope.from_bytes(env.to_bytes()).to_dict() == env.to_dict()
