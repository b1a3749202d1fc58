"""Redis URLs from users, checked before use; Redis refusing a configuration told from an outage.

:func:`client` is the one place a user's Redis URL becomes a client: a plain ``redis://``,
``rediss://`` or ``unix://`` URL, or a Sentinel one (``redis+sentinel://``, below), whose client
asks the Sentinels for the current master on every new connection and so follows a failover.

An outage (Redis down, restarting, unreachable) is retried with backoff by the forwarder and the
workers. A configuration Redis *refuses* -- a wrong password, a disabled user, a DB index out of
range, an ACL that denies a command or key hybridq needs -- does not get better by retrying, so
it is reported once and the process exits (:class:`hybridq.errors.RedisRefused`).
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING, Any

from hybridq.errors import InvalidRedisURL, RedisFull, RedisRefused, TransportError
from hybridq.transport.sentinel import SENTINEL_SCHEME, is_sentinel, parse_sentinel, sibling

if TYPE_CHECKING:
    import redis
    from redis.exceptions import RedisError

__all__ = [
    "SENTINEL_SCHEME",
    "InvalidRedisURL",
    "check_url",
    "client",
    "is_sentinel",
    "redact_url",
    "refusal",
    "sibling",
    "transport_error",
    "with_password",
]

#: Reply texts (lowercase) by which Redis refuses a configuration rather than fails for a while.
#: A denied command inside a script comes back as a plain ERR with the ACL's wording.
_REFUSALS = (
    "noperm",
    "no permissions to",
    "can't run this command",
    "can't access",
    "wrongpass",
    "noauth",
    "invalid username-password pair",
)


def client(url: str, **redis_kwargs: Any) -> redis.Redis:
    """A client of the Redis ``url`` names: every user-given URL becomes a client here.

    Args:
        url: ``redis://``, ``rediss://`` or ``unix://`` (redis-py's forms), or
            ``redis+sentinel://[user:pass@]host:port,host:port/SERVICE[/DB][?options]``: a client
            of SERVICE's current master, found through those Sentinels on every new connection
            (so it follows a failover); options in docs/deploy.md ("Sentinel and replicas").
        **redis_kwargs: connection options (``socket_timeout``, ...); the URL's own query options
            win over them, as with :meth:`redis.Redis.from_url`.

    No I/O: the connection is made on first use. Raises ValueError for a URL redis-py cannot
    use (:func:`check_url` turns that into a one-line :class:`InvalidRedisURL`).
    """
    import redis  # noqa: PLC0415 - `hybridq status` and `--help` need no redis-py

    if not is_sentinel(url):
        return redis.Redis.from_url(url, **redis_kwargs)
    from hybridq.transport.sentinel import master_client  # noqa: PLC0415 - imports redis.sentinel

    return master_client(parse_sentinel(url), redis_kwargs)


def check_url(url: str) -> str:
    """Return ``url`` if redis-py can build a connection from it, else raise InvalidRedisURL.

    Builds the connection object without connecting, so unknown or malformed options are
    caught here rather than as a traceback on first use. The message shows the URL redacted.
    """
    if _misplaced_credentials(url):
        raise InvalidRedisURL(
            f"invalid Redis URL ({url.partition('://')[0]}://..., not shown): its user name or password "
            "holds '/', '?' or '#', which must be percent-encoded (%2F, %3F, %23); or give the "
            "password in a file (HYBRIDQ_REDIS_PASSWORD_FILE, docs/security.md)"
        )
    try:
        _build(url)
    except (ValueError, TypeError) as exc:
        raise InvalidRedisURL(f"invalid Redis URL {redact_url(url)}: {_scrub(str(exc), url)}") from None
    return url


def _misplaced_credentials(url: str) -> bool:
    """Whether ``url``'s user name or password holds an unencoded ``/``, ``?`` or ``#``.

    URL parsers end the host part at the first of those: a password ``se/cret`` made redis-py
    read ``se`` as a port and ``/cret@host`` as the path, and quote them in its errors. The last
    ``@`` ends the userinfo, unless what comes before the first ``/``, ``?`` or ``#`` is a whole
    host part by itself (hosts with numeric ports): then that ``@`` is in a query value
    (``?password=a@b``) or the fragment.
    """
    _scheme, sep, rest = url.partition("://")
    creds, at, _after = rest.rpartition("@")
    if not sep or not at or not any(c in creds for c in "/?#"):
        return False
    head = creds
    for stop in "/?#":
        head = head.partition(stop)[0]
    hosts = head.rpartition("@")[2]
    return not all(_host_with_port(h) for h in hosts.split(","))


def _host_with_port(host: str) -> bool:
    """``name``, ``name:digits``, ``[v6]`` or ``[v6]:digits`` (or empty, as in ``unix:///``)."""
    if host.startswith("["):
        _, close, port = host.partition("]")
        return bool(close) and (not port or (port[0] == ":" and port[1:].isascii() and port[1:].isdigit()))
    name, colon, port = host.partition(":")
    return not colon or (port.isascii() and port.isdigit() and ":" not in name)


def _build(url: str) -> None:
    """Build (not connect) redis-py's connection for ``url``: ValueError or TypeError if it cannot."""
    if is_sentinel(url):
        parse_sentinel(url).check()
        return
    parts = urllib.parse.urlsplit(url)
    if parts.scheme in ("redis", "rediss") and parts.path.strip("/") and not parts.path[1:].isdigit():
        # redis-py silently ignores a database it cannot parse (and uses database 0).
        raise ValueError("the path must be a database number")  # not quoted: a password may be in it
    import redis  # noqa: PLC0415 - `hybridq status` and `--help` need no redis-py

    pool = redis.ConnectionPool.from_url(url)
    try:
        pool.make_connection()  # the options are applied here (no I/O)
    finally:
        pool.disconnect()


def _scrub(message: str, url: str) -> str:
    """``message`` without any secret ``url`` holds (redis-py may quote a bad value)."""
    # Split as redact_url does, not with urlsplit: that raises on some malformed hosts ("[::1").
    creds, _at, rest = url.partition("://")[2].rpartition("@")
    query = rest.partition("#")[0].partition("?")[2]
    password = creds.partition(":")[2]
    secrets = [password, urllib.parse.unquote(password)]
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if "pass" in "".join(c for c in name.lower() if c.isalnum()):
            secrets.append(value)
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        message = message.replace(secret, "***").replace(urllib.parse.quote(secret, safe=""), "***")
    return message


def refusal(exc: BaseException) -> str | None:
    """Why Redis refuses this configuration (a short reason), or None if ``exc`` may pass."""
    from redis.exceptions import AuthenticationError, NoPermissionError, RedisError  # noqa: PLC0415
    from redis.sentinel import MasterNotFoundError  # noqa: PLC0415

    if isinstance(exc, AuthenticationError):
        return "login refused: check the user name and password"
    if isinstance(exc, NoPermissionError):
        return "the ACL denies a command or key hybridq needs (docs/deploy.md)"
    if isinstance(exc, MasterNotFoundError):
        return None  # no Sentinel names a master now (it may quote one Sentinel's refusal): wait
    if isinstance(exc, RedisError):
        text = str(exc).lower()
        if "db index" in text:
            return "no such database number"
        if any(needle in text for needle in _REFUSALS):
            return "the ACL denies a command or key hybridq needs (docs/deploy.md)"
    return None


def transport_error(exc: RedisError) -> TransportError:
    """The TransportError for ``exc``: :class:`RedisRefused` (not retried) if it is a refusal."""
    why = refusal(exc)
    if why is not None:
        return RedisRefused(f"Redis refused this configuration ({why}): {exc}")
    from redis.exceptions import OutOfMemoryError  # noqa: PLC0415 - redis-py only when it failed

    if isinstance(exc, OutOfMemoryError) or "command not allowed when used memory" in str(exc):
        return RedisFull(f"Redis is full: {exc}")
    return TransportError(f"Redis: {exc}")


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` as its credentials' password (the user, if any, is kept)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    netloc = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def redact_url(url: str) -> str:
    """``url`` with every secret it may carry shown as ``***``.

    Redacted: the userinfo's password (``user:pass@``; a lone ``secret@`` entirely), any query
    parameter whose *decoded* name mentions a password (``password``, ``ssl_password``,
    ``pass%77ord``, ``PASS+WORD``: redis-py decodes names before it uses them), and the fragment.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # The last "@" ends the userinfo, even where a sloppy password holds "@", "/" or "?";
    # unless a query with a parameter comes before it: then the "@" is in a query value
    # (``?sentinel_password=a@b``), and the userinfo can only end before that query.
    head, q, tail = rest.partition("?")
    if q and "@" in tail and "=" in tail.partition("@")[0] and not _misplaced_credentials(url):
        creds, at, rest = head.rpartition("@")
        rest += q + tail
    else:
        creds, at, rest = rest.rpartition("@")
    rest, hsep, _fragment = rest.partition("#")
    rest, qsep, query = rest.partition("?")
    if at:
        user, colon, _password = creds.partition(":")
        rest = f"{user}:***@{rest}" if colon and user else f"***@{rest}"
    if qsep:
        rest += "?" + "&".join(_redact_param(part) for part in query.split("&"))
    return f"{scheme}://{rest}" + ("#***" if hsep else "")


def _redact_param(part: str) -> str:
    key, _eq, _value = part.partition("=")
    name = "".join(c for c in urllib.parse.unquote_plus(key).lower() if c.isalnum())
    return f"{key}=***" if "pass" in name else part
