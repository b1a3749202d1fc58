"""Per-key concurrency and rate limits: the policies, and how a delivery carries one to the worker.

The operator gives the forwarder its policies (``hybridq forward --limit 'tenant:*=concurrency:2'``,
``HYBRIDQ_LIMITS``, ``Forwarder(limits=...)``); a job names its key (``limit_key``). The forwarder
puts the policy of a job's key into its delivery (:attr:`Delivery.limit`, :meth:`Limit.wire`); the
worker's claim script enforces it in Redis, where every forwarder and worker sees the same holders
(docs/forwarder.md, "Limits per key"). Only this module parses the policies' text.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridq.errors import ConfigError

if TYPE_CHECKING:
    from hybridq.envelope.model import Envelope

__all__ = ["PERIODS", "Limit", "Limits", "limit_key_of", "parse_limit", "parse_limits"]

#: The most keys :meth:`Limits.of` remembers; full, it is emptied and fills again (a key per
#: job never freezes it with keys no longer seen).
_OF_MAX = 16_384
#: What :meth:`Limits.of` finds for a key it does not remember (``None`` is an answer).
_MISS = object()
#: The periods a rate may be given in, in milliseconds.
PERIODS = {"s": 1000, "m": 60_000, "h": 3_600_000}

_RATE = re.compile(r"\A([1-9][0-9]{0,8})/([smh])\Z")
_COUNT = re.compile(r"\A[1-9][0-9]{0,8}\Z")
#: What a key or a pattern may hold: printable, no whitespace (as ``Envelope.limit_key``).
_KEY = re.compile(r"\A[!-~]{1,200}\Z")


@dataclass(frozen=True, slots=True)
class Limit:
    """One key's policy: at most ``concurrency`` running, ``rate`` starts per ``period_ms`` (0: none)."""

    concurrency: int = 0
    rate: int = 0
    period_ms: int = 0
    #: The wire text before the key, made once: :meth:`wire` runs once per delivery, and its
    #: f-string of three numbers cost 0.18 us a key against 0.05 for this concatenation, with
    #: no memo per key (docs/benchmarks.md, "One call fewer per claim").
    _head: str = field(init=False, repr=False, compare=False)
    #: :meth:`text`, made once: the forwarder's key gate shows it for each key it reads, and a
    #: memo by policy hashed the policy (a Python ``__hash__``) per key (docs/benchmarks.md,
    #: "The limits' Python per job").
    _text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_head", f"{self.concurrency},{self.rate},{self.period_ms},")
        parts = [f"concurrency:{self.concurrency}"] if self.concurrency else []
        if self.rate:
            unit = next((u for u, ms in PERIODS.items() if ms == self.period_ms), None)
            parts.append(f"rate:{self.rate}/{unit}" if unit else f"rate:{self.rate}/{self.period_ms}ms")
        object.__setattr__(self, "_text", ",".join(parts))

    def wire(self, key: str) -> str:
        """The policy of ``key`` as a delivery carries it (the claim script parses it)."""
        return self._head + key

    def text(self) -> str:
        """The policy as an operator writes it (``concurrency:2,rate:10/s``)."""
        return self._text


def parse_limit(spec: str) -> Limit:
    """``concurrency:N``, ``rate:N/s|N/m|N/h`` or both (comma-separated) as a :class:`Limit`.

    Raises:
        ConfigError: a one-line message saying what is wrong.
    """
    concurrency = rate = period = 0
    for part in spec.split(","):
        name, sep, value = part.strip().partition(":")
        if name == "concurrency" and sep and _COUNT.match(value) and not concurrency:
            concurrency = int(value)
        elif name == "rate" and sep and (m := _RATE.match(value)) and not rate:
            rate, period = int(m[1]), PERIODS[m[2]]
        else:
            raise ConfigError(
                f"bad limit {spec!r}: expected concurrency:N, rate:N/s (or /m, /h), or both, "
                "comma-separated, each once, N a positive integer"
            )
    return Limit(concurrency, rate, period)


