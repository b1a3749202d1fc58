"""The job envelope: one versioned JSON record per job, as stored in the journal.

An envelope says everything needed to run a job and nothing about where it is: id, function
(a dotted path), JSON arguments, queue, idempotency key, creation time, options and, when the
producer holds a signing key, an HMAC of all that (``sig``, see :mod:`hybridq.security.signing`). Fields
this version does not know are kept in :attr:`Envelope.extra` and written back unchanged, so a
newer producer's records survive a round trip through an older forwarder.

Here: the :class:`Envelope` and :class:`Retry` classes. Job ids and the checks of names and
paths live in :mod:`hybridq.envelope.names`, the JSON encoding and decoding (and
:data:`ENVELOPE_VERSION`) in :mod:`hybridq.envelope.codec`; both are re-exported here.

This module must not import redis, rq, click or the journal.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Imported by name, not through the module: to_bytes and from_bytes run once per job, and a
# module-level name costs no attribute lookup. The names this module does not use are imported
# too, so that everything it held before the JSON code moved out stays importable from here.
from hybridq.envelope.codec import (
    _ENCODER,  # noqa: F401
    _MAX_NESTING,
    _NAMES,  # noqa: F401
    _PREFIX,  # noqa: F401
    _SCALARS,  # noqa: F401
    ENVELOPE_VERSION,
    _dumps,
    _fast_json,
    _finite_float,  # noqa: F401
    _flat,
    _loads,
    _name,  # noqa: F401
    _nested,  # noqa: F401
    _nesting,
    _number,  # noqa: F401
    _refuse_constant,  # noqa: F401
    _refuse_non_string_keys,
    _str,  # noqa: F401
    _too_deep,
    _values,  # noqa: F401
    json_text,
)
from hybridq.envelope.limits import (
    MAX_ATTEMPTS,
    MAX_REQUEUE,
    MAX_SECONDS,
    MAX_TIMESTAMP,
    check_seconds,
    check_time,
    is_int,
    is_number,
    key_text,
    limit_key,
    opt_duration,
    opt_finite,
    opt_str,
    priority,
    requeue_count,
    tags_version,
    text_map,
    time_value,
    to_float,
    typed,
)
from hybridq.envelope.names import (
    function_path,
    idempotency_id,
    new_job_id,
    validate_job_id,
    validate_queue_name,
)
from hybridq.envelope.tagged import TAGS_VERSION, decode_call
from hybridq.errors import EnvelopeError, NotSerializable

__all__ = [
    "ENVELOPE_VERSION",
    "MAX_ATTEMPTS",
    "MAX_REQUEUE",
    "MAX_SECONDS",
    "MAX_TIMESTAMP",
    "Envelope",
    "Retry",
    "check_seconds",
    "check_time",
    "function_path",
    "idempotency_id",
    "new_job_id",
    "validate_job_id",
    "validate_queue_name",
]

_KNOWN = frozenset(
    {"v", "id", "func", "args", "kwargs", "queue", "key", "created_at", "timeout", "result_ttl", "run_at"}
    | {"retry", "description", "meta", "requeue", "tags", "trace", "sig", "priority", "limit_key"}
)


@dataclass(frozen=True, slots=True)
class Retry:
    """A retry policy: up to ``max_attempts`` runs, exponential backoff with full jitter.

    Args:
        max_attempts: total runs, the first included (1 = no retry).
        backoff_s: the delay before the second attempt; doubled for each attempt after it.
        backoff_max_s: the cap on one delay.
        jitter: draw each delay uniformly from ``[0, delay]`` (spreads retries after an outage).
    """

    max_attempts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 300.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if not is_int(self.max_attempts) or not 1 <= self.max_attempts <= MAX_ATTEMPTS:
            raise EnvelopeError(f"Retry.max_attempts must be an integer from 1 to {MAX_ATTEMPTS}")
        for name in ("backoff_s", "backoff_max_s"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value < 0:
                raise EnvelopeError(f"Retry.{name} must be a finite number >= 0")
        if not isinstance(self.jitter, bool):
            raise EnvelopeError("Retry.jitter must be True or False")

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        # The exponent is capped: 2.0 ** 1100 overflows a float, and any delay is capped anyway.
        delay = min(self.backoff_max_s, self.backoff_s * (2.0 ** min(64, max(0, attempt - 1))))
        if self.jitter:
            delay = (rng or random).uniform(0, delay)
        return float(delay)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "max_attempts": self.max_attempts,
            "backoff": self.backoff_s,
            "backoff_max": self.backoff_max_s,
            "jitter": self.jitter,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Retry:
        """Inverse of :meth:`to_json`; raises :class:`EnvelopeError` for a field of the wrong type."""
        return cls(
            max_attempts=value.get("max_attempts", 1),
            backoff_s=to_float(value.get("backoff", 1.0)),
            backoff_max_s=to_float(value.get("backoff_max", 300.0)),
            jitter=value.get("jitter", True),
        )


@dataclass(slots=True)
class Envelope:
    """One job, as committed to the journal. Treat it as immutable (use ``dataclasses.replace``).

    ``idempotency_key`` is kept verbatim (any text); :attr:`key_id` is its RQ-safe hash.
    Times are Unix seconds; durations are seconds. Not ``frozen``: a frozen dataclass's
    ``__init__`` costs about 2 us more per job, a fifth of ``enqueue_many``'s CPU per job.
    """

    id: str
    func: str
    queue: str
    idempotency_key: str
    created_at: float
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    result_ttl_s: float | None = None
    run_at: float | None = None
    retry: Retry | None = None
    description: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: How many times the job was requeued after failing for good (0 for a new job).
    requeue: int = 0
    #: ``hmac-sha256:<hex>`` over the fields that decide what runs (see :mod:`hybridq.security.signing`),
    #: or ``None`` when the producer held no signing key. Journals written before it read as None.
    signature: str | None = None
    #: Which tagged encoding the arguments use (:mod:`hybridq.envelope.tagged`): 0 for plain
    #: JSON (every record written before tags existed reads as 0, its arguments as they are).
    tags: int = 0
    #: The trace context of the enqueue span (W3C ``traceparent`` and what else the application's
    #: propagator writes: :mod:`hybridq.tracing`), ``None`` when no tracer was configured.
    trace: Mapping[str, str] | None = None
    #: 0 to 9, higher forwarded first (docs/api.md, "Priorities, limit keys and fairness").
    priority: int = 0
    #: The key the forwarder's limits and fairness count the job under (``None``: none).
    limit_key: str | None = None
    #: Fields written by a newer version, kept as they were.
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: Never serialized: set by ``Queue.prepare`` when the job's id and key are fresh and
    #: unique (made there, or by an entry point that mints them per job: ``hybridq serve``
    #: without an Idempotency-Key, the Django backend), so no other call can name them and a
    #: delayed job may go to its process's delayed chain (docs/journal.md, "Chains").
    _fresh_key: bool = field(default=False, compare=False, repr=False)
    _encoded: bytes | None = field(default=None, init=False, compare=False, repr=False)
    #: The ASCII JSON record :meth:`from_bytes` decoded this envelope from (:attr:`source`).
    _source: bytes | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def source(self) -> bytes | None:
        """The record this envelope was decoded from, when it is ASCII JSON (else ``None``).

        It decodes to this very envelope, so a delivery carries it as it is instead of encoding
        the envelope again (:meth:`hybridq.protocol.delivery.Delivery.encoded`). ASCII only: a
        reader that decodes strictly (RQ's JSON serializer) then reads it as
        :func:`json.dumps`'s output.
        """
        return self._source

    @property
    def key_id(self) -> str:
        """The RQ-safe id derived from the idempotency key."""
        return idempotency_id(self.idempotency_key)

    @property
    def max_attempts(self) -> int:
        """Total runs allowed by the retry policy (1 without one)."""
        return self.retry.max_attempts if self.retry is not None else 1

    def call_args(self) -> tuple[tuple[Any, ...], Mapping[str, Any]]:
        """The arguments the task is called with: the stored ones, their tagged values decoded.

        Raises:
            EnvelopeError: a tag this version does not know, or a malformed tagged value.
        """
        if not self.tags:
            return self.args, self.kwargs
        if self.tags != TAGS_VERSION:
            raise EnvelopeError(f"job {self.id}: arguments tagged by a newer version ({self.tags})")
        try:
            args, kwargs = decode_call(self.args, self.kwargs)
        except ValueError as exc:
            raise EnvelopeError(f"job {self.id}: {exc}") from None
        return tuple(args), kwargs

    def to_dict(self) -> dict[str, Any]:
        """The JSON object stored in the journal (``None`` options are left out)."""
        out: dict[str, Any] = dict(self.extra) if self.extra else {}
        out["v"] = ENVELOPE_VERSION
        out["id"] = self.id
        out["func"] = self.func
        out["args"] = list(self.args)
        out["kwargs"] = dict(self.kwargs)
        out["queue"] = self.queue
        out["key"] = self.idempotency_key
        out["created_at"] = self.created_at
        if self.timeout_s is not None:
            out["timeout"] = self.timeout_s
        if self.result_ttl_s is not None:
            out["result_ttl"] = self.result_ttl_s
        if self.run_at is not None:
            out["run_at"] = self.run_at
        if self.retry is not None:
            out["retry"] = self.retry.to_json()
        if self.description is not None:
            out["description"] = self.description
        if self.meta:
            out["meta"] = dict(self.meta)
        if self.requeue:
            out["requeue"] = self.requeue
        if self.tags:
            out["tags"] = self.tags
        if self.trace is not None:
            out["trace"] = dict(self.trace)
        if self.priority:
            out["priority"] = self.priority
        if self.limit_key is not None:
            out["limit_key"] = self.limit_key
        if self.signature is not None:
            out["sig"] = self.signature
        return out

    def to_bytes(self, *, keys_checked: bool = False) -> bytes:
        """Compact UTF-8 JSON (computed once); raises :class:`NotSerializable` for non-JSON values.

        ``keys_checked``: the arguments' dict keys were checked already (by the producer's
        :func:`hybridq.envelope.tagged.tag_call`): only the meta's are walked again.
        """
        if self._encoded is not None:
            return self._encoded
        try:
            flat = _flat(self.args, self.kwargs, self.meta)
            if not flat:
                _refuse_non_string_keys(self.meta if keys_checked else (self.args, self.kwargs, self.meta))
            raw = (_fast_json(self) or _dumps(self.to_dict())).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            raise NotSerializable(f"job {self.func}: arguments must be JSON-serializable: {exc}") from exc
        # A record the reader would refuse must not be acknowledged (see _MAX_NESTING). Scalar
        # arguments, kwargs and meta nest two levels deep at most: only other fields are counted.
        if (
            (not flat or self.extra)
            and raw.count(b"[") + raw.count(b"{") > _MAX_NESTING
            and _nesting(self.to_dict()) > _MAX_NESTING
        ):
            raise EnvelopeError(f"job {self.func}: arguments are nested deeper than {_MAX_NESTING} levels")
        self._encoded = raw
        return raw

    @classmethod
    def from_bytes(cls, raw: bytes) -> Envelope:
        """Decode a journal record; raises :class:`EnvelopeError` when it is not an envelope."""
        try:
            obj = _loads(json_text(raw))  # decoded as json.loads decodes bytes
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise EnvelopeError(f"record is not JSON: {exc}") from exc
        if _too_deep(raw, obj):
            raise EnvelopeError(f"record is nested deeper than {_MAX_NESTING} levels")
        if not isinstance(obj, dict):
            raise EnvelopeError("record is not a JSON object")
        env = cls.from_dict(obj)
        if raw[:1] == b"{" and raw.isascii() and b"\x00" not in raw:  # UTF-8 (not UTF-16/32: NULs)
            env._source = raw
        return env

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Envelope:
        """Build from the stored JSON object, keeping unknown fields in :attr:`extra`.

        Every field is checked for type and range: a record that decodes here can be delivered
        (a record that cannot is refused with :class:`EnvelopeError`, which the forwarder
        records as invalid instead of stopping on it). Durations above :data:`MAX_SECONDS`
        that an older version accepted are kept; the transport caps what it hands to RQ.
        """
        version = obj.get("v")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise EnvelopeError(f"envelope version {version!r} is not supported")
        try:
            # Only the fields the record has are checked; an absent one takes the field's
            # default (what its check makes of the absent value). A pushed record has 8 of the
            # 20 fields: asking for each of the others cost about 1.5 us a job in the pool's
            # take and the forwarder's (docs/benchmarks.md, "The pool's Python per job").
            given: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            for name, value in obj.items():
                check = _OPTIONAL.get(name)
                if check is not None:
                    given[check[0]] = check[1](value)
                elif name not in _KNOWN:
                    extra[name] = value
            return cls(
                id=validate_job_id(obj["id"]),
                func=function_path(typed("func", obj["func"], str)),
                queue=validate_queue_name(obj["queue"]),
                idempotency_key=key_text(obj["key"]),
                created_at=time_value("created_at", obj["created_at"]),
                extra=extra,
                **given,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # float(10**400) overflows
            raise EnvelopeError(f"malformed envelope: {exc!r}") from exc


def _opt_retry(value: object) -> Retry | None:
    if value is not None and not isinstance(value, Mapping):
        raise TypeError(f"retry must be an object, not {value!r:.60}")
    return None if value is None else Retry.from_json(value)


#: The optional fields of a record (:meth:`Envelope.from_dict`): by JSON name, the attribute and
#: its check. An absent one takes the attribute's default, which its check makes of the value
#: an absent field stands for (``[]``, ``{}``, ``0`` or ``None``).
_OPTIONAL: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "args": ("args", lambda v: tuple(typed("args", v, list))),
    "kwargs": ("kwargs", lambda v: typed("kwargs", v, dict)),
    "timeout": ("timeout_s", lambda v: opt_duration("timeout", v)),
    "result_ttl": ("result_ttl_s", lambda v: opt_duration("result_ttl", v)),
    "run_at": ("run_at", lambda v: opt_finite("run_at", v)),
    "retry": ("retry", _opt_retry),
    "description": ("description", lambda v: opt_str("description", v)),
    "meta": ("meta", lambda v: typed("meta", v, dict)),
    "requeue": ("requeue", requeue_count),
    "sig": ("signature", lambda v: opt_str("sig", v)),
    "tags": ("tags", tags_version),
    "trace": ("trace", lambda v: text_map("trace", v)),
    "priority": ("priority", priority),
    "limit_key": ("limit_key", limit_key),
}
