"""``hybridq serve``: the HTTP API (and the dashboard) over one journal (docs/http.md).

The options shared with ``hybridq forward --serve`` (the bind, the tokens file) and the checks
made before anything starts are here too (:func:`serve_config`).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hybridq.cli.options import _fail, journal_option
from hybridq.errors import HybridqError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from hybridq.http.config import ServeConfig
    from hybridq.http.server import Server

__all__ = ["parse_bind", "serve", "serve_config"]

log = logging.getLogger("hybridq")

#: The longest path a unix socket may have, with its terminating NUL (Linux's ``sun_path``).
UNIX_PATH_MAX = 108


def parse_bind(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6; port 0: a free one) as (host, port).

    Raises:
        ValueError: not of that form.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--bind {value!r}: give HOST:PORT, e.g. 127.0.0.1:8080 ([::1]:8080 for IPv6)")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or (":" in host and not value.startswith("[")):
        raise ValueError(f"--bind {value!r}: give HOST:PORT, e.g. 127.0.0.1:8080 ([::1]:8080 for IPv6)")
    return host, int(port)


def check_unix_path(path: str) -> None:
    """Raise ValueError unless ``path`` can name a unix socket (absolute, under 108 bytes)."""
    if not os.path.isabs(path) or len(os.fsencode(path)) >= UNIX_PATH_MAX:
        raise ValueError(
            f"--bind unix:{path}: give an absolute path under {UNIX_PATH_MAX} bytes, e.g. "
            "unix:/run/hybridq/api.sock"
        )


def serve_config(
    ctx: click.Context,
    *,
    journal: str,
    bind: str,
    tokens_file: str | None,
    allow: tuple[str, ...] = (),
    redis_url: str | None = None,
    capacity: int | None = None,
    max_body: int = 1 << 20,
    forwarded_allow_ips: str = "127.0.0.1",
    imports: tuple[str, ...] = (),
    allowed_hosts: tuple[str, ...] = (),
    limit_concurrency: int = 1000,
    client_connections: int = 100,
) -> ServeConfig:
    """The server's checked settings (a ``ServeConfig``); bad input is one line and exit 1."""
    from hybridq.http.auth import Tokens, TokensError, is_loopback  # noqa: PLC0415 - keep --help fast
    from hybridq.http.config import ServeConfig  # noqa: PLC0415
    from hybridq.journal.paths import ensure_journal_dir  # noqa: PLC0415
    from hybridq.security.signing import keyring  # noqa: PLC0415
    from hybridq.transport.redisurl import check_url  # noqa: PLC0415

    unix = bind.removeprefix("unix:") if bind.startswith("unix:") else None
    try:
        host, port = ("localhost", 0) if unix is not None else parse_bind(bind)
        if unix is not None:
            check_unix_path(unix)
        if redis_url is not None:
            check_url(redis_url)  # a malformed URL is one line now, not at the first page
    except ValueError as exc:
        _fail(ctx, exc)
    if tokens_file is None and unix is None and not is_loopback(host):
        _fail(ctx, ValueError(f"--bind {bind} is not a loopback address: give --tokens-file (docs/http.md)"))
    if tokens_file is not None:
        try:
            Tokens(Path(tokens_file))  # unreadable or empty: now, before anything is created
        except TokensError as exc:
            _fail(ctx, exc)
    if os.getcwd() not in sys.path:  # like `hybridq worker --import`: modules here import
        sys.path.append(os.getcwd())
    for module in imports:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            _fail(ctx, exc)
    try:
        path = ensure_journal_dir(journal)
        keyring()  # a signing key configured but unusable: now, not at every POST
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    return ServeConfig(
        journal=Path(path),
        redis_url=redis_url,
        host=host,
        port=port,
        unix_path=Path(unix) if unix is not None else None,
        tokens_file=Path(tokens_file) if tokens_file is not None else None,
        allow=allow,
        max_body=max_body,
        capacity=capacity,
        forwarded_allow_ips=forwarded_allow_ips,
        allowed_hosts=allowed_hosts,
        limit_concurrency=limit_concurrency,
        client_connections=client_connections,
        peers=redis_url is not None,  # the nodes sharing this Redis look each other's jobs up
    )


