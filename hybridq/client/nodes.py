"""The ingest nodes a remote queue talks to: one urllib3 pool, and the failover between nodes.

A call goes to one node; on a refused connection, a timeout, a broken connection or a 5xx
(``502``, ``503``, ``504``, ``500``) or ``408`` it goes to the next, and after a round of every
node it waits a little and starts again, up to ``rounds`` rounds (then
:class:`~hybridq.errors.NodeUnavailable`, naming each node and why). Any other answer is the
call's (``202``, ``4xx``). A try that was sent and got no answer (a read timeout, a broken
connection, a ``5xx``) may have been taken: :attr:`Reply.unsure` and ``NodeUnavailable.unsure``
list them, so an enqueue can say its outcome is unknown rather than "refused". What may be retried
is the caller's business: an enqueue carries an ``Idempotency-Key`` on every try (docs/api.md, "A
remote queue").

Calls start at the nodes in turn (round robin, spreading the load), and a node that just failed
is tried last for :data:`DOWN_S` seconds. The node names each answer carries (``Hybridq-Node``)
are learnt, so a job's id (``http-<node>-...``) leads straight to its node.

One :class:`urllib3.PoolManager` per :class:`Nodes`: keep-alive connections, at most
``pool_size`` per node (more threads wait for one). urllib3 is thread-safe; so is this.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from hybridq.client.ids import NODE_NAME
from hybridq.errors import ConfigError, NodeUnavailable
from hybridq.extras import missing

__all__ = ["DOWN_S", "MAX_ANSWER", "NODE_HEADER", "RETRYABLE", "Nodes", "Reply", "parse_urls"]

log = logging.getLogger("hybridq.client")

#: The response header naming the node that answered (``hybridq.http.api``).
NODE_HEADER = "Hybridq-Node"
#: Answers that mean "this node cannot take it now": try the next node.
RETRYABLE = frozenset({408, 500, 502, 503, 504})
#: How long a node that failed is tried last (seconds).
DOWN_S = 2.0
#: The largest answer read from a node (bytes); a longer one counts as no answer.
MAX_ANSWER = 4 << 20
#: The pause after each round of failures (seconds), the last one repeated.
_PAUSES = (0.05, 0.25, 1.0)


@dataclass(frozen=True)
class Reply:
    """One node's answer: its URL, the status, the JSON body (``{}`` if none), its node name."""

    url: str
    status: int
    body: dict[str, Any]
    node: str | None
    #: The tries before this answer that were sent and got none: those nodes may have taken the call.
    unsure: tuple[tuple[str, str], ...] = ()


