"""A delivery's JSON carries its envelope's journal record as it is (Delivery.encoded)."""

from __future__ import annotations

import json
import tempfile

import pytest
from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.protocol.delivery import Delivery
from rq.serializers import JSONSerializer


def decoded(*args: object, meta: dict[str, str] | None = None) -> Envelope:
    """An envelope as the forwarder has it: decoded from the record a producer wrote."""
    env = Queue("q", tempfile.mkdtemp()).prepare("tests.tasks.add", args, meta=meta)
    return Envelope.from_bytes(env.to_bytes())


def test_a_delivery_splices_the_record_it_was_decoded_from() -> None:
    env = decoded(1, 2, meta={"team": "x"})
    assert env.source is not None
    delivery = Delivery(env, "owner", ("w" * 16, 3, 64), attempt=2, lease_s=30.0, later=1, later_since=5.0)
    raw = delivery.encoded()
    assert env.source in raw  # not encoded again
    assert json.loads(raw) == delivery.to_json()
    assert Delivery.from_json(json.loads(raw)) == delivery
    assert JSONSerializer.loads(b'["f", null, [' + raw + b"], {}]")[2][0] == delivery.to_json()


def test_an_envelope_not_decoded_from_ascii_json_is_encoded_again() -> None:
    made = Queue("q", tempfile.mkdtemp()).prepare("tests.tasks.add", (1, 2))
    assert made.source is None  # built, not decoded
    wide = decoded("caf\u00e9 \udcff")  # a lone surrogate, as os.fsdecode gives
    assert wide.source is None or wide.source.isascii()
    for env in (made, wide):
        delivery = Delivery(env, "owner", ("w" * 16, 0, 64))
        raw = delivery.encoded()
        assert raw.isascii()
        assert json.loads(raw) == delivery.to_json()


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-32-le"])
def test_a_record_in_another_json_encoding_is_encoded_again(encoding: str) -> None:
    """JSON in UTF-16/32-LE (what ``json.loads`` detects) is all ASCII bytes with NULs between:
    spliced as it is, the worker (UTF-8) could not read the job, which then never ran."""
    env = Envelope.from_bytes(decoded(1, 2).to_bytes().decode().encode(encoding))
    assert env.source is None
    raw = Delivery(env, "owner", ("w" * 16, 0, 64)).encoded()
    assert json.loads(raw.decode("utf-8")) == Delivery(env, "owner", ("w" * 16, 0, 64)).to_json()


def test_dumps_ascii_is_json_dumps() -> None:
    from hybridq.envelope.codec import dumps_ascii

    for value in (
        {"a": 1.5, "b": [1, "caf\u00e9 \udcff", None, float("nan"), float("-inf")]},
        [],
        {},
        "x",
        10**30,
    ):
        assert dumps_ascii(value) == json.dumps(value)
