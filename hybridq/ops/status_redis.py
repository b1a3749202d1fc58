"""What ``hybridq status`` says of Redis: whether each instance is up, its waiting jobs, its queues.

Redis is optional for the status (docs/cli.md, ``hybridq status``): asked only with a URL, and
its client imported only then. Kept apart from :mod:`hybridq.ops.status`, which puts the status
object together from durable state on this host.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from hybridq.security.secretfile import read_password
from hybridq.transport.redisurl import redact_url, with_password
from hybridq.transport.routes import Routes

__all__ = ["env_redis_url", "instances", "redis_state"]


def env_redis_url() -> str | None:
    """``HYBRIDQ_REDIS_URL`` with the password in ``HYBRIDQ_REDIS_PASSWORD_FILE``, as ``--redis`` takes it."""
    url = os.environ.get("HYBRIDQ_REDIS_URL") or None
    password_file = os.environ.get("HYBRIDQ_REDIS_PASSWORD_FILE")
    return with_password(url, read_password(password_file)) if url and password_file else url


def instances(default: str | None, redis_for: Mapping[str, str]) -> list[dict[str, Any]]:
    """Per Redis instance: its URL, the queues it holds, whether it is up, its queues' lengths.

    ``queues``: the queues mapped to it, and ``"*"`` (every other queue) for the default one;
    ``queued``: the length of each of its RQ queues that belongs there (``None`` while down).
    """
    routes = Routes(default or "", redis_for)
    urls = routes.urls if default is not None else sorted(set(redis_for.values()))
    out: list[dict[str, Any]] = []
    for url in urls:
        queues = routes.queues_on(url) + (["*"] if url == default else [])
        state = redis_state(url, owns=functools.partial(_lives_on, routes, url))
        out.append({"url": redact_url(url), "queues": queues, **state})
    return out


def _lives_on(routes: Routes, url: str, queue: str) -> bool:
    return routes.url_for(queue) == url


def redis_state(url: str, *, owns: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Whether Redis is ``up``, and how many jobs are ``waiting_for_a_worker``.

    ``refused``, only when Redis answers but refuses this URL: why (``redisurl.refusal``).

    The jobs a worker recently left because it cannot run them (not importable there, or not
    allowed: see :mod:`hybridq.worker.waiting`); ``None`` while Redis is down. With ``owns`` (which
    queues live on this Redis), also ``queued``: the length of each of those RQ queues.
    """
    from redis.exceptions import RedisError  # noqa: PLC0415

    from hybridq.errors import TransportError  # noqa: PLC0415
    from hybridq.transport.redisurl import refusal  # noqa: PLC0415
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415 - only when Redis is asked for
    from hybridq.worker import waiting  # noqa: PLC0415

    transport = RQTransport(url, socket_timeout_s=1.0)
    try:
        transport.ping()
        state: dict[str, Any] = {
            "up": True,
            "waiting_for_a_worker": waiting.current(transport.connection, limit=0).count,
        }
        if owns is not None:
            state["queued"] = _queue_lengths(transport.connection, owns)
    except (TransportError, RedisError) as exc:
        state = {"up": False, "waiting_for_a_worker": None}
        why = refusal(exc.__cause__ or exc)
        if why is not None:  # it answered, but refuses this URL (a password missing from it, ...)
            state["refused"] = why
        if owns is not None:
            state["queued"] = None
    finally:
        transport.close()
    return state


def _queue_lengths(conn: Any, owns: Callable[[str], bool]) -> dict[str, int]:
    """The length of every RQ queue Redis knows that ``owns`` says lives there."""
    from hybridq.protocol import keys  # noqa: PLC0415

    prefix = keys.rq_queue("")
    names = sorted(
        name
        for raw in conn.smembers(keys.rq_queues())
        if (name := (raw.decode() if isinstance(raw, bytes) else str(raw)).removeprefix(prefix))
        and owns(name)
    )
    return {name: int(conn.llen(keys.rq_queue(name))) for name in names}
