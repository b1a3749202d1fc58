"""An ASGI app served by uvicorn on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn

__all__ = ["Reply", "request", "serving"]


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 (a free port); yields its base URL; stops it after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    cookies: dict[str, str]
    body: str


def request(
    url: str,
    method: str = "GET",
    *,
    body: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """One HTTP request over a real socket (no redirect followed)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    data = urllib.parse.urlencode(body).encode() if body is not None else None
    all_headers = dict(headers or {})
    if data is not None:
        all_headers.setdefault("Content-Type", "application/x-www-form-urlencoded")
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), data, all_headers)
        resp = conn.getresponse()
        text = resp.read().decode()
        cookies = {}
        for name, value in resp.getheaders():
            if name.lower() == "set-cookie":
                key, _, rest = value.partition("=")
                cookies[key] = rest.split(";", 1)[0]
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, cookies, text)
    finally:
        conn.close()
