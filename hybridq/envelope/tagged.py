"""Tagged JSON: the Python values plain JSON cannot hold, as JSON objects any reader still parses.

A job's arguments and its result may hold, besides JSON's own types, a ``datetime`` (naive or
aware), ``date``, ``time``, ``Decimal``, ``UUID``, ``bytes``, ``set``, ``frozenset`` and
``tuple``. Each is written as an object of two keys, ``{"$t": tag, "v": value}``
(:data:`TAG_KEY`), plus ``"tz"`` (a ``zoneinfo`` key) and ``"fold"`` (``1``) for the date-times
and times that need them, so that every value comes back equal, of the same type, with the
same time zone. A dict of the caller's own that has a ``"$t"`` key is escaped as
``{"$t": "dict", "v": {...}}``: a value never reads back as a tag it was not. Sets are written
sorted by their elements' JSON, so the same set gives the same bytes in every process (what a
retried enqueue's fingerprint compares). Anything else is refused with a one-line
``TypeError`` (``NotSerializable`` to the caller).

Both ways the same bounds hold (:mod:`hybridq.envelope.limits`, listed in docs/http.md), so
that whatever is written reads back, and reading costs time in proportion to the text:
``MAX_NESTING`` levels of arrays and objects (the envelope's own bound; deeper, the
interpreter's recursion fails); ``MAX_SET_MEMBERS`` members of a set, at most
``MAX_SAME_HASH`` of them sharing a hash (numbers and UUIDs hash as their value modulo
``2**61 - 1``: a request could send thousands of members of one hash, each insertion comparing
with all the previous ones); a decimal finite, of at most ``MAX_DECIMAL_DIGITS`` digits and an
adjusted exponent within as many (JSON has no NaN; ``int()`` of ``1e200000`` takes seconds).

:func:`encode` gives the JSON form (and whether it holds a tag); :func:`decode` the values back
(``strict``: a malformed tag raises ``ValueError``, for records marked as tagged; otherwise it
is left as it is, for results stored before tags existed). docs/http.md lists the tags for
HTTP clients. This module owns the writing side; the reading side is
:mod:`hybridq.envelope.tagged_read`, whose names it re-exports so that callers import one module.

This module must not import redis, rq, click or the journal.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any

from hybridq.envelope.limits import MAX_NESTING, few_hashes, finite_decimal, too_deep
from hybridq.envelope.tagged_read import TAG_KEY, TAGS, decode, decode_call, has_tags, read_result
from hybridq.errors import NotSerializable

__all__ = [
    "TAGS",
    "TAGS_VERSION",
    "TAG_KEY",
    "decode",
    "decode_call",
    "encode",
    "has_tags",
    "read_result",
    "result_repr",
    "tag_call",
]

#: The version of this encoding an envelope's ``tags`` field names (0: plain JSON).
TAGS_VERSION = 1
_SCALARS = frozenset({str, int, float, bool, type(None)})


class _Encoder:
    """One walk of a value; :attr:`tagged` says whether it wrote a tag."""

    __slots__ = ("depth", "tagged")

    def __init__(self) -> None:
        self.tagged = False
        self.depth = 0  # the JSON arrays and objects around the value being written

    def enter(self, levels: int) -> None:
        """Go ``levels`` arrays or objects deeper (:data:`~hybridq.envelope.limits.MAX_NESTING` at most)."""
        depth = self.depth + levels
        if depth > MAX_NESTING:
            raise too_deep()
        self.depth = depth

    def value(self, value: Any) -> Any:
        """The JSON form of ``value`` (``value`` itself when it is JSON already)."""
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is list:
            return self.items(value)
        if kind is dict:
            return self.mapping(value)
        write = _WRITERS.get(kind)
        if write is None:
            return self.subclass(value)
        return self.tag(write, value)

    def tag(self, write: Callable[[_Encoder, Any], dict[str, Any]], value: Any) -> dict[str, Any]:
        self.tagged = True
        self.enter(1)
        out = write(self, value)
        self.depth -= 1
        return out

    def walk(self, values: Iterable[Any]) -> list[Any]:
        """The JSON forms of a tag's members (its array, one level deeper)."""
        self.enter(1)
        out = [self.value(item) for item in values]
        self.depth -= 1
        return out

    def items(self, values: list[Any]) -> list[Any]:
        self.enter(1)
        out: list[Any] | None = None  # copied at the first item that changes
        scalars = _SCALARS
        for at, item in enumerate(values):
            if type(item) in scalars:
                continue
            encoded = self.value(item)
            if encoded is not item:
                if out is None:
                    out = list(values)
                out[at] = encoded
        self.depth -= 1
        return values if out is None else out

    def mapping(self, value: Mapping[Any, Any]) -> dict[str, Any]:
        out: dict[str, Any] | None = None if type(value) is dict else {}
        levels = 2 if TAG_KEY in value else 1  # escaped: {"$t": "dict", "v": {...}}
        self.enter(levels)
        scalars = _SCALARS
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(f"dict key {key!r:.60} is not a string (JSON would turn it into one)")
            encoded = item if type(item) in scalars else self.value(item)
            if out is not None:
                out[key] = encoded
            elif encoded is not item:
                out = dict(value)
                out[key] = encoded
        self.depth -= levels
        result: dict[str, Any] = value if out is None else out  # type: ignore[assignment]
        if levels == 2:
            self.tagged = True
            return {TAG_KEY: "dict", "v": result}
        return result

    def subclass(self, value: Any) -> Any:
        """A subclass of a supported type (an ``IntEnum``, an ``OrderedDict``, a named tuple...)."""
        if isinstance(value, str | int | float):
            return value  # json writes it as its base type, as before tags
        if isinstance(value, Mapping):
            return self.mapping(value)
        if isinstance(value, list):
            return self.items(list(value))
        for base, write in _WRITERS.items():
            if isinstance(value, base):
                return self.tag(write, value)
        raise TypeError(f"{type(value).__name__} is not JSON, nor a type hybridq tags: {value!r:.60}")


