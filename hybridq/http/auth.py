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

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from hybridq.errors import TokensError
from hybridq.http.body import BodyTimeout, BodyTooLarge, read_body
from hybridq.http.dashboard.templating import render
from hybridq.security.secretfile import read_secret_file

__all__ = [
    "COOKIE",
    "OPEN_PATHS",
    "AuthMiddleware",
    "Guesses",
    "Tokens",
    "TokensError",
    "allowed_hosts",
    "is_loopback",
    "login_routes",
    "session_value",
    "token_scope",
]

log = logging.getLogger("hybridq.http")

#: The session cookie ``POST /login`` sets.
COOKIE = "hybridq_session"
#: Paths served without authentication.
OPEN_PATHS = frozenset({"/healthz", "/login", "/logout"})
#: Longest token accepted (a file of longer lines is refused at start).
MAX_TOKEN = 512
#: Shortest token accepted, and how many different characters it must have at least.
MIN_TOKEN, MIN_DISTINCT = 16, 6
#: Failed authentications (a wrong bearer token, a wrong login) one client may make per window;
#: past them, every request of it that tries a token is answered 429 until the window ends.
MAX_FAILURES, FAILURE_WINDOW_S = 20, 60.0
#: How long a login lasts (the cookie's Max-Age, and checked by the server), seconds.
SESSION_S = 12 * 3600
#: The largest ``POST /login`` body (a token, the ``next`` path and the form's encoding).
LOGIN_BODY = 8 * MAX_TOKEN
#: Seconds a ``POST /login`` body may take to arrive.
LOGIN_TIMEOUT_S = 10.0
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


def _read_tokens(path: Path) -> tuple[bytes, ...]:
    """The tokens in ``path``: one per line; blank lines and ``#`` comments are skipped.

    A token must have at least :data:`MIN_TOKEN` characters, :data:`MIN_DISTINCT` of them
    different (a 2-letter token fell in 442 guesses); a file group or other may read is warned
    about (never refused: a deployment's group may need it).
    """
    try:
        text = read_secret_file(str(path))
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
        if len(line) < MIN_TOKEN or len(set(line)) < MIN_DISTINCT:
            raise TokensError(
                f"tokens file {path}: line {number} is too weak a token (at least {MIN_TOKEN} "
                f"characters, {MIN_DISTINCT} of them different; make one with openssl rand -hex 32)"
            )
        tokens.append(line.encode())
    if not tokens:
        raise TokensError(f"tokens file {path}: no token in it (one per line)")
    return tuple(tokens)


def _session_mac(token: bytes, issued: int) -> str:
    return hmac.new(token, b"hybridq-session-v2:%d" % issued, hashlib.sha256).hexdigest()


def token_scope(token: bytes) -> str:
    """A name for ``token`` that does not reveal it: whose ``Idempotency-Key`` a POST's is."""
    return hashlib.blake2b(token, digest_size=16, person=b"hybridq-keyscope").hexdigest()


def session_value(token: bytes, issued: int | None = None) -> str:
    """The cookie value for a login with ``token`` at ``issued`` (default: now).

    ``<issued>.<HMAC(token, issued)>``: the cookie never holds the token, and the server knows
    when it was issued without keeping any state.
    """
    at = int(time.time()) if issued is None else issued
    return f"{at}.{_session_mac(token, at)}"


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
        #: Cookies ``POST /logout`` cleared, with when they would expire anyway.
        self._revoked: dict[str, float] = {}

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError:
            return (-1, -1, -1)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _current(self) -> tuple[bytes, ...]:
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
                        log.info("tokens file %s read again: %d token(s)", self.path, len(tokens))
                    self._stamp = stamp
        return self._tokens

    def valid_token(self, candidate: str) -> bool:
        """Whether ``candidate`` is one of the tokens (each compared in constant time)."""
        return self.matching(candidate) is not None

    def matching(self, candidate: str) -> bytes | None:
        """The token ``candidate`` is, or ``None`` (every token compared, in constant time)."""
        given = candidate.encode("utf-8", "replace")
        found = None
        for token in self._current():
            if hmac.compare_digest(given, token):  # no early exit: every token is compared
                found = token
        return found

    def valid_session(self, cookie: str, now: float | None = None) -> bool:
        """Whether ``cookie`` is a session value of one of the tokens, not expired nor revoked.

        Only the form :func:`session_value` writes is taken (an issue time of ASCII digits without
        a leading zero): another spelling of the same time (``0<time>``) is not the cookie that
        ``/logout`` revoked, and ``"²".isdigit()`` is true but ``int("²")`` raises.
        """
        issued = _issued(cookie)
        if issued is None or cookie in self._revoked:
            return False
        mac = cookie.partition(".")[2]
        age = (time.time() if now is None else now) - issued
        if not -60 <= age <= SESSION_S:  # a minute of clock skew
            return False
        given = mac.encode("utf-8", "replace")
        ok = False
        for token in self._current():
            ok |= hmac.compare_digest(given, _session_mac(token, issued).encode())
        return ok

    def revoke(self, cookie: str) -> None:
        """Refuse ``cookie`` from now on (``POST /logout``; this process only, until it expires)."""
        now = time.time()
        self._revoked = {c: t for c, t in self._revoked.items() if t > now}  # drop the expired
        issued = _issued(cookie)
        if issued is not None and len(self._revoked) < 100_000:
            self._revoked[cookie] = issued + SESSION_S


