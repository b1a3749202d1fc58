"""The RQ transport's encodings: the fields it writes into an RQ job hash, and its reads of replies.

:mod:`hybridq.transport.rq` builds each job hash from these (the meta, the description, the
compressed call data, whole seconds for RQ, the failed delivery's TTL) and decodes Redis's
replies and the completion events with them; every name it uses is importable from there too.
They are plain functions the forwarder's push calls per job, imported by name (no indirection).

This module imports neither redis nor rq.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _str
from math import isfinite
from typing import TYPE_CHECKING, Any

from hybridq.envelope.codec import dumps_ascii, json_text, loads_text
from hybridq.envelope.limits import MAX_SECONDS
from hybridq.protocol import Delivery

if TYPE_CHECKING:  # the worker loads this module; not the forwarder's port (tests/unit/test_layout.py)
    from .base import MemoryInfo

__all__ = [
    "DATA_PLAIN_BYTES",
    "_compress",
    "_data",
    "_decode_event",
    "_describe",
    "_failure_ttl",
    "_meta",
    "_meta_json",
    "_redis_text",
    "_refused",
    "_text",
    "_whole_seconds",
    "memory_info",
    "plain_data",
]


def _meta(delivery: Delivery) -> dict[str, Any]:
    """The RQ job's meta: the envelope's, plus what hybridq shows about the job."""
    env = delivery.envelope
    return {
        **env.meta,
        "hybridq": {
            "func": env.func,
            "key": env.idempotency_key,
            "created_at": env.created_at,
            "attempt": delivery.job_attempt,  # runs that said RetryLater are not attempts
        },
    }


def _meta_json(delivery: Delivery) -> bytes:
    """``dumps_ascii(_meta(delivery))`` as bytes, written out for an envelope with no meta of its own.

    The dict and the encoder's walk of it cost the push about 11,000 instructions a job
    (docs/benchmarks.md, "The forwarder's JSON per job"); the text is the same
    (``tests/unit/test_job_data.py``). Anything else (a meta, a field of an unusual type, a
    time that is not finite) takes the encoder.
    """
    env = delivery.envelope
    func, key, created, attempt = env.func, env.idempotency_key, env.created_at, delivery.job_attempt
    if (
        env.meta
        or type(func) is not str
        or type(key) is not str
        or type(attempt) is not int
        or not ((type(created) is float and isfinite(created)) or type(created) is int)
    ):
        return dumps_ascii(_meta(delivery)).encode()
    return (
        f'{{"hybridq": {{"func": {_str(func)}, "key": {_str(key)}, "created_at": {created!r}, '
        f'"attempt": {attempt}}}}}'
    ).encode()


def _failure_ttl(key_ttl_s: float) -> str:
    """How long RQ keeps a failed delivery: a little less than its key's outcome stays stored.

    RQ keeps a failed job's hash and failed-registry entry for this long (its default: a year).

    ``rq requeue`` and the dashboard's Requeue take jobs from the failed registry: every one
    they can find still has its outcome stored, so the claim reports that outcome instead of
    running the task again (docs/worker.md, "Using RQ's tools").
    """
    text = _FAILURE_TTLS.get(key_ttl_s)
    if text is None:  # made once per lifetime (a few per forwarder): about 4,000 instructions
        if len(_FAILURE_TTLS) >= 64:
            _FAILURE_TTLS.clear()
        text = _FAILURE_TTLS[key_ttl_s] = str(max(1, int(key_ttl_s - min(60.0, key_ttl_s / 2))))
    return text


_FAILURE_TTLS: dict[float, str] = {}


def _describe(func: str, args: Sequence[Any], kwargs: Any) -> str:
    """``func(args...)`` as RQ would describe the call, shortened."""
    if not args and not kwargs:  # (most jobs of a burst: the lists, dict and join cost 5,000)
        text = f"{func}()"
    else:
        parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in dict(kwargs).items()]
        text = f"{func}({', '.join(parts)})"
    return text if len(text) <= 200 else text[:197] + "..."


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _decode_event(fields: Any) -> dict[str, Any] | None:
    raw = fields.get(b"e") if isinstance(fields, dict) else None
    if raw is None:
        return None
    try:
        body = loads_text(json_text(raw)) if isinstance(raw, bytes) else json.loads(raw)
    except (ValueError, RecursionError):  # "[[[[..." deep enough raises RecursionError
        return None
    return body if isinstance(body, dict) else None


def _refused(fields: Any) -> str | None:
    """An event's ``r`` field (a claim's refusal of the run: ``hybridq.worker.scripts``), if any."""
    raw = fields.get(b"r") if isinstance(fields, dict) else None
    return raw.decode(errors="replace") if isinstance(raw, bytes) else None


#: Job data (the JSON of RQ's call) up to this size is stored as it is, larger data compressed.
DATA_PLAIN_BYTES = 1024


def _data(raw: bytes) -> bytes:
    """A job hash's ``data``: ``raw``, compressed (as RQ writes it) only when it is large.

    Compressing a few hundred bytes cost the forwarder ~8 us per job (more than the rest of the
    hash) to save ~140 bytes per job queued in Redis; RQ, and hybridq's worker, read the raw
    JSON when ``zlib.decompress`` refuses it (its first byte, ``[``, is no zlib header).
    """
    return raw if len(raw) <= DATA_PLAIN_BYTES else _compress(raw)


def plain_data(stored: bytes) -> bytes:
    """A job hash's ``data`` as JSON bytes, compressed or not (:func:`_data`), as RQ reads it.

    A small job's is stored as it is, and its first byte, ``[``, is no zlib header (whose low
    four bits are 8, deflate): ``zlib.decompress`` would refuse it, and the exception it raised
    cost a pool worker about 2.6 us per job. Such data is returned without the attempt.
    """
    if stored[:1] == b"[":
        return stored
    try:
        return zlib.decompress(stored)
    except zlib.error:
        return stored  # not zlib after all (RQ reads it the same way)


def _compress(raw: bytes) -> bytes:
    """``raw`` compressed as RQ does (zlib), with a window and a hash table sized for it.

    zlib's defaults (a 32 KiB window, 128 KiB of tables) cost far more to set up than a job of a
    few hundred bytes takes to compress: about 40 us against 6 us here. A window that spans the
    whole input (plus deflate's 262-byte lookahead) finds the same matches, so the output is the
    same size; large inputs get the defaults. RQ's ``zlib.decompress`` reads any window size.
    """
    wbits = min(zlib.MAX_WBITS, max(9, (len(raw) + 262).bit_length()))
    mem_level = min(zlib.DEF_MEM_LEVEL, max(4, wbits - 6))
    deflate = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, wbits, mem_level)
    return deflate.compress(raw) + deflate.flush()


def _whole_seconds(value: float | None) -> int | None:
    """Whole seconds for RQ, capped at ``MAX_SECONDS``: an older journal may hold more (RQ breaks)."""
    return None if value is None else min(MAX_SECONDS, max(1, round(value)))


def _redis_text(text: object) -> str:
    """``text`` as redis-py can encode it: a lone surrogate (valid in JSON) is escaped."""
    if not isinstance(text, str):
        raise TypeError(f"description must be a string, not {type(text).__name__}")
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def memory_info(raw: bytes | str) -> MemoryInfo:
    """``INFO memory``'s reply as :class:`MemoryInfo` (a field it lacks reads as 0, or ``noeviction``)."""
    from .base import MemoryInfo  # noqa: PLC0415 (only the forwarder reads memory)

    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon and name in _MEMORY_FIELDS:
            fields[name] = value.strip()
    return MemoryInfo(
        int(fields.get("used_memory", 0)),
        int(fields.get("maxmemory", 0)),
        fields.get("maxmemory_policy", "noeviction"),
    )


_MEMORY_FIELDS = frozenset({"used_memory", "maxmemory", "maxmemory_policy"})
