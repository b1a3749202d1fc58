"""Tagged JSON read back: the values :mod:`hybridq.envelope.tagged` wrote, as the Python values they were.

It owns the reading side of the format that module describes: which tags there are and the keys
each may have (:data:`TAGS`), one reader a tag, :func:`decode` (strict for records marked as
tagged and HTTP requests, lenient for results stored before tags existed), a call's arguments
(:func:`decode_call`) and a stored result's text (:func:`read_result`, with the cheap
:func:`has_tags` before it). Reading holds the same bounds as writing
(:mod:`hybridq.envelope.limits`), so that reading costs time in proportion to the text.
Split from :mod:`hybridq.envelope.tagged` (docs/architecture.md), which re-exports these names.

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
from typing import TYPE_CHECKING, Any

from hybridq.envelope.limits import MAX_NESTING, Refused, few, few_hashes, finite_decimal, too_deep

if TYPE_CHECKING:
    from zoneinfo import ZoneInfo

__all__ = ["TAGS", "TAG_KEY", "decode", "decode_call", "has_tags", "read_result"]

#: The key that marks a tagged value.
TAG_KEY = "$t"


def _read_time(kind: Callable[[str], Any], body: Mapping[str, Any]) -> Any:
    value = kind(_text(body))
    fold = body.get("fold", 0)
    if type(fold) is not int or fold not in (0, 1):
        return _bad(body)
    zone = body.get("tz")
    if zone is None:
        return value.replace(fold=fold)
    stated = value.utcoffset()  # the text's own offset, if it has one: the zone's, or refused
    value = value.replace(tzinfo=_zone(_checked(zone, str)), fold=fold)
    if stated is not None and value.utcoffset() != stated:
        raise ValueError(f"its offset is not the one {zone!r:.40} has at that time")
    return value


def _zone(key: str) -> ZoneInfo:
    from zoneinfo import ZoneInfo  # noqa: PLC0415 - only a date-time with a zone needs it

    try:
        return ZoneInfo(key)
    except (OSError, ValueError, LookupError) as exc:  # a directory of zones is an OSError
        raise ValueError(f"no time zone {key!r:.40} ({type(exc).__name__})") from None


def _text(body: Mapping[str, Any]) -> str:
    text: str = _checked(body["v"], str)
    return text


def _checked(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected a {kind.__name__}, not {value!r:.40}")
    return value


def _bad(body: Mapping[str, Any]) -> Any:
    raise Refused(f"malformed tagged value {body!r:.80}")


def _b64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def _members(decode_item: Callable[[Any], Any], body: Mapping[str, Any]) -> list[Any]:
    return [decode_item(item) for item in _checked(body["v"], list)]


def _set_members(decode_item: Callable[[Any], Any], body: Mapping[str, Any]) -> list[Any]:
    few(_checked(body["v"], list))  # before any member is read
    members = _members(decode_item, body)
    few_hashes(members)
    return members


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
    "decimal": lambda _, b: finite_decimal(Decimal(_text(b))),
    "uuid": lambda _, b: uuid.UUID(_text(b)),
    "bytes": lambda _, b: _b64(_text(b)),
    "tuple": lambda d, b: tuple(_members(d, b)),
    "set": lambda d, b: set(_set_members(d, b)),
    "frozenset": lambda d, b: frozenset(_set_members(d, b)),
    "dict": lambda d, b: {key: d(item) for key, item in _checked(b["v"], dict).items()},
}


def decode(value: Any, *, strict: bool = True) -> Any:
    """The values :func:`encode` wrote, back (JSON values without tags come back as they are).

    Args:
        value: a decoded JSON value.
        strict: a ``"$t"`` key that is not a well-formed tag raises ``ValueError`` (a record
            marked as tagged, or an HTTP request); without it such a dict is left as it is
            (a result stored before tags existed), and so is a value nested past
            :data:`~hybridq.envelope.limits.MAX_NESTING`.

    Raises:
        ValueError: ``strict`` and a malformed tag (unknown tag, extra keys, a value of the
            wrong type or text that does not parse, past the module's bounds) or a value
            nested deeper than :data:`~hybridq.envelope.limits.MAX_NESTING`. One line, however deep the value.
    """
    return _decode(value, strict, 0)


def _decode(value: Any, strict: bool, depth: int) -> Any:
    """:func:`decode` of ``value``, inside ``depth`` arrays and objects."""
    kind = type(value)
    if kind is not list and kind is not dict:
        return value
    depth += 1
    if depth > MAX_NESTING:
        if strict:
            raise too_deep()
        return value
    if kind is list:
        return [_decode(item, strict, depth) for item in value]
    if TAG_KEY not in value:
        return {key: _decode(item, strict, depth) for key, item in value.items()}
    tag = value[TAG_KEY]
    allowed = TAGS.get(tag) if type(tag) is str else None
    if allowed is None or "v" not in value or not set(value).issubset(allowed | {TAG_KEY, "v"}):
        return _bad(value) if strict else value
    inner = depth + 1  # the tag's array or object, around its members
    try:
        if inner > MAX_NESTING and type(value["v"]) in (list, dict):
            raise too_deep()
        return _READERS[tag](lambda item: _decode(item, strict, inner), value)
    except Refused:
        if strict:
            raise
        return value
    except (TypeError, ValueError, KeyError, LookupError, binascii.Error, ArithmeticError) as exc:
        if strict:
            raise Refused(f"malformed tagged value {value!r:.80}: {exc}") from None
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
    """Whether JSON text may hold a tag (a cheap test before :func:`decode` walks a value).

    Conservative: a ``$`` or a ``t`` written as a ``\\u`` escape anywhere (``"\\u0024\\u0074"``
    is ``"$t"`` to JSON) means it may.
    """
    if '"$t"' in text:
        return True
    if "\\u" not in text:
        return False
    lowered = text.lower()
    return "\\u0024" in lowered or "\\u0074" in lowered
