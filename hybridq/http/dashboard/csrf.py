"""CSRF protection of the dashboard's POSTs: a per-browser token bound by an HMAC to a server secret.

A GET sets a random session cookie (``SameSite=Strict``, ``HttpOnly``); each form carries
``HMAC(secret, cookie)``, the secret being a file in the journal directory (``dashboard.secret``,
0600, made on first use), so every server of one journal accepts the others' forms and a token
cannot be made without the secret. A POST is refused (403) without the cookie, with a token that
does not match it, or from another origin (an ``Origin`` header naming another host). Whoever
can read the journal directory can read the secret, and so forge tokens (docs/security.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import threading
import urllib.parse

from starlette.requests import Request

__all__ = ["COOKIE", "FIELD", "SECRET_NAME", "allowed", "session", "token"]

#: The session cookie, the form field holding the token, and the secret's file name.
COOKIE = "hybridq_csrf"
FIELD = "csrf"
SECRET_NAME = "dashboard.secret"  # noqa: S105 - a file name, not a secret


#: Secrets read, per file: (device, inode, size, ctime) -> secret. A replaced or deleted file is read again.
_CACHE: dict[str, tuple[tuple[int, int, int, int], bytes]] = {}
_CACHE_LOCK = threading.Lock()
_LENGTH = 64  # hex digits of 32 random bytes


def _secret(journal: str) -> bytes:
    """The server secret of ``journal`` (made, 32 random bytes, 0600, the first time).

    Made atomically: written to a temporary file, fsync'd, then linked to its name, so a racing
    server either wins or reads the winner's, and no reader ever sees a half-written file. A
    damaged one (empty or short: a crash of an older version) is replaced.
    """
    path = os.path.join(journal, SECRET_NAME)
    for _ in range(5):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            _publish(path, replace=False)
            continue
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)
        with _CACHE_LOCK:
            cached = _CACHE.get(path)
        if cached is not None and cached[0] == ident:
            return cached[1]
        with open(path, "rb") as f:
            secret = f.read().strip()
        if len(secret) < _LENGTH:
            _publish(path, replace=True)
            continue
        with _CACHE_LOCK:
            _CACHE[path] = (ident, secret)
        return secret
    raise OSError(f"{path}: cannot make the dashboard secret (it keeps changing under us)")


def _publish(path: str, *, replace: bool) -> None:
    """Write a new secret durably under ``path`` (``replace``: over a damaged one; else if none)."""
    directory = os.path.dirname(path)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):  # another server won: read theirs
                os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def session(request: Request) -> tuple[str, bool]:
    """The browser's session id, and whether it is new (the response must set the cookie)."""
    known = request.cookies.get(COOKIE, "")
    if len(known) == 32 and all(c in "0123456789abcdef" for c in known):
        return known, False
    return secrets.token_hex(16), True


def token(journal: str, session_id: str) -> str:
    """The form token of ``session_id``."""
    return hmac.new(_secret(journal), session_id.encode(), hashlib.sha256).hexdigest()


def allowed(journal: str, request: Request, form: dict[str, str]) -> bool:
    """Whether a POST carries a valid token for its session cookie, from this origin."""
    origin = request.headers.get("origin")
    if origin is not None and urllib.parse.urlsplit(origin).netloc != request.headers.get("host"):
        return False
    session_id = request.cookies.get(COOKIE)
    given = form.get(FIELD)
    if not session_id or not given:
        return False
    return hmac.compare_digest(token(journal, session_id).encode(), given.encode())
