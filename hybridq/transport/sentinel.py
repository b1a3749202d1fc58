"""``redis+sentinel://`` URLs: a client of a Sentinel-monitored master that follows failovers.

The form (docs/deploy.md, "Sentinel and replicas")::

    redis+sentinel://[user:pass@]host:port[,host:port...]/SERVICE[/DB][?option=value&...]

* ``host:port,...``: the Sentinels (the port defaults to 26379; ``[::1]:26379`` for IPv6).
* ``SERVICE``: the master's name in the Sentinels' configuration (``sentinel monitor SERVICE ...``).
* ``DB``: the database number (default 0).
* ``user:pass@``: the credentials of the *Redis servers* (master and replicas), as in ``redis://``.
* Options for the Sentinels themselves: ``sentinel_username`` and ``sentinel_password`` (when the
  Sentinels have ``requirepass``; by default they are asked without credentials) and
  ``sentinel_timeout`` (seconds one Sentinel may take to connect or answer, default
  :data:`SENTINEL_TIMEOUT_S`; one that refuses the connection is skipped at once: no retries).
  A login every Sentinel asked refuses raises ``AuthenticationError`` (a refusal, not an outage).
* Every other option is redis-py's, as in a ``redis://`` URL (``socket_timeout``,
  ``socket_connect_timeout``, ``health_check_interval``, ``client_name``, ...), and applies to the
  connections to the master; like there, it wins over the caller's own timeouts.

Every new connection asks the Sentinels where the master is (redis-py's ``SentinelConnectionPool``),
so a client whose connection broke when the master died reconnects to the promoted replica. A
connection still open to a master that was demoted to a replica gets ``READONLY`` on its next
write: redis-py turns that reply into a ConnectionError (drop the connection, ask again), and
:class:`_FollowingConnection` does the same for the form Redis 6 wraps it in inside a script
(``ERR Error running script ... -READONLY ...``), which hybridq's writes all are.

This module imports only the standard library at import time (``hybridq status`` needs no redis-py).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

__all__ = [
    "SENTINEL_PORT",
    "SENTINEL_SCHEME",
    "SENTINEL_TIMEOUT_S",
    "SentinelURL",
    "is_sentinel",
    "parse_sentinel",
]

#: The URL scheme of a Sentinel-monitored Redis.
SENTINEL_SCHEME = "redis+sentinel"
#: A Sentinel's port when the URL names none (Redis's default).
SENTINEL_PORT = 26379
#: Default seconds a Sentinel may take to connect or answer before the next one is asked.
SENTINEL_TIMEOUT_S = 1.0
#: Query options for the Sentinels themselves; every other one goes to the master's connections.
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", "sentinel_timeout")
#: What a replica replies to a write (inside a script's error text on Redis 6).
_DEMOTED = "READONLY You can't write against a read only replica"


def is_sentinel(url: str) -> bool:
    """Whether ``url`` has a Sentinel scheme (``redis+sentinel://``; ``rediss+sentinel`` is refused)."""
    scheme = url.partition("://")[0].lower()
    return scheme.endswith("+sentinel")


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL (see the module docstring)."""

    #: The Sentinels' (host, port), in the URL's order.
    sentinels: tuple[tuple[str, int], ...]
    #: The master's name in the Sentinels' configuration.
    service: str
    #: The database number.
    db: int
    #: ``user:pass@`` as written in the URL (percent-encoded), or "".
    userinfo: str
    #: The query options for the master's connections, as written (name, value) pairs.
    options: tuple[tuple[str, str], ...]
    #: The Sentinels' own credentials and timeout.
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    sentinel_timeout: float = SENTINEL_TIMEOUT_S

    def master_kwargs(self) -> dict[str, Any]:
        """redis-py connection options for the master, parsed by redis-py as from a ``redis://`` URL.

        Raises ValueError for a value redis-py cannot parse (``socket_timeout=soon``).
        """
        from redis.connection import parse_url  # noqa: PLC0415

        query = urllib.parse.urlencode(self.options)
        kwargs: dict[str, Any] = parse_url(f"redis://{self.userinfo}localhost/{self.db}?{query}")  # type: ignore[no-untyped-call]
        kwargs.pop("host", None)
        kwargs.pop("port", None)
        return kwargs

    def sentinel_kwargs(self) -> dict[str, Any]:
        """redis-py connection options for the Sentinels.

        No retries: redis-py's default (3, with backoff of seconds) would make a dead Sentinel
        cost seconds before the next is asked; asking the next one is the retry.
        """
        from redis.backoff import NoBackoff  # noqa: PLC0415
        from redis.retry import Retry  # noqa: PLC0415

        kwargs: dict[str, Any] = {
            "socket_timeout": self.sentinel_timeout,
            "socket_connect_timeout": self.sentinel_timeout,
            "retry": Retry(NoBackoff(), 0),
        }
        if self.sentinel_username is not None:
            kwargs["username"] = self.sentinel_username
        if self.sentinel_password is not None:
            kwargs["password"] = self.sentinel_password
        return kwargs

    def check(self) -> None:
        """Build (not connect) a master connection: ValueError or TypeError for a bad option."""
        import redis  # noqa: PLC0415

        pool = redis.ConnectionPool(**self.master_kwargs())
        try:
            pool.make_connection()  # the options are applied here (no I/O)
        finally:
            pool.disconnect()


def parse_sentinel(url: str) -> SentinelURL:
    """Parse a ``redis+sentinel://`` URL; ValueError (a short reason, no secret) if malformed."""
    scheme, _sep, rest = url.partition("://")
    if scheme.lower() != SENTINEL_SCHEME:
        raise ValueError(f"the scheme must be {SENTINEL_SCHEME}:// (TLS to Sentinels is not supported)")
    rest = rest.partition("#")[0]
    rest, _q, query = rest.partition("?")
    # The last "@" ends the userinfo, even where a password holds "@" or "/" (as redact_url).
    userinfo, at, rest = rest.rpartition("@")
    hosts, _slash, path = rest.partition("/")
    sentinels = tuple(_host_port(part) for part in hosts.split(","))
    segments = [s for s in path.split("/") if s] if path else []
    if not segments:
        raise ValueError("name the master's service: redis+sentinel://host:port,host:port/SERVICE/DB")
    if len(segments) > 2:
        raise ValueError(f"the path must be /SERVICE or /SERVICE/DB, not {'/' + path!r}")
    service = urllib.parse.unquote(segments[0])
    db_text = segments[1] if len(segments) == 2 else "0"
    if not db_text.isdigit():
        raise ValueError(f"the database must be a number, not {db_text!r}")
    options: list[tuple[str, str]] = []
    sentinel: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if name in _SENTINEL_OPTIONS:
            sentinel[name] = value
        else:
            options.append((name, value))
    timeout = SENTINEL_TIMEOUT_S
    if "sentinel_timeout" in sentinel:
        try:
            timeout = float(sentinel["sentinel_timeout"])
        except ValueError:
            timeout = -1.0
        if not 0 < timeout < 3600:
            raise ValueError("sentinel_timeout must be a number of seconds above 0 (and below 3600)")
    return SentinelURL(
        sentinels=sentinels,
        service=service,
        db=int(db_text),
        userinfo=f"{userinfo}@" if at else "",
        options=tuple(options),
        sentinel_username=sentinel.get("sentinel_username"),
        sentinel_password=sentinel.get("sentinel_password"),
        sentinel_timeout=timeout,
    )


def _host_port(part: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` as (host, port)."""
    if part.startswith("["):
        host, bracket, port_text = part[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ValueError(f"bad Sentinel address {part!r}")
        port_text = port_text[1:]
    else:
        host, _colon, port_text = part.partition(":")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"bad Sentinel address {part!r}: give host:port, comma-separated")
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad Sentinel port in {part!r}")
    return host, int(port_text)


def master_client(parsed: SentinelURL, redis_kwargs: dict[str, Any]) -> redis.Redis:
    """A client of ``parsed.service``'s current master; ``redis_kwargs`` yield to the URL's options."""
    sentinel = _sentinel_class()(list(parsed.sentinels), sentinel_kwargs=parsed.sentinel_kwargs())
    kwargs = {**redis_kwargs, **parsed.master_kwargs(), "connection_class": _connection_class()}
    made: redis.Redis = sentinel.master_for(parsed.service, **kwargs)
    return made


def sibling(conn: redis.Redis, **overrides: Any) -> redis.Redis:
    """A new client of ``conn``'s Redis (the same Sentinel service, if it is one), with other options.

    Its own connection pool: ``overrides`` (timeouts) apply to its connections only.
    """
    import redis  # noqa: PLC0415
    from redis.sentinel import SentinelConnectionPool  # noqa: PLC0415

    pool = conn.connection_pool
    options = {**pool.connection_kwargs, **overrides}
    if isinstance(pool, SentinelConnectionPool):
        options.pop("connection_pool", None)  # the pool's proxy: the new pool makes its own
        made = SentinelConnectionPool(  # type: ignore[no-untyped-call]
            pool.service_name, pool.sentinel_manager, connection_class=pool.connection_class, **options
        )
        return redis.Redis(connection_pool=made)
    return redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **options)
    )


def _connection_class() -> type[Any]:
    """redis-py's Sentinel-managed connection, also following a demotion reported inside a script."""
    global _following
    if _following is None:
        from redis.exceptions import ConnectionError as RedisConnectionError  # noqa: PLC0415
        from redis.exceptions import ResponseError  # noqa: PLC0415
        from redis.sentinel import SentinelManagedConnection  # noqa: PLC0415

        class _FollowingConnection(SentinelManagedConnection):
            """Treats a script's wrapped ``READONLY`` as the plain one: the master was demoted."""

            def read_response(self, *args: Any, **kwargs: Any) -> Any:
                try:
                    return super().read_response(*args, **kwargs)
                except ResponseError as exc:
                    if self.connection_pool.is_master and _DEMOTED in str(exc):
                        # Asking this server again would fail the same way: drop the connection,
                        # so the next one asks the Sentinels where the master is now.
                        self.disconnect()  # type: ignore[no-untyped-call]
                        raise RedisConnectionError("the master was demoted to a replica (READONLY)") from exc
                    raise

        _following = _FollowingConnection
    return _following


_following: type[Any] | None = None


def _sentinel_class() -> type[Any]:
    """redis-py's Sentinel manager, whose "no master" error is one short line.

    redis-py's own message holds the repr of every Sentinel client (kilobytes per outage log
    line); this one names the service and, per Sentinel, its address and why it did not answer.
    """
    global _sentinel  # built once, on first use (it subclasses redis-py's class)
    if _sentinel is None:
        from redis.exceptions import AuthenticationError  # noqa: PLC0415
        from redis.exceptions import ConnectionError as RedisConnectionError  # noqa: PLC0415
        from redis.exceptions import TimeoutError as RedisTimeoutError  # noqa: PLC0415
        from redis.sentinel import MasterNotFoundError, Sentinel  # noqa: PLC0415

        class _Sentinels(Sentinel):
            def discover_master(self, service_name: str) -> tuple[str, int]:
                errors: list[str] = []
                refusals = 0
                for i, sentinel in enumerate(self.sentinels):
                    kwargs = sentinel.connection_pool.connection_kwargs
                    try:
                        masters: dict[str, Any] = sentinel.sentinel_masters()  # type: ignore[assignment]
                    except (RedisConnectionError, RedisTimeoutError) as exc:
                        refusals += isinstance(exc, AuthenticationError)
                        errors.append(f"{kwargs.get('host')}:{kwargs.get('port')}: {exc}")
                        continue
                    state = masters.get(service_name)
                    if state and self.check_master_state(state, service_name):  # type: ignore[no-untyped-call]
                        # The one that answered is asked first next time (as redis-py does).
                        self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]
                        return state["ip"], state["port"]
                why = f" ({'; '.join(errors)})" if errors else ""
                if refusals == len(self.sentinels):
                    # A login every Sentinel refuses is a configuration to fix, not an outage to
                    # wait out (hybridq.transport.redisurl.refusal: the processes exit and say so). One
                    # that refuses while others answer (a password being rotated) during a
                    # failover is an outage: the others will name the new master.
                    raise AuthenticationError(
                        f"the Sentinels refused the login (sentinel_username, sentinel_password){why}"
                    )
                raise MasterNotFoundError(f"no Sentinel names a healthy master for {service_name!r}{why}")

        _sentinel = _Sentinels
    return _sentinel


_sentinel: type[Any] | None = None