@dataclass(frozen=True, slots=True)
class Limits:
    """The policies, by glob pattern on the key: the **first** pattern given that matches wins."""

    rules: tuple[tuple[str, Limit], ...] = ()
    #: Each key's policy as the globs matched it (up to :data:`_OF_MAX` keys, then emptied): the
    #: forwarder asks once per delivery (and its key gate at a key's first sight), and a glob
    #: match per rule cost 0.6 us a key with one rule, 1.4 with three; with this memo a key seen
    #: before costs 0.1 and a new key 0.2 more than without it (docs/benchmarks.md, "One call
    #: fewer per claim"). Not compared, not shown, not pickled.
    _of: dict[str, Limit | None] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: Each rule's test, made once (:func:`_matchers`): a key first seen is matched without
    #: ``fnmatchcase``'s Python call and pattern cache per rule (docs/benchmarks.md, "The
    #: limits' Python per job"). Not compared, not shown, not pickled.
    _match: tuple[tuple[str, Callable[[str], object] | None, Limit], ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "_match", _matchers(self.rules))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __getstate__(self) -> tuple[tuple[tuple[str, Limit], ...]]:
        """The rules only: a pickled or copied ``Limits`` starts with an empty memo.

        A one-item tuple (never false, so unpickling always calls :meth:`__setstate__`).
        """
        return (self.rules,)

    def __setstate__(self, state: tuple[tuple[tuple[str, Limit], ...]]) -> None:
        object.__setattr__(self, "rules", state[0])
        object.__setattr__(self, "_of", {})
        object.__setattr__(self, "_match", _matchers(state[0]))

    def of(self, key: str | None) -> Limit | None:
        """The policy of ``key`` (``None``: the key is not limited)."""
        if key is None or not self.rules:
            return None
        memo = self._of
        limit = memo.get(key, _MISS)
        if limit is not _MISS:
            return limit  # type: ignore[return-value]
        limit = None
        for prefix, match, rule in self._match:
            if key.startswith(prefix) if match is None else match(key) is not None:
                limit = rule
                break
        if len(memo) >= _OF_MAX:
            memo.clear()
        memo[key] = limit
        return limit

    def texts(self) -> list[str]:
        """The policies as ``--limit`` takes them, in order."""
        return [f"{pattern}={limit.text()}" for pattern, limit in self.rules]


def _matchers(
    rules: tuple[tuple[str, Limit], ...],
) -> tuple[tuple[str, Callable[[str], object] | None, Limit], ...]:
    """Each rule's test: ``PREFIX*`` (no other wildcard) a prefix, else ``fnmatchcase``'s own regex.

    A prefix rule is ``(prefix, None, limit)`` (``str.startswith``); any other is
    ``("", match, limit)``, the compiled pattern's ``match``, as ``fnmatchcase`` matches it.
    """
    out: list[tuple[str, Callable[[str], object] | None, Limit]] = []
    for pattern, rule in rules:
        head = pattern[:-1]
        if pattern.endswith("*") and not any(c in head for c in "*?["):
            out.append((head, None, rule))
        else:
            out.append(("", re.compile(fnmatch.translate(pattern)).match, rule))
    return tuple(out)


def parse_limits(items: Iterable[str] | Mapping[str, str] | Limits | None) -> Limits:
    """``PATTERN=SPEC`` items (or a mapping of pattern to spec) as :class:`Limits`.

    Raises:
        ConfigError: a one-line message naming the bad item.
    """
    if items is None:
        return Limits()
    if isinstance(items, Limits):
        return items
    pairs = list(items.items()) if isinstance(items, Mapping) else [_split(item) for item in items]
    rules: list[tuple[str, Limit]] = []
    for pattern, spec in pairs:
        if not isinstance(pattern, str) or not _KEY.match(pattern):
            raise ConfigError(f"bad limit pattern {pattern!r}: 1-200 printable characters, no whitespace")
        if not isinstance(spec, str):
            raise ConfigError(f"bad limit for {pattern!r}: {spec!r} is not text")
        if any(p == pattern for p, _ in rules):
            raise ConfigError(f"limit pattern {pattern!r} given twice")
        rules.append((pattern, parse_limit(spec)))
    return Limits(tuple(rules))


def _split(item: str) -> tuple[str, str]:
    pattern, sep, spec = item.rpartition("=")
    if not sep or not pattern or not spec:
        raise ConfigError(f"bad --limit {item!r}: expected PATTERN=SPEC, e.g. 'tenant:*=concurrency:2'")
    return pattern.strip(), spec.strip()


def limit_key_of(env: Envelope) -> str | None:
    """The job's limit key (``enqueue(..., limit_key=...)``), ``None`` if it names none."""
    return env.limit_key
