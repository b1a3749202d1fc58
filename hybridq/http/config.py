"""What one ``hybridq serve`` process is started with (docs/http.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    """The settings of one HTTP server over one journal directory.

    Attributes:
        journal: The journal directory jobs are appended to (and read back from).
        redis_url: The Redis the forwarder pushes to, for the parts of a job's trace only Redis
            holds (claims, redeliveries); None where the server runs without one.
        host: The address the server binds.
        port: The port the server binds (0: a free one).
        unix_path: A unix socket to listen on instead of ``host:port`` (``--bind unix:PATH``,
            mode 0660: its file permissions and directory decide who may connect).
        tokens_file: A file of bearer tokens, one per line (several: rotation); None means no
            authentication, which only a loopback bind allows.
        allow: Dotted prefixes of task paths a POST may name besides registered tasks.
        max_body: The largest request body accepted, in bytes (larger: 413).
        capacity: The most pending jobs (accepted, not yet terminal) the journal may hold; a POST
            over it is answered 429 with ``Retry-After``. None: no limit.
        retry_after_s: The ``Retry-After`` a 429 or a 503 answers with, in seconds.
        forwarded_allow_ips: The proxies whose ``X-Forwarded-For``/``-Proto`` headers are trusted
            (uvicorn's ``forwarded_allow_ips``: comma-separated addresses, or ``*``).
        access_log: Log one line per request (method, path, status: never a header).
        allowed_hosts: Host names accepted in the ``Host`` header besides the bound address,
            ``localhost``, ``127.0.0.1`` and ``[::1]`` when the server runs without tokens (a
            proxy's name); with tokens the ``Host`` header is not checked.
        body_timeout_s: The longest a request body may take to arrive (slower: 408).
        limit_concurrency: The most connections and requests served at once (uvicorn's
            ``limit_concurrency``; more: 503).
        keep_alive_s: How long an idle keep-alive connection is kept open, in seconds.
        header_timeout_s: How long a connection may take to send a request's headers, from its
            opening or its previous response (slower: closed; :mod:`hybridq.http.connections`).
        client_connections: The most connections of one client address (more: the client's
            oldest idle one is closed, or the new one refused).
        peers: Look other ingest nodes' jobs up through ``redis_url``, and answer theirs
            (:mod:`hybridq.http.peers`): set by ``hybridq serve --redis`` and ``forward --serve``.
    """

    journal: Path
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    unix_path: Path | None = None
    tokens_file: Path | None = None
    allow: tuple[str, ...] = field(default_factory=tuple)
    max_body: int = 1 << 20
    capacity: int | None = None
    retry_after_s: int = 1
    forwarded_allow_ips: str = "127.0.0.1"
    access_log: bool = True
    allowed_hosts: tuple[str, ...] = field(default_factory=tuple)
    body_timeout_s: float = 10.0
    limit_concurrency: int = 1000
    keep_alive_s: int = 5
    header_timeout_s: float = 10.0
    client_connections: int = 100
    peers: bool = False
