"""The ASGI application of ``hybridq serve``: the API, the login form and the dashboard.

:func:`create_app` puts together, behind :class:`~hybridq.http.auth.AuthMiddleware`:

* the API (:mod:`hybridq.http.api`) under ``/v1``, ``/metrics`` and ``/healthz``;
* ``GET /v1/openapi.json`` (:mod:`hybridq.http.openapi`);
* ``GET``/``POST /login`` and ``POST /logout`` (:func:`hybridq.http.login.login_routes`);
* the dashboard's routes (:func:`hybridq.http.dashboard.routes`), mounted last, under ``/``.

``app.state.config`` is the :class:`ServeConfig`, ``app.state.api`` the :class:`Api` (its
``journal``, its ``keys``); every request's ``request.state.authenticated`` is set by the
middleware (see :mod:`hybridq.http.auth`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from hybridq import __version__
from hybridq.http import dashboard
from hybridq.http.api import Api
from hybridq.http.auth import AuthMiddleware, Guesses, Tokens, allowed_hosts
from hybridq.http.config import ServeConfig
from hybridq.http.login import login_routes
from hybridq.http.openapi import document

__all__ = ["create_app"]


def create_app(config: ServeConfig, *, registry: CollectorRegistry | None = None) -> Starlette:
    """The application for ``config``.

    Args:
        config: the server's settings.
        registry: what ``/metrics`` serves besides the server's own counters (the forwarder's,
            with ``hybridq forward --serve``); ``None``: the journal's figures.

    Raises:
        TokensError: ``config.tokens_file`` cannot be read or holds no token.
    """
    tokens = Tokens(config.tokens_file) if config.tokens_file is not None else None
    guesses = Guesses()  # failed authentications per client: the API's and the login form's
    api = Api(config, registry)
    hosts = allowed_hosts(config.host, config.allowed_hosts) if tokens is None else None
    spec = document(__version__)

    async def openapi(request: Request) -> JSONResponse:
        del request
        return JSONResponse(spec)

    app = Starlette(
        routes=[
            *api.routes(),
            Route("/v1/openapi.json", openapi, methods=["GET"]),
            *login_routes(tokens, guesses),
            *dashboard.routes(config),
        ],
        # Without tokens, only this machine's names: a page whose name resolves here (DNS
        # rebinding) must not reach the API. With tokens, the token is the check.
        middleware=[Middleware(AuthMiddleware, tokens=tokens, hosts=hosts, guesses=guesses)],
    )
    app.state.config = config
    app.state.api = api
    return app
