"""Which Redis holds which queue: the queue → Redis map of ``--redis-for`` and ``HYBRIDQ_REDIS_FOR``.

Queues not in the map live on the default Redis (``--redis``). The map is parsed and checked
here, before anything connects: a bad entry is one :class:`~hybridq.errors.ConfigError` line.
No redis-py import at module level (``hybridq status`` and ``--help`` need none).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hybridq.envelope.model import validate_queue_name
from hybridq.errors import ConfigError, HybridqError
from hybridq.transport.redisurl import check_url, redact_url

__all__ = ["ENV_VAR", "Routes", "parse_redis_for", "split_env"]

#: The environment form of ``--redis-for``: ``"q1=redis://a:6379/0,q2=redis://b:6379/0"``.
ENV_VAR = "HYBRIDQ_REDIS_FOR"

# Entries are separated by commas, semicolons or whitespace, but only where the next entry begins
# (``NAME=``): a URL may hold commas itself (a Sentinel URL lists its hosts with them).
_SPLIT = re.compile(r"[,;\s]+(?=[A-Za-z0-9_][A-Za-z0-9_.-]*=)")


@dataclass(frozen=True)
class Routes:
    """The default Redis URL and the queues that live elsewhere (queue → URL)."""

    default: str
    queues: Mapping[str, str] = field(default_factory=dict)

    def url_for(self, queue: str) -> str:
        """The URL of the Redis that holds ``queue``."""
        return self.queues.get(queue, self.default)

    @property
    def urls(self) -> list[str]:
        """Every Redis, the default first, then the others in a stable (sorted) order."""
        return [self.default, *sorted(set(self.queues.values()) - {self.default})]

    @property
    def sharded(self) -> bool:
        """Whether any queue lives on a Redis other than the default."""
        return len(self.urls) > 1

    @property
    def digest(self) -> str:
        """A short hash of which queue lives on which Redis (of :attr:`urls`, by position).

        Part of the composed epoch (:mod:`hybridq.transport.sharded`): moving a queue to another
        Redis changes it, so the forwarder refills. By position, not URL: a URL written
        differently (a new password) moves nothing.
        """
        urls = self.urls
        moved = sorted((q, urls.index(u)) for q, u in self.queues.items() if u != self.default)
        return hashlib.sha256(json.dumps(moved).encode()).hexdigest()[:12]

    def queues_on(self, url: str) -> list[str]:
        """The queues mapped to ``url`` (the default Redis also holds every unmapped queue)."""
        return sorted(q for q, u in self.queues.items() if u == url)


def split_env(text: str) -> list[str]:
    """The ``QUEUE=URL`` entries of ``HYBRIDQ_REDIS_FOR`` (see the module docstring)."""
    return [part for part in _SPLIT.split(text.strip()) if part]


def parse_redis_for(entries: Iterable[str]) -> dict[str, str]:
    """``QUEUE=URL`` entries as a map, each queue name and URL checked.

    Raises:
        ConfigError: an entry without ``=``, a bad queue name, a URL redis-py cannot use, or a
            queue mapped to two different URLs (one line; the URL shown redacted).
    """
    out: dict[str, str] = {}
    for entry in entries:
        queue, sep, url = entry.strip().partition("=")
        if not sep or not queue or not url:
            raise ConfigError(f"--redis-for wants QUEUE=URL, not {redact_url(entry)!r}")
        try:
            validate_queue_name(queue)
            check_url(url)
        except HybridqError as exc:
            raise ConfigError(f"--redis-for {queue}=...: {exc}") from None
        if out.get(queue, url) != url:
            raise ConfigError(f"--redis-for: queue {queue!r} is mapped to two different Redis URLs")
        out[queue] = url
    return out
