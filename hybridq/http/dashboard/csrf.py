"""CSRF protection of the dashboard's POSTs: a per-browser token bound by an HMAC to a server secret.

A GET sets a random session cookie (``SameSite=Strict``, ``HttpOnly``); each form carries
``HMAC(secret, cookie)``, the secret being a file in the journal directory (``dashboard.secret``,
0600, made on first use), so every server of one journal accepts the others' forms and a token
cannot be made without the secret. A POST is refused (403) without the cookie, with a token that
does not match it, or from another origin (an ``Origin`` header naming another host).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import urllib.parse

from starlette.requests import Request

__all__ = ["COOKIE", "FIELD", "SECRET_NAME", "allowed", "session", "token"]

#: The session cookie, the form field holding the token, and the secret's file name.
COOKIE = "hybridq_csrf"
FIELD = "csrf"
SECRET_NAME = "dashboard.secret"  # noqa: S105 - a file name, not a secret


def _secret(journal: str) -> bytes:
    """The server secret of ``journal`` (made, 32 random bytes, 0600, the first time)."""
    path = os.path.join(journal, SECRET_NAME)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    with open(path, "rb") as f:  # a server racing us wrote the same length: read what won
        secret = f.read().strip()
    if len(secret) < 32:
        raise OSError(f"{path}: the dashboard secret is too short (delete it to make a new one)")
    return secret


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
