"""Idle, half-sent and piled-up connections against ``hybridq serve`` (issue 27, MEDIUM 4).

uvicorn had no deadline before a request's headers were complete, and counted idle connections
against ``--limit-concurrency``: 1,000 idle or half-sent connections, no token needed, gave every
client 503 for as long as they were held. Real sockets, the server in a thread of this process;
the attacker's connections come from ``127.0.0.2`` (Linux routes all of ``127.0.0.0/8`` to the
loopback device) unless the test says otherwise.
"""

from __future__ import annotations

import select
import socket
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from hybridq.http.config import ServeConfig

from tests.support.http import request, served
from tests.unit.test_http_api import config


def _open(base: str, count: int, source: str, head: bytes = b"") -> list[socket.socket]:
    """``count`` connections from ``source``, each having sent ``head`` (nothing: idle)."""
    url = urllib.parse.urlsplit(base)
    out = []
    for _ in range(count):
        sock = socket.create_connection((url.hostname, url.port), timeout=10, source_address=(source, 0))
        if head:
            sock.sendall(head)
        out.append(sock)
    return out


def _closed(sock: socket.socket, within: float) -> bool:
    """Whether the server closed ``sock`` within ``within`` seconds (whatever it sent first)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if select.select([sock], [], [], max(0.0, end - time.monotonic()))[0]:
            try:
                if not sock.recv(65536):
                    return True
            except ConnectionResetError:
                return True
    return False


@contextmanager
def _held(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    with ExitStack() as stack:
        for sock in socks:
            stack.callback(sock.close)
        yield socks


def _served_promptly(base: str, times: int = 5) -> list[int]:
    return [request(base, "GET", "/healthz", timeout=5).status for _ in range(times)]


def test_idle_connections_from_another_address_do_not_shut_other_clients_out(journal_dir: Path) -> None:
    cfg: ServeConfig = config(journal_dir, limit_concurrency=50)
    with served(cfg) as base, _held(_open(base, 200, "127.0.0.2")):
        time.sleep(0.5)  # the server has seen them all
        assert _served_promptly(base) == [200] * 5  # before: 503 while they were held


def test_idle_connections_from_the_same_address_do_not_shut_a_prompt_client_out(journal_dir: Path) -> None:
    """One address for everyone (a shared host, or a proxy): the oldest idle connection makes room."""
    cfg: ServeConfig = config(journal_dir, limit_concurrency=50)
    with served(cfg) as base, _held(_open(base, 200, "127.0.0.1")):
        time.sleep(0.5)
        assert _served_promptly(base) == [200] * 5


def test_half_sent_headers_are_closed_after_the_header_timeout(journal_dir: Path) -> None:
    cfg: ServeConfig = config(journal_dir, header_timeout_s=1.0)
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never finished
    with served(cfg) as base, _held(_open(base, 3, "127.0.0.2", head) + _open(base, 3, "127.0.0.2")) as socks:
        started = time.monotonic()
        assert all(_closed(sock, 5.0) for sock in socks)
        assert time.monotonic() - started < 4.0
        assert _served_promptly(base, 1) == [200]


def test_a_keep_alive_connection_gets_the_same_deadline_for_its_next_request(journal_dir: Path) -> None:
    cfg: ServeConfig = config(journal_dir, header_timeout_s=1.0, keep_alive_s=30)
    with served(cfg) as base, _held(_open(base, 1, "127.0.0.2")) as (sock,):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the next request, half sent
        assert _closed(sock, 5.0)


def test_one_address_holds_at_most_its_share_of_requests_in_flight(journal_dir: Path) -> None:
    """Slow login bodies (no token needed) from one address: at most ``client_connections``."""
    cfg: ServeConfig = config(journal_dir, limit_concurrency=60, client_connections=10)
    head = (
        b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ntoken="
    )
    with served(cfg) as base, _held(_open(base, 40, "127.0.0.2", head)) as socks:
        time.sleep(0.5)
        still_open = [s for s in socks if not _closed(s, 0.05)]
        assert len(still_open) <= 10, len(still_open)
        assert _served_promptly(base) == [200] * 5  # from 127.0.0.1
