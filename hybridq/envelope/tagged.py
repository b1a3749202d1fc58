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

:func:`encode` gives the JSON form (and whether it holds a tag); :func:`decode` the values back
(``strict``: a malformed tag raises ``ValueError``, for records marked as tagged; otherwise it
is left as it is, for results stored before tags existed). docs/http.md lists the tags for
HTTP clients.

This module must not import redis, rq, click or the journal.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

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
    "tag_call",
]

#: The key that marks a tagged value.
TAG_KEY = "$t"
#: The version of this encoding an envelope's ``tags`` field names (0: plain JSON).
TAGS_VERSION = 1
_SCALARS = frozenset({str, int, float, bool, type(None)})


class _Encoder:
    """One walk of a value; :attr:`tagged` says whether it wrote a tag."""

    __slots__ = ("tagged",)

    def __init__(self) -> None:
        self.tagged = False

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
        self.tagged = True
        return write(self, value)

    def items(self, values: list[Any]) -> list[Any]:
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
        return values if out is None else out

    def mapping(self, value: Mapping[Any, Any]) -> dict[str, Any]:
        out: dict[str, Any] | None = None if type(value) is dict else {}
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
        result: dict[str, Any] = value if out is None else out  # type: ignore[assignment]
        if TAG_KEY in result:
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
                self.tagged = True
                return write(self, value)
        raise TypeError(f"{type(value).__name__} is not JSON, nor a type hybridq tags: {value!r:.60}")


def _time_fields(value: dt.datetime | dt.time) -> dict[str, Any]:
    """The zone key and fold a date-time or time needs besides its ISO text."""
    extra: dict[str, Any] = {}
    zone = value.tzinfo
    if isinstance(zone, ZoneInfo) and zone.key is not None:
        extra["tz"] = zone.key
    if value.fold:
        extra["fold"] = 1
    return extra


def _sorted_items(enc: _Encoder, values: set[Any] | frozenset[Any]) -> list[Any]:
    items = [enc.value(item) for item in values]
    return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))


_WRITERS: dict[type, Callable[[_Encoder, Any], dict[str, Any]]] = {
    # datetime before date: a datetime is a date to isinstance.
    dt.datetime: lambda _, v: {TAG_KEY: "datetime", "v": v.isoformat(), **_time_fields(v)},
    dt.date: lambda _, v: {TAG_KEY: "date", "v": v.isoformat()},
    dt.time: lambda _, v: {TAG_KEY: "time", "v": v.isoformat(), **_time_fields(v)},
    Decimal: lambda _, v: {TAG_KEY: "decimal", "v": str(v)},
    uuid.UUID: lambda _, v: {TAG_KEY: "uuid", "v": str(v)},
    bytes: lambda _, v: {TAG_KEY: "bytes", "v": base64.b64encode(v).decode("ascii")},
    tuple: lambda enc, v: {TAG_KEY: "tuple", "v": [enc.value(item) for item in v]},
    set: lambda enc, v: {TAG_KEY: "set", "v": _sorted_items(enc, v)},
    frozenset: lambda enc, v: {TAG_KEY: "frozenset", "v": _sorted_items(enc, v)},
}


