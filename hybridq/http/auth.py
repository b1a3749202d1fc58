"""Bearer tokens for ``hybridq serve``, and the login cookie browsers use instead (docs/http.md).

The contract the other parts of the server (the dashboard) rely on:

* :class:`AuthMiddleware` runs before every route. It sets ``request.state.authenticated``
  (``scope["state"]["authenticated"]``) to ``True`` when the request carries a valid token, as
  ``Authorization: Bearer <token>`` or, for the dashboard's routes only, as the session cookie
  :data:`COOKIE` that ``POST /login`` sets (a browser sends a cookie on a cross-site request:
  ``/v1/*`` and ``/metrics`` take the bearer header only), and always when the server runs
  without a tokens file (a loopback bind only). Without a tokens file it also refuses a ``Host``
  header that is not this machine's (DNS rebinding: :func:`allowed_hosts`). Every path
  but :data:`OPEN_PATHS` (``/healthz``, ``/login``, ``/logout``) is refused unless authenticated:
  ``401`` with a JSON error for API clients, a ``303`` to ``/login?next=...`` for a browser's
  ``GET`` of an HTML page. A route therefore never sees an unauthenticated request.
* The cookie holds no token: it is its issue time and an HMAC of that time under one token
  (:func:`session_value`), so a token removed from the file ends its sessions too, a cookie
  older than :data:`SESSION_S` is refused whatever the browser keeps, and ``POST /logout``
  revokes the cookie it clears (in this process). It is ``HttpOnly``, ``SameSite=Strict``, ``Path=/``, and
  ``Secure`` when the request came over HTTPS (directly or through a trusted proxy).

Tokens are compared with :func:`hmac.compare_digest` and never logged. The file is read again
when its size or modification time changes (rotation: add the new token, move clients over,
remove the old one).
"""

from __future__ import annotations

import ipaddress
import json
import math
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import RedirectResponse, Response

from hybridq.errors import TokensError
from hybridq.http.tokens import COOKIE, SESSION_S, Guesses, Tokens, session_value, token_scope

__all__ = [
    "COOKIE",
    "OPEN_PATHS",
    "SESSION_S",
    "AuthMiddleware",
    "Guesses",
    "Tokens",
    "TokensError",
    "allowed_hosts",
    "is_loopback",
    "json_error",
    "session_value",
    "token_scope",
]


#: Paths served without authentication.
OPEN_PATHS = frozenset({"/healthz", "/login", "/logout"})
#: Paths the session cookie does not authenticate: a browser sends cookies with cross-site
#: requests, and these have no CSRF check (the bearer header is not sent cross-site).
BEARER_ONLY = ("/v1/", "/metrics")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def allowed_hosts(bound: str, extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The ``Host`` names (without port) a server without tokens answers to.

    ``localhost``, ``127.0.0.1``, ``[::1]``, the bound address and ``extra`` (``--allowed-host``):
    a web page that made its own name resolve to 127.0.0.1 (DNS rebinding) sends its name.
    """
    names = {"localhost", "127.0.0.1", "[::1]", *(_host_name(h) for h in extra)}
    names.add(f"[{bound}]" if ":" in bound else bound.lower())
    return frozenset(names)


def _host_name(host: str) -> str:
    """A ``Host`` header's name, lower case, without its port (``[::1]:8080``: ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() else host


def client_of(scope: Scope) -> str:
    """The client a request comes from, for :class:`Guesses` (``local`` on a unix socket)."""
    client = scope.get("client")
    return str(client[0]) if client else "local"


def too_many(wait: float) -> Response:
    """429: this client failed too many authentications; ``Retry-After`` says until when."""
    return json_error(
        429,
        "too_many_failures",
        "too many failed authentications from this address: retry later",
        {"Retry-After": str(max(1, math.ceil(wait)))},
    )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _cookie(scope: Scope, name: str) -> str | None:
    raw = _header(scope, b"cookie")
    if raw is None:
        return None
    for part in raw.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


class AuthMiddleware:
    """Refuses requests without a valid token (see the module docstring); ASGI middleware.

    Args:
        app: the application it guards.
        tokens: the valid tokens; ``None``: no authentication (every request is authenticated).
        hosts: the ``Host`` names answered (:func:`allowed_hosts`); ``None``: any.
    """

    def __init__(
        self,
        app: ASGIApp,
        tokens: Tokens | None,
        hosts: frozenset[str] | None = None,
        guesses: Guesses | None = None,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.hosts = hosts
        self.guesses = guesses or Guesses()

    def authenticated(self, scope: Scope) -> bool:
        """Whether the request carries a valid bearer token, or a session cookie where it counts.

        A bearer token's :func:`token_scope` goes into ``scope["state"]["token_scope"]``.
        """
        if self.tokens is None:
            return True
        authorization = _header(scope, b"authorization")
        if authorization is not None:
            scheme, _, token = authorization.partition(" ")
            found = self.tokens.matching(token.strip()) if scheme.lower() == "bearer" else None
            if found is not None:
                scope.setdefault("state", {})["token_scope"] = token_scope(found)
            return found is not None
        path = str(scope.get("path", ""))
        if path.startswith(BEARER_ONLY) or path == "/v1":
            return False
        cookie = _cookie(scope, COOKIE)
        return cookie is not None and self.tokens.valid_session(cookie)

    def host_allowed(self, scope: Scope) -> bool:
        """Whether the ``Host`` header names this server (always, with tokens or no header)."""
        host = _header(scope, b"host")
        return self.hosts is None or host is None or _host_name(host) in self.hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Mark the request authenticated or not; pass it on, or refuse it."""
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if not self.host_allowed(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            detail = "this Host is not served (hybridq serve --allowed-host NAME adds one)"
            await json_error(421, "misdirected_request", detail)(scope, receive, send)
            return
        bearer = self.tokens is not None and _header(scope, b"authorization") is not None
        if bearer:
            wait = self.guesses.wait(client_of(scope))
            if wait > 0:
                await _refuse(scope, receive, send, too_many(wait))
                return
        ok = self.authenticated(scope)
        if bearer and not ok:
            self.guesses.failed(client_of(scope))
        scope.setdefault("state", {})["authenticated"] = ok
        if ok or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        await _refuse(scope, receive, send, _refusal(scope))


async def _refuse(scope: Scope, receive: Receive, send: Send, response: Response) -> None:
    """Send ``response`` (a websocket is closed instead: policy violation)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    await response(scope, receive, send)


def _refusal(scope: Scope) -> Response:
    """A browser asking for a page goes to the login form; anything else gets a 401."""
    accept = _header(scope, b"accept") or ""
    path = scope.get("path", "/")
    if scope.get("method") == "GET" and "text/html" in accept and not path.startswith("/v1/"):
        query = urllib.parse.urlencode({"next": path})
        return RedirectResponse(f"{scope.get('root_path', '')}/login?{query}", status_code=303)
    return json_error(
        401,
        "unauthorized",
        "send Authorization: Bearer <token>",
        {"WWW-Authenticate": 'Bearer realm="hybridq"'},
    )


def json_error(status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> Response:
    """A JSON error answer: ``{"error": error, "detail": detail}`` (docs/http.md)."""
    return Response(
        json.dumps({"error": error, "detail": detail}),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
