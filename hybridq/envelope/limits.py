"""Types and ranges of the job envelope's fields: what a record must hold to be deliverable.

:mod:`hybridq.envelope.model` decodes with these (a record that fails is invalid: the forwarder records
it so and goes on) and :meth:`hybridq.Queue.prepare` refuses with them (one clear error, nothing
written). The caps keep every number inside what RQ, Redis and Python's ``datetime`` take.
The bounds of tagged values (the end of this module) keep what a caller sends readable, and
reading it linear in its size (:mod:`hybridq.envelope.tagged`).

This module must not import redis, rq, click or the journal.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection
from decimal import Decimal
from typing import Any

from hybridq.errors import EnvelopeError
from hybridq.errors import ValueRefused as Refused  # the one class, in hybridq.errors

__all__ = [
    "MAX_ATTEMPTS",
    "MAX_DECIMAL_DIGITS",
    "MAX_LIMIT_KEY",
    "MAX_NESTING",
    "MAX_PRIORITY",
    "MAX_REQUEUE",
    "MAX_SAME_HASH",
    "MAX_SECONDS",
    "MAX_SET_MEMBERS",
    "MAX_TIMESTAMP",
    "Refused",
    "check_seconds",
    "check_time",
    "few",
    "few_hashes",
    "finite",
    "finite_decimal",
    "is_int",
    "is_number",
    "key_text",
    "limit_key",
    "opt_duration",
    "opt_finite",
    "opt_str",
    "priority",
    "requeue_count",
    "tags_version",
    "text_map",
    "time_value",
    "to_float",
    "too_deep",
    "typed",
]

#: The longest duration a job may ask for (``job_timeout``, ``result_ttl``, ``delay``, a retry's
#: backoff): ten years. RQ hands a timeout to ``signal.alarm`` (a C int: 68 years) and a result
#: lifetime to Redis's EXPIRE; far larger values broke there, in the worker, after the job ran.
MAX_SECONDS = 10 * 365 * 86400
#: The latest time an envelope may carry (``created_at``, ``run_at``): 9999-12-31T23:59:59Z, the
#: last second Python's datetime (and so RQ's timestamps) can represent.
MAX_TIMESTAMP = 253402300799.0
#: The most runs a retry policy may allow (the run number ``requeue * 100000 + attempt`` that
#: orders deliveries in Redis needs attempts below 100000).
MAX_ATTEMPTS = 10000
#: The highest priority a job may have (0, the default, is the lowest; higher runs first).
MAX_PRIORITY = 9
#: The longest limit key (characters): printable, no whitespace.
MAX_LIMIT_KEY = 200
#: The most times one job may be requeued (run numbers stay exact in Redis's Lua doubles).
MAX_REQUEUE = 2**31 - 1


def is_int(value: object) -> bool:
    """An integer, and not a bool (``True`` is an ``int`` to Python, not to a reader of JSON)."""
    # ``type(...) is`` first: what JSON decodes to, asked several times per job by the
    # forwarder's reads and harvest (docs/benchmarks.md, "The forwarder's whole step").
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def is_number(value: object) -> bool:
    """An int or a float, and not a bool."""
    kind = type(value)
    return kind is float or kind is int or (isinstance(value, int | float) and not isinstance(value, bool))


_JSON_NAMES: dict[type, str] = {list: "an array", dict: "an object", str: "a string"}


def typed(name: str, value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (list, dict or str: a JSON array, object or string), else raise."""
    if type(value) is not kind and not isinstance(value, kind):
        raise TypeError(f"{name} must be {_JSON_NAMES.get(kind, kind.__name__)}, not {value!r:.60}")
    return value


def key_text(value: object) -> str:
    """An idempotency key: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"key must be a non-empty string, not {value!r:.60}")
    return value


def requeue_count(value: object) -> int:
    """How many times a job was requeued: an integer from 0 to :data:`MAX_REQUEUE`."""
    if not is_int(value) or not 0 <= value <= MAX_REQUEUE:  # type: ignore[operator]
        raise ValueError(f"requeue must be an integer from 0 to {MAX_REQUEUE}, not {value!r:.60}")
    return value  # type: ignore[return-value]


def tags_version(value: object) -> int:
    """The tagged encoding of a record's arguments: an integer >= 0 (0: plain JSON)."""
    if not is_int(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"tags must be an integer >= 0, not {value!r:.60}")
    return value  # type: ignore[return-value]


def priority(value: object) -> int:
    """A job's priority: an integer from 0 to :data:`MAX_PRIORITY` (higher is forwarded first)."""
    if not is_int(value) or not 0 <= value <= MAX_PRIORITY:  # type: ignore[operator]
        raise EnvelopeError(f"priority must be an integer from 0 to {MAX_PRIORITY}, not {value!r:.60}")
    return value  # type: ignore[return-value]


def limit_key(value: object) -> str | None:
    """``None`` or a limit key: 1 to :data:`MAX_LIMIT_KEY` printable characters, no whitespace.

    The key names a job's tenant or resource for the forwarder's limits and fairness
    (docs/api.md, "Priorities, limit keys and fairness"); it is a name in logs, metrics and a
    run-table column, so it is kept short and plain.
    """
    if value is None:
        return None
    if (
        type(value) is not str
        or not 0 < len(value) <= MAX_LIMIT_KEY
        or not value.isprintable()
        or " " in value  # the only whitespace isprintable() passes (checked over every code point)
    ):
        raise EnvelopeError(
            f"limit_key must be 1-{MAX_LIMIT_KEY} printable characters without whitespace, not {value!r:.60}"
        )
    return value