def start_server(
    ctx: click.Context, config: ServeConfig, registry: CollectorRegistry | None = None
) -> Server:
    """The app built and its socket bound (a ``Server``); the address is printed on stdout."""
    from hybridq.http.app import create_app  # noqa: PLC0415
    from hybridq.http.auth import TokensError  # noqa: PLC0415
    from hybridq.http.server import Server  # noqa: PLC0415

    try:
        app = create_app(config, registry=registry)
        server = Server(app, config)
    except (TokensError, HybridqError, OSError) as exc:
        _fail(ctx, exc)
    # The one line on stdout (tests and scripts read the port from it), also logged.
    click.echo(f"listening on {server.url}")
    sys.stdout.flush()
    log.info("serving %s on %s", config.journal, server.url)
    if config.tokens_file is None and config.unix_path is None:
        log.warning(
            "serving without --tokens-file: every user and process of this host can read jobs and "
            "enqueue them at %s; give --tokens-file, or --bind unix:PATH (docs/http.md)",
            server.url,
        )
    return server


tokens_option = click.option(
    "--tokens-file",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="HYBRIDQ_TOKENS_FILE",
    show_envvar=True,
    help="Bearer tokens, one per line (several: rotation; read again when it changes). Required "
    "unless --bind is a loopback address.",
)


@click.command()
@journal_option
@click.option(
    "--bind",
    default="127.0.0.1:8080",
    show_default=True,
    metavar="HOST:PORT",
    help="The address to listen on (port 0: a free one, printed at start), or unix:PATH (a unix "
    "socket, mode 0660: its owner and group may connect).",
)
@tokens_option
@click.option(
    "--allow",
    multiple=True,
    metavar="PREFIX",
    help="Accept tasks under this dotted prefix besides registered ones (repeatable; "
    "$HYBRIDQ_ALLOW's prefixes are accepted too).",
)
@click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="Import this module at start (repeatable): its @hybridq.task functions are accepted.",
)
@click.option(
    "--redis",
    "redis_url",
    envvar="HYBRIDQ_REDIS_URL",
    show_envvar=True,
    default=None,
    help="The forwarder's Redis, for what only Redis knows (stats' redis key, the dashboard), and to "
    "look other ingest nodes' jobs up (docs/http.md).",
)
@click.option(
    "--capacity",
    type=click.IntRange(1, None),
    default=None,
    help="The most pending jobs the journal may hold; a POST over it gets 429 with Retry-After.",
)
@click.option(
    "--max-body",
    type=click.IntRange(1, 64 << 20),
    default=1 << 20,
    show_default=True,
    help="The largest request body, in bytes (larger: 413).",
)
@click.option(
    "--forwarded-allow-ips",
    default="127.0.0.1",
    show_default=True,
    help="Proxies whose X-Forwarded-For/-Proto headers are trusted (comma-separated, or *).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="Without --tokens-file, also answer requests whose Host header is NAME (a proxy's name; "
    "repeatable). Other than localhost, 127.0.0.1, [::1] and the bind address: 421.",
)
@click.option(
    "--limit-concurrency",
    type=click.IntRange(1, None),
    default=1000,
    show_default=True,
    metavar="N",
    help="The most connections served at once; the oldest idle one makes room for a new one, else 503.",
)
@click.option(
    "--client-connections",
    type=click.IntRange(1, None),
    default=100,
    show_default=True,
    metavar="N",
    help="The most connections of one client address (raise it behind a busy proxy).",
)
@click.pass_context
def serve(
    ctx: click.Context,
    journal: str,
    bind: str,
    tokens_file: str | None,
    allow: tuple[str, ...],
    imports: tuple[str, ...],
    redis_url: str | None,
    capacity: int | None,
    max_body: int,
    forwarded_allow_ips: str,
    allowed_hosts: tuple[str, ...],
    limit_concurrency: int,
    client_connections: int,
) -> None:
    """Serve the HTTP API (and the dashboard) for one journal, until SIGTERM or SIGINT.

    POST /v1/jobs enqueues (202 once durable), GET /v1/jobs/{id} reports a job from durable
    state, GET /v1/stats, /metrics, /healthz; /v1/openapi.json describes them (docs/http.md).
    Run it alongside `hybridq forward` on the same journal (or use `hybridq forward --serve`).

    \b
    Example:
      hybridq serve --journal /var/lib/hybridq/journal --bind 127.0.0.1:8080 --allow myapp.tasks
      hybridq serve --journal /var/lib/hybridq/journal --bind 0.0.0.0:8080 \\
          --tokens-file /etc/hybridq/tokens --import myapp.tasks
    """
    config = serve_config(
        ctx,
        journal=journal,
        bind=bind,
        tokens_file=tokens_file,
        allow=allow,
        redis_url=redis_url,
        capacity=capacity,
        max_body=max_body,
        forwarded_allow_ips=forwarded_allow_ips,
        imports=imports,
        allowed_hosts=allowed_hosts,
        limit_concurrency=limit_concurrency,
        client_connections=client_connections,
    )
    server = start_server(ctx, config)
    server.run()
    log.info("stopped")