def encode(value: Any) -> tuple[Any, bool]:
    """The JSON form of ``value`` and whether it holds a tag.

    Containers that hold only JSON come back as they are (no copy).

    Raises:
        TypeError: a value of no supported type, or a dict key that is not a string.
        RecursionError: a cycle, or nesting deeper than the interpreter allows.
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
    except (TypeError, RecursionError) as exc:
        message = str(exc) if isinstance(exc, TypeError) else "they nest too deep (or hold a cycle)"
        raise NotSerializable(f"job {func}: arguments must be JSON or of a tagged type: {message}") from None
    return out_args, out_kwargs, TAGS_VERSION if enc.tagged else 0


def _read_time(kind: Callable[[str], Any], body: Mapping[str, Any]) -> Any:
    value = kind(_text(body))
    zone = body.get("tz")
    if zone is not None:
        value = value.replace(tzinfo=ZoneInfo(_checked(zone, str)))
    fold = body.get("fold", 0)
    return value.replace(fold=fold) if fold in (0, 1) and type(fold) is int else _bad(body)


def _text(body: Mapping[str, Any]) -> str:
    text: str = _checked(body["v"], str)
    return text


def _checked(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected a {kind.__name__}, not {value!r:.40}")
    return value


def _bad(body: Mapping[str, Any]) -> Any:
    raise ValueError(f"malformed tagged value {body!r:.80}")


def _b64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _members(decode_item: Callable[[Any], Any], body: Mapping[str, Any]) -> list[Any]:
    return [decode_item(item) for item in _checked(body["v"], list)]


#: The tags, and the keys each may have besides ``$t`` and ``v``.
TAGS: dict[str, frozenset[str]] = {
    "datetime": frozenset({"tz", "fold"}),
    "date": frozenset(),
    "time": frozenset({"tz", "fold"}),
    "decimal": frozenset(),
    "uuid": frozenset(),
    "bytes": frozenset(),
    "tuple": frozenset(),
    "set": frozenset(),
    "frozenset": frozenset(),
    "dict": frozenset(),
}
_READERS: dict[str, Callable[[Callable[[Any], Any], Mapping[str, Any]], Any]] = {
    "datetime": lambda _, b: _read_time(dt.datetime.fromisoformat, b),
    "date": lambda _, b: dt.date.fromisoformat(_text(b)),
    "time": lambda _, b: _read_time(dt.time.fromisoformat, b),
    "decimal": lambda _, b: Decimal(_text(b)),
    "uuid": lambda _, b: uuid.UUID(_text(b)),
    "bytes": lambda _, b: _b64(_text(b)),
    "tuple": lambda d, b: tuple(_members(d, b)),
    "set": lambda d, b: set(_members(d, b)),
    "frozenset": lambda d, b: frozenset(_members(d, b)),
    "dict": lambda d, b: {key: d(item) for key, item in _checked(b["v"], dict).items()},
}


def decode(value: Any, *, strict: bool = True) -> Any:
    """The values :func:`encode` wrote, back (JSON values without tags come back as they are).

    Args:
        value: a decoded JSON value.
        strict: a ``"$t"`` key that is not a well-formed tag raises ``ValueError`` (a record
            marked as tagged, or an HTTP request); without it such a dict is left as it is
            (a result stored before tags existed).

    Raises:
        ValueError: ``strict`` and a malformed tag (unknown tag, extra keys, a value of the
            wrong type or text that does not parse).
    """
    kind = type(value)
    if kind is list:
        return [decode(item, strict=strict) for item in value]
    if kind is not dict:
        return value
    if TAG_KEY not in value:
        return {key: decode(item, strict=strict) for key, item in value.items()}
    tag = value[TAG_KEY]
    allowed = TAGS.get(tag) if type(tag) is str else None
    if allowed is None or "v" not in value or not set(value).issubset(allowed | {TAG_KEY, "v"}):
        return _bad(value) if strict else value
    try:
        return _READERS[tag](lambda item: decode(item, strict=strict), value)
    except (TypeError, ValueError, KeyError, LookupError, binascii.Error, ArithmeticError) as exc:
        if strict:
            raise ValueError(f"malformed tagged value {value!r:.80}: {exc}") from None
        return value


def decode_call(args: Iterable[Any], kwargs: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """A call's arguments with their tagged values decoded (strictly: see :func:`decode`).

    The keyword names are the call's own, never a tag (``$t`` among them, for ``**kwargs``).
    """
    return [decode(item) for item in args], {name: decode(item) for name, item in kwargs.items()}


def read_result(text: str) -> Any:
    """A stored result's JSON text as the value the task returned (leniently: see :func:`decode`)."""
    value = json.loads(text)
    return decode(value, strict=False) if has_tags(text) else value


def has_tags(text: str) -> bool:
    """Whether JSON text may hold a tag (a cheap test before :func:`decode` walks a value)."""
    return '"$t"' in text or "\\u0024t" in text.lower()
