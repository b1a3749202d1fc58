"""The JSON form of an envelope: the encoder, its fast field-by-field path, and the decoder.

:meth:`hybridq.envelope.model.Envelope.to_bytes` writes a record with :func:`_fast_json` (the common
envelope, field by field) or, for anything it does not cover, the generic :data:`_dumps` of
``to_dict()``: the same bytes either way. Before encoding, arguments that are not flat
(:func:`_flat`) are checked for non-string dict keys (:func:`_refuse_non_string_keys`); a record
nested deeper than :data:`_MAX_NESTING` is refused both ways. :data:`_loads` decodes strictly
(no NaN, Infinity or numbers out of float range), so whatever decodes can be written back.
These run once per job on the enqueue and delivery paths: :mod:`hybridq.envelope.model` imports the
names themselves, no wrapper in between.

This module must not import redis, rq, click or the journal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from hybridq.envelope.model import Envelope


#: Bumped when a field changes meaning; new optional fields do not need a bump.
ENVELOPE_VERSION = 1


def _refuse_non_string_keys(value: object) -> None:
    """TypeError for a dict key that is not a string anywhere in ``value``.

    JSON would turn ``{1: "a"}`` into ``{"1": "a"}`` (and ``{1: "a", "1": "b"}`` into one
    key): the task would get other arguments than the caller passed. Tuples becoming lists is
    documented instead (docs/enqueue.md): refusing them would refuse every ``*args``.
    """
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue  # a cycle: json.dumps reports it
        seen.add(id(item))
        if type(item) is dict or isinstance(item, Mapping):
            for key, inner in item.items():
                if type(key) is not str:
                    raise TypeError(f"dict key {key!r} is not a string (JSON would turn it into one)")
                if _nested(inner):
                    stack.append(inner)
        else:
            stack.extend(inner for inner in cast("list[object]", item) if _nested(inner))  # list or tuple


#: Types that hold nothing to walk (checked by exact type: an ABC check costs a microsecond).
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _flat(args: tuple[Any, ...], kwargs: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
    """Whether the arguments and meta hold only scalars under string keys (nothing to walk)."""
    scalars = _SCALARS
    for value in args:
        if type(value) not in scalars:
            return False
    for mapping in (kwargs, meta) if meta else (kwargs,):
        for key, value in mapping.items():
            if type(key) is not str or type(value) not in scalars:
                return False
    return True


def _nested(value: object) -> bool:
    """Whether ``value`` is a container the key check walks into (on every enqueue: keep it fast)."""
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        return True
    return kind not in _SCALARS and isinstance(value, Mapping | list | tuple)


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_dumps = _ENCODER.encode
#: The same encoder's C core, made once (``_dumps`` makes one per call), for :func:`_fast_json`.
#: No cycle check (``markers`` is None): a cycle ends in RecursionError, which ``to_bytes``
#: reports as NotSerializable too.
_values = (
    c_make_encoder(
        None,
        _ENCODER.default,
        encode_basestring_ascii,
        _ENCODER.indent,
        _ENCODER.key_separator,
        _ENCODER.item_separator,
        _ENCODER.sort_keys,
        _ENCODER.skipkeys,
        _ENCODER.allow_nan,
    )
    if c_make_encoder is not None
    else None
)
_str = encode_basestring_ascii
#: ``json.dumps``'s own encoder (its separators, NaN written as JSON's extension), its C core
#: made once: ``json.dumps`` makes one per call, a third of the time of a small object's.
_DEFAULT = json.JSONEncoder()
_ascii = (
    c_make_encoder(
        None,
        _DEFAULT.default,
        encode_basestring_ascii,
        _DEFAULT.indent,
        _DEFAULT.key_separator,
        _DEFAULT.item_separator,
        _DEFAULT.sort_keys,
        _DEFAULT.skipkeys,
        _DEFAULT.allow_nan,
    )
    if c_make_encoder is not None
    else None
)


def json_text(raw: bytes) -> str:
    """``raw`` as text, exactly as ``json.loads`` decodes bytes, with no guess for the usual case.

    ``json.loads`` guesses the encoding (``json.detect_encoding``), then decodes with
    ``surrogatepass``; a first byte ``{`` and a second that is not NUL is what it answers
    ``utf-8`` for: a JSON object in UTF-8, as journal records and completion events are (one
    of each per job in the forwarder; docs/benchmarks.md, "The pool's Python per job").
    """
    if raw[:1] == b"{" and raw[1:2] != b"\x00":
        return raw.decode("utf-8", "surrogatepass")
    return raw.decode(json.detect_encoding(raw), "surrogatepass")


def dumps_ascii(obj: object) -> str:
    """``json.dumps(obj)``, character for character (no cycle check: a cycle raises RecursionError)."""
    return json.dumps(obj) if _ascii is None else "".join(_ascii(obj, 0))


def dumps_compact(obj: object) -> str:
    """``json.dumps(obj, separators=(",", ":"), allow_nan=False)``, its encoder made once.

    No cycle check: a cycle raises RecursionError.
    """
    return _dumps(obj) if _values is None else "".join(_values(obj, 0))


_PREFIX = f'{{"v":{ENVELOPE_VERSION},"id":'


def _fast_json(env: Envelope) -> str | None:
    """``_dumps(env.to_dict())``, byte for byte, built field by field (about twice as fast).

    ``None`` when ``env`` has anything the fast path does not cover (unknown fields, a field of
    an unexpected type, no C encoder): the caller then takes the generic path, which also
    raises the errors.
    """
    values = _values
    if values is None or env.extra or type(env.id) is not str or type(env.func) is not str:
        return None
    if type(env.queue) is not str or type(env.idempotency_key) is not str:
        return None
    created = _number(env.created_at)
    if created is None:
        return None
    kwargs = env.kwargs
    args: object = env.args
    if type(args) is not tuple and type(args) is not list:
        args = list(env.args)  # the C encoder writes a tuple or a list as a JSON array, nothing else
    job_id = _str(env.id)
    parts = [
        _PREFIX,
        job_id,
        ',"func":',
        _name(env.func),
        ',"args":',
        *values(args, 0),
        ',"kwargs":',
        *(("{}",) if not kwargs else values(kwargs if type(kwargs) is dict else dict(kwargs), 0)),
        ',"queue":',
        _name(env.queue),
        ',"key":',
        job_id if env.idempotency_key == env.id else _str(env.idempotency_key),
        ',"created_at":',
        created,
    ]
    for name, value in (("timeout", env.timeout_s), ("result_ttl", env.result_ttl_s), ("run_at", env.run_at)):
        if value is not None:
            text = _number(value)
            if text is None:
                return None
            parts += (f',"{name}":', text)
    if env.retry is not None:
        parts += (',"retry":', *values(env.retry.to_json(), 0))
    if env.description is not None:
        if type(env.description) is not str:
            return None
        parts += (',"description":', _str(env.description))
    if env.meta:
        meta = env.meta
        parts += (',"meta":', *values(meta if type(meta) is dict else dict(meta), 0))
    if env.requeue:
        if type(env.requeue) is not int:
            return None
        parts += (',"requeue":', int.__repr__(env.requeue))
    if env.tags:
        if type(env.tags) is not int:
            return None
        parts += (',"tags":', int.__repr__(env.tags))
    if env.trace is not None:
        parts += (',"trace":', *values(dict(env.trace), 0))
    if env.priority:
        if type(env.priority) is not int:
            return None
        parts += (',"priority":', int.__repr__(env.priority))
    if env.limit_key is not None:
        if type(env.limit_key) is not str:
            return None
        parts += (',"limit_key":', _str(env.limit_key))
    if env.signature is not None:
        if type(env.signature) is not str:
            return None
        parts += (',"sig":', _str(env.signature))
    parts.append("}")
    return "".join(parts)


def _name(text: str) -> str:
    """``text`` (a function path or a queue name: a few, used again and again) as a JSON string."""
    encoded = _NAMES.get(text)
    if encoded is None:
        encoded = _str(text)
        if len(_NAMES) < _NAMES_MAX:
            _NAMES[text] = encoded
    return encoded


_NAMES: dict[str, str] = {}
#: As many as :mod:`hybridq.envelope.model` keeps checked function paths (``_CHECKED_PATHS_MAX``).
_NAMES_MAX = 4096


def _number(value: object) -> str | None:
    """A finite float or an int as JSON (as the C encoder writes it); ``None`` for anything else."""
    if type(value) is float:
        return float.__repr__(value) if math.isfinite(value) else None
    return int.__repr__(value) if type(value) is int else None


#: Deepest nesting of arrays and objects a record may have. json recurses once per level: a
#: record nested near the interpreter's recursion limit decodes, then raises RecursionError
#: (not an EnvelopeError) when it is encoded again a few frames deeper, e.g. for delivery.
_MAX_NESTING = 100


def _too_deep(raw: bytes, obj: object) -> bool:
    """Whether ``obj`` (encoded as ``raw``) nests deeper than :data:`_MAX_NESTING`.

    Each level is one ``[`` or ``{``: only a record with that many brackets is walked.
    """
    return raw.count(b"[") + raw.count(b"{") > _MAX_NESTING and _nesting(obj) > _MAX_NESTING


def _nesting(obj: object) -> int:
    deepest = 0
    todo: list[tuple[object, int]] = [(obj, 1)]
    while todo:
        value, level = todo.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, level)
            todo.extend((item, level + 1) for item in value)
    return deepest


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def scanned(decoder: json.JSONDecoder, fallback: Callable[[str], Any]) -> Callable[[str], Any]:
    """``fallback`` (``decoder.decode`` or ``json.loads``), with the decoder's C scanner called first.

    ``decode`` wraps the scanner in Python: ``raw_decode``, a whitespace regex before and after
    the value, and ``json.loads`` a BOM check: 5k of the forwarder's 66k instructions to decode
    a journal record, 8k of 39k for an event (docs/benchmarks.md, "The forwarder's decoding
    per job"). A text whose value starts at its first character and ends at its last is what
    ``decode`` would scan the same way, with the same errors raised from within the value; any
    other text (leading or trailing whitespace, extra data, no value, a BOM) is left to
    ``fallback``, as before (scanned twice then: at most twice main's cost for such a text). One
    difference: the scanner runs a frame or two less deep than under ``decode``, so a value
    nested about 995 deep, which the old path's stack refused (``RecursionError``), may decode
    here: a journal record is then refused by its own depth check (:func:`_too_deep`); an event
    that deep was already decoded when one or two levels shallower.
    """
    scan = decoder.scan_once  # type: ignore[attr-defined]

    def loads(text: str) -> Any:
        try:
            obj, end = scan(text, 0)
            if end == len(text):
                return obj
        except StopIteration:
            pass  # (no value at the first character: the fallback raises outside this block)
        return fallback(text)

    return loads


# NaN, Infinity and numbers out of float range decode with json.loads, but to_bytes() refuses
# them (strict JSON): refused here, so whatever decodes can be written back. One decoder, built
# once: json.loads with these options would build a new one per call (+2 us a record).
_decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_loads = scanned(_decoder, _decoder.decode)
#: ``json.loads`` of a text (not bytes), the same objects and errors (:func:`scanned`).
loads_text = scanned(json.JSONDecoder(), json.loads)
