"""``hybridq serve --bind unix:PATH``, and the warning of a server without tokens (issue 27, MEDIUM 3).

The documented token-less setups (``forward --serve 127.0.0.1:8080``, the README's ``serve``)
opened the journal's jobs to every local user: the dashboard showed job arguments to uid 65534,
and ``POST /v1/jobs`` answered 202. A unix socket's file permissions keep other users out; a
loopback bind without tokens says so at start.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hybridq.http.config import ServeConfig
from hybridq.http.server import Server, bind_unix

from tests.support.http import Answer, ServeProcess, UnixHTTPConnection, request, served
from tests.unit.test_http_api import ADD, config, job_ids

NOBODY = 65534


@pytest.fixture
def socket_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory every user may enter (0755): only the socket file's own mode keeps anyone out."""
    path = tmp_path_factory.mktemp("sock")
    path.chmod(0o755)
    for parent in path.parents:  # pytest's base directories are 0700
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | 0o055)
    return path


def _ask(path: Path, method: str = "GET", url: str = "/healthz", body: object = None) -> Answer:
    conn = UnixHTTPConnection(str(path))
    try:
        return request("http://localhost", method, url, body, conn=conn)
    finally:
        conn.close()


def _get(path: Path, url: str = "/healthz") -> int:
    return _ask(path, "GET", url).status


def _connects_as_nobody(path: Path) -> str:
    """``connected`` or ``refused``: a connect to ``path`` by uid 65534 (a forked child)."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no exceptions out of here
        code = 3
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            probe = socket.socket(socket.AF_UNIX)
            try:
                probe.connect(str(path))
                code = 0
            except PermissionError:
                code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "connected", 1: "refused"}.get(os.waitstatus_to_exitcode(status), "error")


def test_a_unix_socket_serves_with_mode_0660_and_goes_away_at_stop(
    journal_dir: Path, socket_dir: Path
) -> None:
    sock = socket_dir / "api.sock"
    cfg: ServeConfig = config(journal_dir, unix_path=sock)
    with served(cfg) as url:
        assert url == f"unix:{sock}"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        assert _get(sock) == 200
        answer = _ask(sock, "POST", "/v1/jobs", ADD)
        assert answer.status == 202, answer
    assert not sock.exists()
    assert len(job_ids(journal_dir)) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to connect as another user")
def test_another_user_cannot_connect_to_the_unix_socket(journal_dir: Path, socket_dir: Path) -> None:
    sock = socket_dir / "api.sock"
    with served(config(journal_dir, unix_path=sock)):
        assert _connects_as_nobody(sock) == "refused"
        sock.chmod(0o666)  # what the mode alone decides: with it open, the same user connects
        assert _connects_as_nobody(sock) == "connected"
        assert _get(sock) == 200


def test_a_stale_socket_is_replaced_and_anything_else_is_not(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(stale))
    left.close()  # a server that is gone left its file
    bind_unix(str(stale)).close()
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "live.sock"))
    live.listen()
    try:
        with pytest.raises(OSError, match="another server is listening"):
            bind_unix(str(tmp_path / "live.sock"))
    finally:
        live.close()
    (tmp_path / "file").write_text("precious")
    with pytest.raises(OSError, match="not a socket"):
        bind_unix(str(tmp_path / "file"))
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with pytest.raises(OSError, match="not a socket"):
        bind_unix(str(tmp_path / "link"))
    assert (tmp_path / "file").read_text() == "precious"


def test_serve_over_a_unix_socket_from_the_command_line(
    journal_dir: Path, socket_dir: Path, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    sock = socket_dir / "cli.sock"
    server = ServeProcess(
        journal_dir, "--bind", f"unix:{sock}", env=subprocess_env, log_path=tmp_path / "log"
    )
    try:
        assert server.url == f"unix:{sock}"
        assert _get(sock) == 200
    finally:
        assert server.terminate() == 0
    assert "serving without --tokens-file" not in server.log()
    assert not sock.exists()


def test_serving_on_loopback_without_tokens_warns_in_one_line(
    journal_dir: Path, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    server = ServeProcess(journal_dir, env=subprocess_env, log_path=tmp_path / "log")
    try:
        assert request(server.url, "GET", "/healthz").status == 200
    finally:
        server.terminate()
    lines = [line for line in server.log().splitlines() if "without --tokens-file" in line]
    assert len(lines) == 1, server.log()
    assert "every user and process of this host" in lines[0]
    assert "--bind unix:PATH" in lines[0]


def test_a_unix_bind_must_be_an_absolute_short_path(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    for bad in ("unix:relative.sock", "unix:/" + "x" * 200):
        out = subprocess.run(
            [sys.executable, "-m", "hybridq", "serve", "--journal", str(tmp_path / "j"), "--bind", bad],
            env=subprocess_env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert out.returncode == 1, out
        assert "absolute path under 108 bytes" in out.stderr
        assert "Traceback" not in out.stderr


def test_server_url_of_a_unix_socket(journal_dir: Path, tmp_path: Path) -> None:
    cfg = ServeConfig(journal=journal_dir, unix_path=tmp_path / "s.sock")
    server = Server(object(), cfg)
    try:
        assert server.url == f"unix:{tmp_path / 's.sock'}"
    finally:
        server.sock.close()