def parse_urls(urls: str | Sequence[str]) -> list[str]:
    """The nodes' base URLs from ``"http://a:8080,http://b:8080"`` or a list (ConfigError if bad)."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for item in items:
        url = str(item).strip().rstrip("/")
        if not url:
            continue
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ConfigError(f"not an ingest node URL: {url!r} (http://HOST:PORT or https://HOST:PORT)")
        if parts.username or parts.password:
            raise ConfigError(
                f"{parts.scheme}://{parts.hostname}...: give the token with token=, not in the URL"
            )
        if url not in out:
            out.append(url)
    if not out:
        raise ConfigError("no ingest node URL given (url= or HYBRIDQ_URL)")
    return out


class Nodes:
    """The ingest nodes of one remote queue (see the module docstring).

    Args:
        urls: the nodes' base URLs.
        token: the bearer token sent to every node (``None``: none, for a loopback node
            without a tokens file).
        connect_timeout: seconds to open a connection.
        read_timeout: seconds to wait for an answer (a POST waits for the node's fsync).
        rounds: rounds of every node before giving up.
        pool_size: keep-alive connections kept per node.
        ca_certs: a CA bundle for ``https://`` nodes (default: the system's).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        token: str | None = None,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 10.0,
        rounds: int = 3,
        pool_size: int = 16,
        ca_certs: str | None = None,
    ) -> None:
        try:
            import urllib3  # noqa: PLC0415 - the client extra, loaded by the first remote queue
        except ImportError:
            raise missing("client", "a remote queue (hybridq.Queue(url=...))") from None
        self.urls = parse_urls(urls)
        if token is not None and (not token or token != token.strip() or "\n" in token):
            raise ConfigError("the token must be one line with no surrounding spaces (HYBRIDQ_TOKEN)")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        clear = [u for u in self.urls if token and u.startswith("http://") and not _loopback(u)]
        if clear:
            log.warning(
                "the token is sent in clear text to %s: use https:// (docs/security.md)", ", ".join(clear)
            )
        self.rounds = max(1, rounds)
        self._errors = urllib3.exceptions
        self._pool = urllib3.PoolManager(
            num_pools=max(10, len(self.urls)),
            maxsize=pool_size,
            block=True,  # more threads than connections wait for one, rather than open more
            retries=False,  # the failover below decides; urllib3 raises at once
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
            ca_certs=ca_certs,
        )
        self._turn = itertools.count()
        self._failed: dict[str, float] = {}  # url -> monotonic time of its last failure
        self._names: dict[str, str] = {}  # node name -> url, from the answers
        self._clones: set[str] = set()  # names more than one url answered with
        self._lock = threading.Lock()

    def order(self, first: str | None = None) -> list[str]:
        """The nodes in the order one call tries them: ``first``, then in turn, failed ones last."""
        n = len(self.urls)
        start = next(self._turn) % n
        turn = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        with self._lock:
            recent = {u for u, at in self._failed.items() if now - at < DOWN_S}
        ordered = [u for u in turn if u not in recent] + [u for u in turn if u in recent]
        if first is not None and first in ordered:
            ordered.remove(first)
            ordered.insert(0, first)
        return ordered

    def url_of(self, node: str) -> str | None:
        """The URL of the node named ``node``, if an answer named it (and only one URL did)."""
        with self._lock:
            return None if node in self._clones else self._names.get(node)

    def call(
        self,
        method: str,
        path: str,
        data: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """Send the request (``data``: a JSON body) to the nodes in turn until one answers.

        Raises:
            NodeUnavailable: no node answered in ``rounds`` rounds (its ``unsure``: the tries
                that may have been taken).
        """
        tried: list[tuple[str, str]] = []
        unsure: list[tuple[str, str]] = []
        for round_ in range(self.rounds):
            if round_:
                time.sleep(_PAUSES[min(round_ - 1, len(_PAUSES) - 1)])
            for url in self.order():
                reply, why, sent = self.send(url, method, path, data, headers)
                if reply is not None:
                    return dataclasses.replace(reply, unsure=tuple(unsure)) if unsure else reply
                tried.append((url, why))
                if sent:
                    unsure.append((url, why))
        raise NodeUnavailable(tried, unsure=unsure)

    def send(
        self,
        url: str,
        method: str,
        path: str,
        data: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[Reply | None, str, bool]:
        """One try on one node: its reply, or ``None``, why it gave none and whether it was sent.

        ``sent``: the node may have taken the call (a read timeout, a broken connection, an
        answer too long to read, a ``5xx``); not for a connection never made, nor a ``408``.
        """
        sent = dict(self._headers)
        if data is not None:
            sent["Content-Type"] = "application/json"
        if headers:
            sent.update(headers)
        try:
            response = self._pool.request(
                method, url + path, body=data, headers=sent, redirect=False, preload_content=False
            )
            raw = response.read(MAX_ANSWER + 1)
        except self._errors.HTTPError as exc:
            self._fail(url)
            errors = self._errors
            unsent = (errors.NewConnectionError, errors.ConnectTimeoutError, errors.SSLError)
            return None, _describe(exc, errors), not isinstance(exc, unsent)
        if len(raw) > MAX_ANSWER:
            response.close()  # the rest unread: this connection is not reused
            self._fail(url)
            return None, f"an answer over {MAX_ANSWER} bytes", True
        response.release_conn()
        node = response.headers.get(NODE_HEADER)
        if node and NODE_NAME.fullmatch(node):
            self._learn(node, url)
        try:
            parsed = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):
            parsed = {}
        reply_body = parsed if isinstance(parsed, dict) else {}
        if response.status in RETRYABLE:
            self._fail(url)
            return None, f"{response.status} {reply_body.get('error', '')}".strip(), response.status != 408
        with self._lock:
            self._failed.pop(url, None)
        return Reply(url, response.status, reply_body, node or None), "", False

    def _learn(self, node: str, url: str) -> None:
        """Remember ``node``'s URL; a name two URLs answer with is a clone, reported once."""
        with self._lock:
            known = self._names.setdefault(node, url)
            clone = known != url and node not in self._clones
            if clone:
                self._clones.add(node)
        if clone:
            log.error(
                "%s and %s both say they are node %s: one's journal is a copy of the other's (a "
                "cloned volume); its jobs are looked up on every node. Give the copy its own "
                "name: stop it, delete node.state in its journal, start it (docs/http.md)",
                known,
                url,
                node,
            )

    def cloned(self, node: str) -> bool:
        """Whether two of the URLs answered as ``node`` (:meth:`url_of` then names none)."""
        with self._lock:
            return node in self._clones

    def _fail(self, url: str) -> None:
        with self._lock:
            self._failed[url] = time.monotonic()

    def close(self) -> None:
        """Close the pooled connections."""
        self._pool.clear()


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _describe(exc: BaseException, errors: Any) -> str:
    """One line for a connection that gave no answer."""
    if isinstance(exc, errors.NewConnectionError):
        reason = str(exc).rsplit(":", 1)[-1].strip() or "cannot connect"
        return f"cannot connect ({reason})"
    if isinstance(exc, errors.ConnectTimeoutError):
        return "connect timed out"
    if isinstance(exc, errors.ReadTimeoutError):
        return "no answer in time (it may have taken the call)"
    if isinstance(exc, errors.SSLError):
        return f"TLS failed ({exc})"
    if isinstance(exc, errors.ProtocolError):
        return "connection broken (it may have taken the call)"
    return f"{type(exc).__name__}: {exc}"
