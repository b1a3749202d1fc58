"""Fuzzing the decoders that read bytes from outside: the journal reader, the envelope, events.

Whatever the bytes, the reader raises only the journal's typed errors (or reads cleanly), never
allocates by a length it has not checked, and never yields a record that differs from what was
written; the envelope decoder raises only :class:`EnvelopeError`, and whatever it accepts
becomes a job hash Redis and RQ can take; a completion event parses into a ledger entry or
raises only what the forwarder drops an event for (issue 13.2: one bad record or event must not
stop forwarding).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, JournalError
from hybridq.journal import JournalReader
from hybridq.journal.format import FILE_HEADER_SIZE, MAX_PAYLOAD_BYTES
from hybridq.journal.recovery import verify
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzzing import check_event, check_job_hash, journal_with, make_template_journal, read_all

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


#: Text with lone surrogates: JSON carries them, redis-py's UTF-8 encoding does not (issue 13.2).
SURROGATE_TEXT = st.text(st.characters(categories=["Cs"]) | st.characters(), max_size=6)
#: Numbers that overflow a float, a C long or datetime's range (findings of issue 13.2).
EXTREMES = st.sampled_from([10**400, -(10**400), 2**63, 2**31, 1e18, -1e18, 1e300, 253402300800])
JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | EXTREMES
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | SURROGATE_TEXT,
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
    "description",
    "sig",
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
    # Whatever decodes re-encodes, and decodes to the same envelope, and can be pushed to RQ.
    assert Envelope.from_bytes(env.to_bytes()).to_dict() == env.to_dict()
    check_job_hash(env)


#: Per field, values of the right type (within range and not) or anything, so that most decode.
NUMBERS = st.floats(0, 1e12) | st.integers(0, 10**12) | EXTREMES
NEARLY_VALID = {
    "created_at": NUMBERS | JSONISH,
    "timeout": NUMBERS | JSONISH,
    "result_ttl": NUMBERS | JSONISH,
    "run_at": NUMBERS | JSONISH,
    "description": SURROGATE_TEXT | JSONISH,
    "requeue": st.integers(0, 10) | EXTREMES | JSONISH,
    "args": st.lists(SURROGATE_TEXT | JSONISH, max_size=3) | JSONISH,
    "kwargs": st.dictionaries(SURROGATE_TEXT, JSONISH, max_size=3) | JSONISH,
    "meta": st.dictionaries(SURROGATE_TEXT, JSONISH, max_size=3) | JSONISH,
    "retry": st.fixed_dictionaries(
        {}, optional={"max_attempts": st.integers(1, 10) | EXTREMES, "backoff": NUMBERS}
    )
    | JSONISH,
}


@FUZZ
@given(
    st.fixed_dictionaries(
        {"id": st.just("j"), "func": st.just("tasks.add"), "queue": st.just("q"), "key": st.just("k")},
        optional=NEARLY_VALID,
    ),
    st.integers(1, 2),
)
def test_every_envelope_that_decodes_makes_a_job_hash_redis_takes(obj: dict[str, object], v: int) -> None:
    """Nearly valid envelopes (the four fixed fields valid), so that most decode: ``job_hash`` then
    raised for ``created_at=1e18`` and made redis-py raise DataError for ``description={}``."""
    try:
        env = Envelope.from_bytes(json.dumps({"v": v, "created_at": 17, **obj}).encode())
    except EnvelopeError:
        return
    check_job_hash(env)


EVENT_KEYS = ["id", "outcome", "final", "attempt", "dup", "error", "retry_delay", "at", "queue", "x"]
LOC = st.tuples(st.text(max_size=4) | JSONISH, st.integers(0, 10) | JSONISH, st.integers(0, 10**6) | JSONISH)


@FUZZ
@given(st.binary(max_size=512))
def test_event_parser_on_arbitrary_bytes(raw: bytes) -> None:
    check_event(raw)


@FUZZ
@given(
    st.fixed_dictionaries(
        {"loc": LOC.map(list) | JSONISH},
        optional=dict.fromkeys(EVENT_KEYS, JSONISH)
        | {"outcome": st.sampled_from(["succeeded", "failed"]), "id": st.text(max_size=8)},
    )
)
def test_event_parser_on_arbitrary_json_objects(body: dict[str, object]) -> None:
    """Dropped, or a ledger entry that encodes as strict JSON and decodes to itself."""
    check_event(json.dumps(body).encode())  # json.dumps writes NaN and Infinity, as a forger can


@pytest.mark.parametrize(
    "raw",
    [
        b'{"id":"j","loc":["w",0,64],"outcome":"succeeded","at":1' + b"0" * 400 + b"}",
        b'{"id":"j","loc":["w",Infinity,64],"outcome":"succeeded"}',
        b'{"id":"j","loc":["w",0,64],"outcome":"failed","final":false,"attempt":Infinity}',
        b'{"id":"j","loc":["w",0,64],"outcome":"failed","final":false,"retry_delay":1' + b"0" * 400 + b"}",
        b'{"id":"j","loc":["w",0,64],"outcome":"succeeded","at":NaN}',
        b'{"id":"j","loc":["w",0,64],"outcome":"failed","error":{"a":1}}',
        b"[" * 100_000,
    ],
    ids=["at-10**400", "loc-inf", "attempt-inf", "retry_delay-10**400", "at-NaN", "error-object", "deep"],
)
def test_an_event_with_a_number_out_of_range_is_dropped(raw: bytes) -> None:
    """Each of these raised OverflowError or RecursionError (or reached the ledger as NaN): the
    forwarder stopped on it at every start."""
    assert check_event(raw) is None


def test_a_well_formed_event_parses() -> None:
    entry = check_event(b'{"id":"j","loc":["w",0,64],"outcome":"failed","final":false,"retry_delay":2.5}')
    assert entry is not None
    assert (entry.kind, entry.loc, entry.run_at) == ("retry", ("w", 0, 64), 1_700_000_002.5)


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


@pytest.mark.parametrize(
    "fields",
    [{"description": "\ud800"}, {"kwargs": {"\udfff": 1}}, {"timeout": 1e300, "result_ttl": 1e300}],
    ids=["lone-surrogate-description", "lone-surrogate-kwarg-name", "huge-durations"],
)
def test_a_job_hash_is_encodable_whatever_text_or_duration_the_envelope_holds(
    fields: dict[str, object],
) -> None:
    """JSON carries a lone surrogate, redis-py's UTF-8 encoding raised UnicodeEncodeError on it
    (not a RedisError: the forwarder stopped); an older journal's 1e300 timeout broke RQ."""
    check_job_hash(Envelope.from_bytes(_with(**fields)))
