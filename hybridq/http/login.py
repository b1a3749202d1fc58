"""The login form of ``hybridq serve``: ``GET``/``POST /login`` and ``POST /logout`` (docs/http.md).

A browser logs in once with a token and gets the session cookie :data:`~hybridq.http.tokens.COOKIE`
(:func:`~hybridq.http.tokens.session_value`: never the token itself), which
:class:`~hybridq.http.auth.AuthMiddleware` then takes for the dashboard's routes.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import urllib.parse

from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from hybridq.http.auth import client_of, json_error
from hybridq.http.body import BodyTimeout, BodyTooLarge, read_body
from hybridq.http.dashboard.templating import render
from hybridq.http.tokens import COOKIE, MAX_TOKEN, SESSION_S, Guesses, Tokens, session_value

__all__ = ["login_routes"]

log = logging.getLogger("hybridq.http")

#: The largest ``POST /login`` body (a token, the ``next`` path and the form's encoding).
LOGIN_BODY = 8 * MAX_TOKEN
#: Seconds a ``POST /login`` body may take to arrive.
LOGIN_TIMEOUT_S = 10.0

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
            return json_error(413, "too_large", f"a login body is at most {LOGIN_BODY} bytes")
        except BodyTimeout:
            return json_error(408, "timeout", "the body did not arrive in time")
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