def _issued(cookie: str) -> int | None:
    """The issue time of a session cookie in the one form it is written in; ``None``: not that form."""
    text = cookie.partition(".")[0]
    if not (0 < len(text) <= 12 and text.isascii() and text.isdigit()) or text[0] == "0":
        return None
    return int(text)


class Guesses:
    """Failed authentications per client, to stop guessing (:data:`MAX_FAILURES` per window).

    While a client is over the limit no token of it is tried at all, the right one included:
    answering a right guess would leave the guessing unlimited. A client is its address as the
    server sees it (a trusted proxy's ``X-Forwarded-For`` included): clients sharing an address
    share a count.
    """

    def __init__(self, limit: int = MAX_FAILURES, window_s: float = FAILURE_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self._failures: dict[str, tuple[int, float]] = {}

    def wait(self, client: str) -> float:
        """Seconds ``client`` must wait before a token of it is tried again (0: none)."""
        count, since = self._failures.get(client, (0, 0.0))
        left = since + self.window_s - time.monotonic()
        return left if count >= self.limit and left > 0 else 0.0

    def failed(self, client: str) -> None:
        """One more failed authentication of ``client``."""
        now = time.monotonic()
        if len(self._failures) >= 10_000:  # bounded: the expired go first, then everyone
            self._failures = {c: f for c, f in self._failures.items() if f[1] + self.window_s > now}
            if len(self._failures) >= 10_000:
                self._failures.clear()
        count, since = self._failures.get(client, (0, now))
        if since + self.window_s <= now:
            count, since = 0, now
        self._failures[client] = (count + 1, since)
        if count + 1 == self.limit:
            log.warning(
                "%d failed authentications from %s within %g s: its tokens are not tried until then",
                self.limit,
                client,
                self.window_s,
            )


def client_of(scope: Scope) -> str:
    """The client a request comes from, for :class:`Guesses` (``local`` on a unix socket)."""
    client = scope.get("client")
    return str(client[0]) if client else "local"


def too_many(wait: float) -> Response:
    """429: this client failed too many authentications; ``Retry-After`` says until when."""
    return _json(
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
            await _json(421, "misdirected_request", detail)(scope, receive, send)
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
    return _json(
        401,
        "unauthorized",
        "send Authorization: Bearer <token>",
        {"WWW-Authenticate": 'Bearer realm="hybridq"'},
    )


def _json(status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps({"error": error, "detail": detail}),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


# -- the login form -------------------------------------------------------------------------------

_STYLE = "body { font-family: sans-serif; max-width: 24rem; margin: 4rem auto }"
#: The login form's headers: those of the dashboard's pages (no script, no frame: clickjacking
#: the token field), its one stylesheet allowed by its hash.
LOGIN_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'sha256-"
        + base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()
        + "'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _safe_next(value: str | None) -> str:
    """A local path to go to after logging in (never another site: ``//host`` or a scheme)."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    return value


def login_routes(tokens: Tokens | None, guesses: Guesses | None = None) -> list[BaseRoute]:
    """``GET /login`` (the form), ``POST /login`` (sets the cookie), ``POST /logout``.

    ``guesses``: the failed authentications the API's bearer tokens count too (one per client).
    """
    guesses = guesses or Guesses()

    def form(request: Request, error: str = "", status: int = 200) -> HTMLResponse:
        return HTMLResponse(
            render(  # the style is a constant: its hash is in the CSP, and escaping leaves it as is
                "login.html",
                style=_STYLE,
                error=error,
                action=f"{request.scope.get('root_path', '')}/login",
                next=_safe_next(request.query_params.get("next")),
            ),
            status_code=status,
            headers=LOGIN_HEADERS,
        )

    async def show(request: Request) -> Response:
        return form(request)

    async def login(request: Request) -> Response:
        wait = guesses.wait(client_of(request.scope)) if tokens is not None else 0.0
        if wait > 0:
            return form(request, "Too many failed logins from this address: try again later.", 429)
        try:  # capped and streamed: an unauthenticated client must not make the server buffer
            body = await read_body(request, LOGIN_BODY, LOGIN_TIMEOUT_S)
        except BodyTooLarge:
            return _json(413, "too_large", f"a login body is at most {LOGIN_BODY} bytes")
        except BodyTimeout:
            return _json(408, "timeout", "the body did not arrive in time")
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        fields = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
        token = (fields.get("token") or [""])[0].strip()
        target = request.scope.get("root_path", "") + _safe_next((fields.get("next") or ["/"])[0])
        if tokens is None:
            return RedirectResponse(target, status_code=303)  # nothing to log in to
        if not tokens.valid_token(token):
            log.warning("a login with a wrong token from %s", request.client.host if request.client else "?")
            guesses.failed(client_of(request.scope))
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
        cookie = request.cookies.get(COOKIE)
        if tokens is not None and cookie is not None and tokens.valid_session(cookie):
            tokens.revoke(cookie)  # only a live session: /logout is open, junk must not pile up
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/login", status_code=303)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return response

    return [
        Route("/login", show, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
    ]
