"""Every field of a ledger entry and of a delivery reaches the JSON written out by hand.

``Entry._outcome_text`` and ``Delivery._own_text`` write the common shapes without the encoder
(docs/benchmarks.md, "The forwarder's JSON per job") and list the fields that send them back to
it. A field added to ``_body()`` or ``_own()`` and not to that list would be dropped from the
ledger or from Redis without a word: each field here, set to a value other than its default,
must be written as the encoder writes it (or the hand-written path must decline).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from hybridq.envelope.codec import dumps_ascii
from hybridq.ledger.entries import Entry, _encode, parse_event
from hybridq.protocol.delivery import Delivery

from tests.unit.test_delivery_encoded import decoded
from tests.unit.test_ledger_entry_text import EVENT

_SAMPLES: dict[type, Any] = {str: "x", int: 7, float: 2.5, bool: True}


def _other(f: dataclasses.Field[Any], current: Any) -> Any:
    """A value of ``f``'s type other than ``current``."""
    for kind, value in _SAMPLES.items():
        if kind.__name__ in str(f.type) and value != current:
            return value
    return ("w", 9, 9) if "Loc" in str(f.type) else {"a": 1}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Entry)])
def test_every_entry_field_is_written(name: str) -> None:
    base = parse_event("1-0", EVENT, time.time)
    f = next(f for f in dataclasses.fields(Entry) if f.name == name)
    entry = dataclasses.replace(base, **{name: _other(f, getattr(base, name))})
    assert entry.to_bytes() == _encode(entry._body()).encode()


@pytest.mark.parametrize(
    "name", [f.name for f in dataclasses.fields(Delivery) if f.name not in ("envelope", "overwrite")]
)
def test_every_delivery_field_is_written(name: str) -> None:
    base = Delivery(decoded(1, 2), "o", ("w", 0, 64))
    f = next(f for f in dataclasses.fields(Delivery) if f.name == name)
    d = dataclasses.replace(base, **{name: _other(f, getattr(base, name))})
    own = d._own_text()
    assert own is None or own == dumps_ascii(d._own())[1:]
