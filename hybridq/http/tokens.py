"""The tokens ``hybridq serve`` accepts, the session cookies made from them, and failed guesses.

Apart from :mod:`hybridq.http.auth` (the middleware that checks every request with them, and
re-exports these names) and :mod:`hybridq.http.login` (the form that sets the cookie). See
docs/http.md. Tokens are compared with :func:`hmac.compare_digest` and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from pathlib import Path

from hybridq.errors import TokensError
from hybridq.security.secretfile import read_secret_file

__all__ = ["COOKIE", "SESSION_S", "Guesses", "Tokens", "session_value", "token_scope"]

log = logging.getLogger("hybridq.http")

#: The session cookie ``POST /login`` sets.
COOKIE = "hybridq_session"
#: Longest token accepted (a file of longer lines is refused at start).
MAX_TOKEN = 512
#: Shortest token accepted, and how many different characters it must have at least.
MIN_TOKEN, MIN_DISTINCT = 16, 6
#: Failed authentications (a wrong bearer token, a wrong login) one client may make per window;
#: past them, every request of it that tries a token is answered 429 until the window ends.
MAX_FAILURES, FAILURE_WINDOW_S = 20, 60.0
#: How long a login lasts (the cookie's Max-Age, and checked by the server), seconds.
SESSION_S = 12 * 3600


def _read_tokens(path: Path) -> tuple[bytes, ...]:
    """The tokens in ``path``: one per line; blank lines and ``#`` comments are skipped.

    A token must have at least :data:`MIN_TOKEN` characters, :data:`MIN_DISTINCT` of them
    different (a 2-letter token fell in 442 guesses); a file group or other may read is warned
    about (never refused: a deployment's group may need it).
    """
    try:
        text = read_secret_file(str(path))
    except OSError as exc:
        raise TokensError(f"tokens file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TokensError(f"tokens file {path}: not UTF-8 text") from None
    tokens = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) > MAX_TOKEN or not line.isascii() or not line.isprintable() or " " in line:
            raise TokensError(
                f"tokens file {path}: line {number} is not a token (printable ASCII, no spaces)"
            )
        if len(line) < MIN_TOKEN or len(set(line)) < MIN_DISTINCT:
            raise TokensError(
                f"tokens file {path}: line {number} is too weak a token (at least {MIN_TOKEN} "
                f"characters, {MIN_DISTINCT} of them different; make one with openssl rand -hex 32)"
            )
        tokens.append(line.encode())
    if not tokens:
        raise TokensError(f"tokens file {path}: no token in it (one per line)")
    return tuple(tokens)


def _session_mac(token: bytes, issued: int) -> str:
    return hmac.new(token, b"hybridq-session-v2:%d" % issued, hashlib.sha256).hexdigest()


def token_scope(token: bytes) -> str:
    """A name for ``token`` that does not reveal it: whose ``Idempotency-Key`` a POST's is."""
    return hashlib.blake2b(token, digest_size=16, person=b"hybridq-keyscope").hexdigest()


def session_value(token: bytes, issued: int | None = None) -> str:
    """The cookie value for a login with ``token`` at ``issued`` (default: now).

    ``<issued>.<HMAC(token, issued)>``: the cookie never holds the token, and the server knows
    when it was issued without keeping any state.
    """
    at = int(time.time()) if issued is None else issued
    return f"{at}.{_session_mac(token, at)}"


class Tokens:
    """The valid tokens, from a file read again when it changes.

    Args:
        path: the tokens file (one token per line).

    Raises:
        TokensError: the file cannot be read or holds no token (at start only: a later bad read
            keeps the tokens read before, and is logged).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._tokens = _read_tokens(path)
        #: Cookies ``POST /logout`` cleared, with when they would expire anyway.
        self._revoked: dict[str, float] = {}

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError:
            return (-1, -1, -1)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _current(self) -> tuple[bytes, ...]:
        stamp = self._stat()
        if stamp != self._stamp:
            with self._lock:
                if stamp != self._stamp:
                    try:
                        tokens = _read_tokens(self.path)
                    except TokensError as exc:
                        log.warning("%s; keeping the tokens read before", exc)
                    else:
                        self._tokens = tokens
                        log.info("tokens file %s read again: %d token(s)", self.path, len(tokens))
                    self._stamp = stamp
        return self._tokens

    def valid_token(self, candidate: str) -> bool:
        """Whether ``candidate`` is one of the tokens (each compared in constant time)."""
        return self.matching(candidate) is not None

    def matching(self, candidate: str) -> bytes | None:
        """The token ``candidate`` is, or ``None`` (every token compared, in constant time)."""
        given = candidate.encode("utf-8", "replace")
        found = None
        for token in self._current():
            if hmac.compare_digest(given, token):  # no early exit: every token is compared
                found = token
        return found

    def valid_session(self, cookie: str, now: float | None = None) -> bool:
        """Whether ``cookie`` is a session value of one of the tokens, not expired nor revoked.

        Only the form :func:`session_value` writes is taken (an issue time of ASCII digits without
        a leading zero): another spelling of the same time (``0<time>``) is not the cookie that
        ``/logout`` revoked, and ``"²".isdigit()`` is true but ``int("²")`` raises.
        """
        issued = _issued(cookie)
        if issued is None or cookie in self._revoked:
            return False
        mac = cookie.partition(".")[2]
        age = (time.time() if now is None else now) - issued
        if not -60 <= age <= SESSION_S:  # a minute of clock skew
            return False
        given = mac.encode("utf-8", "replace")
        ok = False
        for token in self._current():
            ok |= hmac.compare_digest(given, _session_mac(token, issued).encode())
        return ok

    def revoke(self, cookie: str) -> None:
        """Refuse ``cookie`` from now on (``POST /logout``; this process only, until it expires)."""
        now = time.time()
        self._revoked = {c: t for c, t in self._revoked.items() if t > now}  # drop the expired
        issued = _issued(cookie)
        if issued is not None and len(self._revoked) < 100_000:
            self._revoked[cookie] = issued + SESSION_S


def _issued(cookie: str) -> int | None:
    """The issue time of a session cookie in the one form it is written in; ``None``: not that form."""
    text = cookie.partition(".")[0]
    if not (0 < len(text) <= 12 and text.isascii() and text.isdigit()) or text[0] == "0":
        return None
    return int(text)


class Guesses:
    """Failed authentications per client, to stop guessing (:data:`MAX_FAILURES` per window).

    While a client is over the limit no token of it is tried at all, the right one included:
    answering a right guess would leave the guessing unlimited. A client is its address as the
    server sees it (a trusted proxy's ``X-Forwarded-For`` included): clients sharing an address
    share a count.
    """

    def __init__(self, limit: int = MAX_FAILURES, window_s: float = FAILURE_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self._failures: dict[str, tuple[int, float]] = {}

    def wait(self, client: str) -> float:
        """Seconds ``client`` must wait before a token of it is tried again (0: none)."""
        count, since = self._failures.get(client, (0, 0.0))
        left = since + self.window_s - time.monotonic()
        return left if count >= self.limit and left > 0 else 0.0

    def failed(self, client: str) -> None:
        """One more failed authentication of ``client``."""
        now = time.monotonic()
        if len(self._failures) >= 10_000:  # bounded: the expired go first, then everyone
            self._failures = {c: f for c, f in self._failures.items() if f[1] + self.window_s > now}
            if len(self._failures) >= 10_000:
                self._failures.clear()
        count, since = self._failures.get(client, (0, now))
        if since + self.window_s <= now:
            count, since = 0, now
        self._failures[client] = (count + 1, since)
        if count + 1 == self.limit:
            log.warning(
                "%d failed authentications from %s within %g s: its tokens are not tried until then",
                self.limit,
                client,
                self.window_s,
            )
