"""Bearer tokens for ``hybridq serve``, and the login cookie browsers use instead (docs/http.md).

The contract the other parts of the server (the dashboard) rely on:

* :class:`AuthMiddleware` runs before every route. It sets ``request.state.authenticated``
  (``scope["state"]["authenticated"]``) to ``True`` when the request carries a valid token, as
  ``Authorization: Bearer <token>`` or as the session cookie :data:`COOKIE` that ``POST /login``
  sets, and always when the server runs without a tokens file (a loopback bind only). Every path
  but :data:`OPEN_PATHS` (``/healthz``, ``/login``, ``/logout``) is refused unless authenticated:
  ``401`` with a JSON error for API clients, a ``303`` to ``/login?next=...`` for a browser's
  ``GET`` of an HTML page. A route therefore never sees an unauthenticated request.
* The cookie holds no token: it is an HMAC of one (:func:`session_value`), so a token removed
  from the file ends its sessions too. It is ``HttpOnly``, ``SameSite=Strict``, ``Path=/``, and
  ``Secure`` when the request came over HTTPS (directly or through a trusted proxy).

Tokens are compared with :func:`hmac.compare_digest` and never logged. The file is read again
when its size or modification time changes (rotation: add the new token, move clients over,
remove the old one).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import json
import logging
import os
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

__all__ = [
    "COOKIE",
    "OPEN_PATHS",
    "AuthMiddleware",
    "Tokens",
    "TokensError",
    "is_loopback",
    "login_routes",
    "session_value",
]

log = logging.getLogger("hybridq.http")

#: The session cookie ``POST /login`` sets.
COOKIE = "hybridq_session"
#: Paths served without authentication.
OPEN_PATHS = frozenset({"/healthz", "/login", "/logout"})
#: Longest token accepted (a file of longer lines is refused at start).
MAX_TOKEN = 512
#: How long a login lasts (the cookie's Max-Age), seconds.
SESSION_S = 12 * 3600

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class TokensError(ValueError):
    """A tokens file that cannot be used (missing, unreadable, empty, a bad line)."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def _read_tokens(path: Path) -> tuple[bytes, ...]:
    """The tokens in ``path``: one per line; blank lines and ``#`` comments are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokensError(f"tokens file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TokensError(f"tokens file {path}: not UTF-8 text") from None
    tokens = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) > MAX_TOKEN or not line.isascii() or not line.isprintable() or " " in line:
            raise TokensError(
                f"tokens file {path}: line {number} is not a token (printable ASCII, no spaces)"
            )
        tokens.append(line.encode())
    if not tokens:
        raise TokensError(f"tokens file {path}: no token in it (one per line)")
    return tuple(tokens)


def session_value(token: bytes) -> str:
    """The cookie value for a login with ``token`` (an HMAC of it: the cookie never holds it)."""
    return hmac.new(token, b"hybridq-session-v1", hashlib.sha256).hexdigest()


class Tokens:
    """The valid tokens, from a file read again when it changes.

    Args:
        path: the tokens file (one token per line).

    Raises:
        TokensError: the file cannot be read or holds no token (at start only: a later bad read
            keeps the tokens read before, and is logged).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._tokens = _read_tokens(path)
        self._sessions = tuple(session_value(t).encode() for t in self._tokens)

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError:
            return (-1, -1, -1)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _current(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        stamp = self._stat()
        if stamp != self._stamp:
            with self._lock:
                if stamp != self._stamp:
                    try:
                        tokens = _read_tokens(self.path)
                    except TokensError as exc:
                        log.warning("%s; keeping the tokens read before", exc)
                    else:
                        self._tokens = tokens
                        self._sessions = tuple(session_value(t).encode() for t in tokens)
                        log.info("tokens file %s read again: %d token(s)", self.path, len(tokens))
                    self._stamp = stamp
        return self._tokens, self._sessions

    def valid_token(self, candidate: str) -> bool:
        """Whether ``candidate`` is one of the tokens (each compared in constant time)."""
        given = candidate.encode("utf-8", "replace")
        ok = False
        for token in self._current()[0]:
            ok |= hmac.compare_digest(given, token)  # no early exit: every token is compared
        return ok

    def valid_session(self, cookie: str) -> bool:
        """Whether ``cookie`` is the session value of one of the tokens."""
        given = cookie.encode("utf-8", "replace")
        ok = False
        for value in self._current()[1]:
            ok |= hmac.compare_digest(given, value)
        return ok


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
    """

    def __init__(self, app: ASGIApp, tokens: Tokens | None) -> None:
        self.app = app
        self.tokens = tokens

    def authenticated(self, scope: Scope) -> bool:
        """Whether the request carries a valid bearer token or session cookie."""
        if self.tokens is None:
            return True
        authorization = _header(scope, b"authorization")
        if authorization is not None:
            scheme, _, token = authorization.partition(" ")
            return scheme.lower() == "bearer" and self.tokens.valid_token(token.strip())
        cookie = _cookie(scope, COOKIE)
        return cookie is not None and self.tokens.valid_session(cookie)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Mark the request authenticated or not; pass it on, or refuse it."""
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        ok = self.authenticated(scope)
        scope.setdefault("state", {})["authenticated"] = ok
        if ok or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        await _refusal(scope)(scope, receive, send)


def _refusal(scope: Scope) -> Response:
    """A browser asking for a page goes to the login form; anything else gets a 401."""
    accept = _header(scope, b"accept") or ""
    path = scope.get("path", "/")
    if scope.get("method") == "GET" and "text/html" in accept and not path.startswith("/v1/"):
        query = urllib.parse.urlencode({"next": path})
        return RedirectResponse(f"{scope.get('root_path', '')}/login?{query}", status_code=303)
    return Response(
        json.dumps({"error": "unauthorized", "detail": "send Authorization: Bearer <token>"}),
        status_code=401,
        media_type="application/json",
        headers={"WWW-Authenticate": 'Bearer realm="hybridq"'},
    )


# -- the login form -------------------------------------------------------------------------------

_FORM = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hybridq: log in</title>
<meta name="viewport" content="width=device-width, initial-scale=1"></head>
<body style="font-family: sans-serif; max-width: 24rem; margin: 4rem auto">
<h1>hybridq</h1>{error}
<form method="post" action="{action}">
<input type="hidden" name="next" value="{next}">
<label>Token <input type="password" name="token" autocomplete="current-password" autofocus required></label>
<button type="submit">Log in</button>
</form></body></html>
"""


def _safe_next(value: str | None) -> str:
    """A local path to go to after logging in (never another site: ``//host`` or a scheme)."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    return value


def login_routes(tokens: Tokens | None) -> list[BaseRoute]:
    """``GET /login`` (the form), ``POST /login`` (sets the cookie), ``POST /logout``."""

    def form(request: Request, error: str = "", status: int = 200) -> HTMLResponse:
        return HTMLResponse(
            _FORM.format(
                error=f'<p role="alert">{html.escape(error)}</p>' if error else "",
                action=html.escape(f"{request.scope.get('root_path', '')}/login"),
                next=html.escape(_safe_next(request.query_params.get("next"))),
            ),
            status_code=status,
        )

    async def show(request: Request) -> Response:
        return form(request)

    async def login(request: Request) -> Response:
        body = await request.body()
        if len(body) > 4 * MAX_TOKEN:
            return form(request, "That is not a token.", 400)
        fields = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
        token = (fields.get("token") or [""])[0].strip()
        target = request.scope.get("root_path", "") + _safe_next((fields.get("next") or ["/"])[0])
        if tokens is None:
            return RedirectResponse(target, status_code=303)  # nothing to log in to
        if not tokens.valid_token(token):
            log.warning("a login with a wrong token from %s", request.client.host if request.client else "?")
            return form(request, "Wrong token.", 401)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE,
            session_value(token.encode()),
            max_age=SESSION_S,
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(request: Request) -> Response:
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/login", status_code=303)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return response

    return [
        Route("/login", show, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
    ]