def text_map(name: str, value: object) -> dict[str, str] | None:
    """``None`` or an object of strings (a trace context)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(type(k) is str and type(v) is str for k, v in value.items()):
        raise TypeError(f"{name} must be an object of strings, not {value!r:.60}")
    return value


def opt_str(name: str, value: object) -> str | None:
    """A string or ``None``."""
    if value is not None and type(value) is not str and not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {value!r:.60}")
    return value


def to_float(value: object) -> float:
    """A JSON number as a float (``float(10**400)`` raises OverflowError, as it should here)."""
    if not is_number(value):
        raise TypeError(f"expected a number, not {value!r:.60}")
    return float(value)  # type: ignore[arg-type]


def _float_or_nan(value: object) -> float:
    """A number as a float; NaN (refused by every range check) for a non-number or one past a float."""
    try:
        return to_float(value) if is_number(value) else math.nan
    except OverflowError:
        return math.nan


def finite(name: str, value: object) -> float:
    """A finite number (``inf`` and ``nan`` do not re-encode)."""
    if type(value) is float and value - value == 0.0:  # finite: inf - inf and nan - x are nan
        return value
    number = to_float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, not {value!r:.60}")
    return number


def opt_finite(name: str, value: object) -> float | None:
    """A finite number or ``None``."""
    if value is None:
        return None
    if type(value) is float and value - value == 0.0:  # as finite(), without its call
        return value
    return finite(name, value)


def time_value(name: str, value: object) -> float:
    """A Unix time from 1970 to :data:`MAX_TIMESTAMP` (RQ formats it as a date)."""
    number = finite(name, value)
    if not 0 <= number <= MAX_TIMESTAMP:
        raise ValueError(f"{name} must be a Unix time from 0 to {MAX_TIMESTAMP:.0f}, not {value!r:.60}")
    return number


def opt_duration(name: str, value: object) -> float | None:
    """A duration >= 0 (no upper bound here: see :meth:`Envelope.from_dict`)."""
    if value is None:
        return None
    number = finite(name, value)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, not {value!r:.60}")
    return number


def check_seconds(name: str, value: object, *, zero: bool = False) -> float:
    """``value`` as a float if it is a number of seconds above 0 (or ``zero``) up to :data:`MAX_SECONDS`.

    For what a producer asks for (``prepare``): more than :data:`MAX_SECONDS` is refused.
    """
    number = _float_or_nan(value)  # NaN fails every comparison
    if not (number >= 0 if zero else number > 0) or not number <= MAX_SECONDS:
        raise EnvelopeError(
            f"{name} must be a number of seconds {'>= 0' if zero else 'above 0'} and at most "
            f"{MAX_SECONDS} (ten years), not {value!r:.60}"
        )
    return number


def check_time(name: str, value: object) -> float:
    """``value`` as a float if it is a Unix time from 0 to :data:`MAX_TIMESTAMP`, else raise."""
    number = _float_or_nan(value)
    if not 0 <= number <= MAX_TIMESTAMP:
        raise EnvelopeError(
            f"{name} must be a Unix time from 0 to {MAX_TIMESTAMP:.0f} (year 9999), not {value!r:.60}"
        )
    return number


# The bounds of tagged values (hybridq.envelope.tagged), both ways: docs/http.md lists them.

#: The deepest nesting of JSON arrays and objects a value may have, tags' own included (a tuple
#: is two: its object and its array), as a whole record may (hybridq.envelope.codec).
MAX_NESTING = 100
#: The most members a set or frozenset may have.
MAX_SET_MEMBERS = 10_000
#: The most members of one set that may share a hash (a set of them costs their count squared).
MAX_SAME_HASH = 16
#: The most digits a decimal may have, and the largest magnitude of its adjusted exponent
#: (Python's own bound on the digits of an ``int`` read from text).
MAX_DECIMAL_DIGITS = 4300


def too_deep() -> ValueError:
    """The refusal of a value nested past :data:`MAX_NESTING` (written or read)."""
    return Refused(f"a value is nested deeper than {MAX_NESTING} levels of arrays and objects (or a cycle)")


def few(members: Collection[Any]) -> None:
    """Refuse more than :data:`MAX_SET_MEMBERS` members (checked before any is read)."""
    if len(members) > MAX_SET_MEMBERS:
        raise ValueError(f"a set of {len(members)} members (at most {MAX_SET_MEMBERS})")


def few_hashes(members: Collection[Any]) -> None:
    """Refuse members too many, or too many of which share a hash, to make a set of.

    Counted before any set is built: the hashes are ints below ``2**61``, each its own hash, so
    the count itself is linear.

    Raises:
        ValueError: over :data:`MAX_SET_MEMBERS` members, or :data:`MAX_SAME_HASH` with one hash.
    """
    few(members)
    shared = max(Counter(map(hash, members)).values(), default=0)
    if shared > MAX_SAME_HASH:
        raise ValueError(f"{shared} members of a set share one hash (at most {MAX_SAME_HASH})")


def finite_decimal(value: Decimal) -> Decimal:
    """``value`` if it is finite and within :data:`MAX_DECIMAL_DIGITS` (digits and exponent)."""
    if not value.is_finite():
        raise ValueError(f"decimal {value} is not finite (JSON has no NaN nor Infinity)")
    if len(value.as_tuple().digits) > MAX_DECIMAL_DIGITS or abs(value.adjusted()) > MAX_DECIMAL_DIGITS:
        raise ValueError(f"a decimal of over {MAX_DECIMAL_DIGITS} digits or exponent")
    return value
