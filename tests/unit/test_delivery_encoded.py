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


def test_the_delivery_s_own_fields_are_written_as_the_encoder_writes_them() -> None:
    """``_own_text`` is ``dumps_ascii(_own())`` (less its ``{``) for every delivery it writes,
    and leaves to the encoder the ones it does not (``None``)."""
    from hybridq.envelope.codec import dumps_ascii

    env = decoded(1, 2)
    loc = ("w" * 16, 3, 64)
    written = [
        Delivery(env, "owner", loc),
        Delivery(
            env, "own\u00e9r \udcff", ("caf\u00e9", 0, 2**40), attempt=7, gen=3, lease_s=0.1, key_ttl_s=1e-7
        ),
        Delivery(env, "owner", loc, report_start=True, limit="concurrency:2"),
        Delivery(env, "owner", loc, report_start=True, limit=""),
        Delivery(env, "owner", loc, lease_s=1e300, key_ttl_s=86400.0, gen=2**63 - 1),
    ]
    for delivery in written:
        text = delivery._own_text()
        assert text is not None
        assert text == dumps_ascii(delivery._own())[1:]
    encoder_s = [
        Delivery(env, "owner", loc, lost=1),
        Delivery(env, "owner", loc, later=2, later_since=5.5),
        Delivery(env, "owner", loc, lease_s=10),  # an int: the encoder writes 10
        Delivery(env, "owner", loc, lease_s=float("inf")),
        Delivery(env, "owner", loc, key_ttl_s=float("nan")),
        Delivery(env, "owner", loc, attempt=True),
        Delivery(env, "owner", ("w", 1.0, 2)),  # type: ignore[arg-type]
    ]
    for delivery in written + encoder_s:
        assert (
            delivery.encoded() == b'{"job": ' + env.source + b", " + dumps_ascii(delivery._own()).encode()[1:]
        )
    assert all(d._own_text() is None for d in encoder_s)