def _time_fields(value: dt.datetime | dt.time) -> dict[str, Any]:
    """The zone key and fold a date-time or time needs besides its ISO text."""
    extra: dict[str, Any] = {}
    zone = value.tzinfo
    # zoneinfo loads on first use (~3 ms of every worker's start): a zone can be a ZoneInfo only
    # once its module is loaded.
    zoneinfo = sys.modules.get("zoneinfo")
    if zoneinfo is not None and isinstance(zone, zoneinfo.ZoneInfo) and zone.key is not None:
        extra["tz"] = zone.key
    if value.fold:
        extra["fold"] = 1
    return extra


def _sorted_items(enc: _Encoder, values: set[Any] | frozenset[Any]) -> list[Any]:
    few_hashes(values)
    items = enc.walk(values)
    return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))


_WRITERS: dict[type, Callable[[_Encoder, Any], dict[str, Any]]] = {
    # datetime before date: a datetime is a date to isinstance.
    dt.datetime: lambda _, v: {TAG_KEY: "datetime", "v": v.isoformat(), **_time_fields(v)},
    dt.date: lambda _, v: {TAG_KEY: "date", "v": v.isoformat()},
    dt.time: lambda _, v: {TAG_KEY: "time", "v": v.isoformat(), **_time_fields(v)},
    Decimal: lambda _, v: {TAG_KEY: "decimal", "v": str(finite_decimal(v))},
    uuid.UUID: lambda _, v: {TAG_KEY: "uuid", "v": str(v)},
    bytes: lambda _, v: {TAG_KEY: "bytes", "v": base64.b64encode(v).decode("ascii")},
    tuple: lambda enc, v: {TAG_KEY: "tuple", "v": enc.walk(v)},
    set: lambda enc, v: {TAG_KEY: "set", "v": _sorted_items(enc, v)},
    frozenset: lambda enc, v: {TAG_KEY: "frozenset", "v": _sorted_items(enc, v)},
}


def encode(value: Any) -> tuple[Any, bool]:
    """The JSON form of ``value`` and whether it holds a tag.

    Containers that hold only JSON come back as they are (no copy).

    Raises:
        TypeError: a value of no supported type, or a dict key that is not a string.
        ValueError: a value past the module's bounds (nesting, a set's members, a decimal),
            or a cycle.
    """
    enc = _Encoder()
    out = enc.value(value)
    return out, enc.tagged


def tag_call(
    func: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """A call's arguments in their JSON form, and the envelope's ``tags`` (0 when none is tagged).

    Scalar arguments (the common call) are returned as they are, after one pass over them.

    Raises:
        NotSerializable: an argument of no supported type (one line: which type, which value).
    """
    scalars = _SCALARS
    for item in args:
        if type(item) not in scalars:
            break
    else:
        for item in kwargs.values():
            if type(item) not in scalars:
                break
        else:
            return args, kwargs, 0
    enc = _Encoder()
    try:
        out_args = tuple(enc.value(item) for item in args)
        # The names are the call's own (``$t`` among them, for a ``**kwargs`` task): only the
        # values are encoded, and decoded (:meth:`hybridq.envelope.model.Envelope.call_args`).
        out_kwargs = {name: enc.value(item) for name, item in kwargs.items()}
    except (TypeError, ValueError, RecursionError) as exc:
        message = "they nest too deep (or hold a cycle)" if isinstance(exc, RecursionError) else str(exc)
        raise NotSerializable(f"job {func}: arguments must be JSON or of a tagged type: {message}") from None
    return out_args, out_kwargs, TAGS_VERSION if enc.tagged else 0


def result_repr(value: Any) -> str:
    """What is stored for a result JSON cannot hold: its ``repr()``, or a description if that fails.

    An int past Python's 4,300 digits or a ``repr()`` that raises must not stop the job's
    outcome from being recorded (it would be run again at every delivery).
    """
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__qualname__}: no JSON form and no repr()>"
