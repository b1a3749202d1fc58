"""The decoders that call the C scanner first (``hybridq.envelope.codec.scanned``) accept and
refuse exactly what the decoders they stand for do: the same objects, the same errors (type and
message), for JSON texts and for texts that are not (docs/benchmarks.md, "The forwarder's
decoding per job")."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hybridq.envelope.codec import _decoder, _loads, loads_text
from hypothesis import given, settings
from hypothesis import strategies as st


def _outcome(loads: Callable[[str], Any], text: str) -> tuple[str, str]:
    try:
        return "ok", repr(loads(text))  # repr: NaN equals itself, 1 and 1.0 and True differ
    except Exception as exc:
        return type(exc).__name__, str(exc)


PAIRS = [(loads_text, json.loads), (_loads, _decoder.decode)]

_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
_space = st.sampled_from(["", " ", "\n", "\t ", "\r\n", "\ufeff", "x", "]", ",", "{}", "1"])


@st.composite
def _texts(draw: st.DrawFn) -> str:
    """A JSON text (NaN and Infinity included), maybe cut or spliced, with text around it."""
    text = json.dumps(draw(_values), separators=draw(st.sampled_from([None, (",", ":")])))
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(_space) + text[cut + draw(st.integers(0, 2)) :]
    return draw(_space) + text + draw(_space)


@settings(max_examples=1500, deadline=None)
@given(_texts() | st.text(max_size=12))
def test_same_objects_and_errors(text: str) -> None:
    for fast, reference in PAIRS:
        assert _outcome(fast, text) == _outcome(reference, text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "{}",
        " {}",
        "{} ",
        "{}x",
        "\ufeff{}",
        '{"a": NaN}',
        '{"a": 1e400}',
        '{"a": -Infinity}',
        '{"a": 1.5, "b": [1, 2, {"c": null}]}',
        '{"a": 1,}',
        '{"a" 1}',
        "[" * 5000 + "]" * 5000,
        '"\\ud800"',
        "1 2",
        "nul",
    ],
)
def test_edges(text: str) -> None:
    for fast, reference in PAIRS:
        assert _outcome(fast, text) == _outcome(reference, text)


def test_not_a_text_refused_as_before() -> None:
    """Bytes are not passed (``json_text`` decodes them first); other values are refused."""
    for fast, reference in PAIRS:
        for value in (1, None):
            with pytest.raises(TypeError):
                reference(value)  # type: ignore[arg-type]
            with pytest.raises(TypeError):
                fast(value)  # type: ignore[arg-type]
