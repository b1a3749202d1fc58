"""Real HTTP for the ``hybridq serve`` tests: a client over a socket, the server in a thread or a
child process (``hybridq serve``, its address read from the line it prints)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridq.http.app import create_app
from hybridq.http.config import ServeConfig
from hybridq.http.server import Server

__all__ = ["Answer", "ServeProcess", "UnixHTTPConnection", "request", "served"]


class Answer:
    """One HTTP response: status, headers (lower-case names), body (JSON when it is JSON)."""

    def __init__(self, status: int, headers: dict[str, str], raw: bytes) -> None:
        self.status, self.headers, self.raw = status, headers, raw
        try:
            self.json: Any = json.loads(raw)
        except ValueError:
            self.json = None

    def __repr__(self) -> str:
        return f"<Answer {self.status} {self.raw[:300]!r}>"


def request(
    base: str,
    method: str,
    path: str,
    body: Any = None,
    headers: Mapping[str, str] | None = None,
    *,
    timeout: float = 30.0,
    conn: http.client.HTTPConnection | None = None,
) -> Answer:
    """One request to ``base`` (``http://host:port``); ``body``: bytes as they are, else JSON."""
    url = urllib.parse.urlsplit(base)
    own = conn is None
    c = conn or http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = dict(headers or {})
    if data is not None and not any(k.lower() == "content-type" for k in headers):
        headers["Content-Type"] = "application/json"  # what POST /v1/jobs requires (docs/http.md)
    try:
        c.request(method, path, body=data, headers=headers)
        resp = c.getresponse()
        raw = resp.read()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, raw)
    finally:
        if own:
            c.close()


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the unix socket at ``path`` (``hybridq serve --bind unix:PATH``); Host: localhost."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


@contextmanager
def served(config: ServeConfig) -> Iterator[str]:
    """The application for ``config`` served in a thread of this process; yields its base URL."""
    server = Server(create_app(config), config, access_log=False)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


class ServeProcess:
    """``python -m hybridq serve --journal J --bind 127.0.0.1:0 [args...]`` as a child process."""

    def __init__(
        self, journal: Path, *args: str, env: Mapping[str, str], log_path: Path, cwd: Path | None = None
    ) -> None:
        self.log_path = log_path
        command = [sys.executable, "-m", "hybridq", "serve", "--journal", str(journal)]
        if "--bind" not in args:
            command += ["--bind", "127.0.0.1:0"]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*command, *args],
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("listening on "):
            self.kill()
            raise AssertionError(f"hybridq serve did not start: {line!r}\n{self.log()[-3000:]}")
        self.url = line.split()[-1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        rc = self.proc.wait()
        self._close()
        return rc

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
