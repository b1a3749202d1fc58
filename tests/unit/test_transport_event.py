"""``Event`` is no longer frozen (docs/benchmarks.md, "The forwarder's decoding per job"): it
still compares, hashes and prints as the frozen dataclass it was."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import pytest
from hybridq.transport.base import Event


@dataclass(frozen=True, slots=True)
class FrozenEvent:
    """Main's ``Event``, kept as the reference."""

    event_id: str
    body: Mapping[str, Any] | None
    refused: str | None = None


def test_fields_are_the_reference_ones() -> None:
    assert [(f.name, f.default) for f in fields(Event)] == [(f.name, f.default) for f in fields(FrozenEvent)]


@pytest.mark.parametrize("refused", [None, "limited: k"])
def test_hashed_and_compared_as_frozen(refused: str | None) -> None:
    event, reference = Event("1-0", None, refused), FrozenEvent("1-0", None, refused)
    assert hash(event) == hash(reference)
    assert event == Event("1-0", None, refused)
    assert event != Event("1-1", None, refused)
    assert repr(event) == repr(reference).replace("FrozenEvent", "Event")


def test_a_body_still_unhashable() -> None:
    with pytest.raises(TypeError):
        hash(FrozenEvent("1-0", {"a": 1}))
    with pytest.raises(TypeError):
        hash(Event("1-0", {"a": 1}))
