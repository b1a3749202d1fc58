"""Enqueue, look up and cancel through ingest nodes (docs/api.md, "A remote queue").

* **Enqueue** is one ``POST /v1/jobs`` per job, with an ``Idempotency-Key``: the job's explicit
  ``idempotency_key``, or ``hq-<envelope id>`` (so ``enqueue_many`` of the same prepared
  envelopes again sends the same keys). Every try of the job (the next node after a timeout,
  a refused or broken connection, a 5xx) sends the same key, so a node that wrote the job
  already answers with it, and the same key written by two nodes runs once (the workers claim
  the key in the shared Redis: docs/http.md, "Several nodes"). It returns only on a ``202``
  (durable). ``429`` is :class:`QueueFull`, ``400``/``413``/``422`` an :class:`EnvelopeError`,
  nothing written; every node unreachable is :class:`NodeUnavailable`. Once a try was sent
  and got no answer, any of these would be a lie ("nothing written"): the job may be in that
  node's journal, so the call raises :class:`OutcomeUnknown`, carrying the key to retry with.
* **Lookups** go to the node the id names (``http-<node>-...``), else to each node in turn; a
  node answering that another node holds the job sends the lookup there. A job whose node does
  not answer raises :class:`NodeUnavailable` naming it: never "no such job".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from hybridq.client.ids import node_of
from hybridq.client.nodes import Nodes, Reply
from hybridq.envelope.model import Envelope
from hybridq.errors import (
    ConfigError,
    EnvelopeError,
    HybridqError,
    NodeUnavailable,
    NotSerializable,
    OutcomeUnknown,
    QueueFull,
)

__all__ = ["MAX_KEY", "RemoteClient", "body_of", "enqueue_all"]

#: The longest ``Idempotency-Key`` a node takes (printable ASCII).
MAX_KEY = 255


def body_of(env: Envelope) -> dict[str, Any]:
    """The ``POST /v1/jobs`` body of a job (EnvelopeError for what the HTTP API cannot carry)."""
    unsupported = [
        name
        for name, value in (
            ("job_timeout", env.timeout_s),
            ("result_ttl", env.result_ttl_s),
            ("description", env.description),
            ("meta", env.meta or None),
        )
        if value is not None
    ]
    if unsupported:
        raise EnvelopeError(
            f"a remote queue cannot send {', '.join(unsupported)}: the HTTP API does not carry "
            "them (docs/http.md); leave them out, or enqueue on a host with a journal"
        )
    body: dict[str, Any] = {
        "task": env.func,
        "args": list(env.args),
        "kwargs": dict(env.kwargs),
        "queue": env.queue,
    }
    if env.run_at is not None:
        body["delay"] = max(0.0, env.run_at - env.created_at)
    if env.retry is not None:
        body["retry"] = env.retry.to_json()
    if env.priority:
        body["priority"] = env.priority
    if env.limit_key is not None:
        body["limit_key"] = env.limit_key
    return body


def _key_of(env: Envelope) -> str:
    """The ``Idempotency-Key`` of every try of ``env``: its explicit key, or ``hq-<its id>``.

    Derived from the envelope's (random) id, not made per post: a caller retrying the same
    prepared envelopes after an unknown outcome sends the same keys (a local journal dedupes
    by the id alike).
    """
    if env.idempotency_key == env.id:  # no explicit key
        return f"hq-{env.id}"
    key = env.idempotency_key
    if not (0 < len(key) <= MAX_KEY and key.isascii() and key.isprintable()):
        raise EnvelopeError("over HTTP an idempotency_key is 1-255 printable ASCII characters")
    return key


class RemoteClient:
    """The calls a remote queue makes, over :class:`Nodes`."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes

    def post(self, env: Envelope) -> tuple[str, str]:
        """Enqueue one job; ``(its id, the key it was sent with)`` once a node answered 202.

        Raises:
            QueueFull: 429 (the node's ``--capacity``, or too many failed logins).
            EnvelopeError: 400, 413, 415 or 422: the node refused the job; nothing written.
            NodeUnavailable: no node could be reached (nothing written).
            OutcomeUnknown: a try was sent and got no answer, and no node acknowledged the
                job: it may have been written; retry with the error's ``key``.
        """
        body = body_of(env)
        key = _key_of(env)
        try:
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise NotSerializable(f"the job's arguments are not JSON the HTTP API can carry: {exc}") from None
        try:
            reply = self.nodes.call("POST", "/v1/jobs", data, {"Idempotency-Key": key})
        except NodeUnavailable as exc:
            if exc.unsure:
                raise OutcomeUnknown(key, env.id, exc.tried) from None
            raise
        if reply.status == 202 and isinstance(reply.body.get("id"), str):
            return reply.body["id"], key
        refused = _refused(reply)
        if reply.unsure:  # an earlier node may hold it: never "nothing written"
            raise OutcomeUnknown(key, env.id, [*reply.unsure, (reply.url, str(refused))])
        raise refused

    def state(self, job_id: str) -> dict[str, Any] | None:
        """``GET /v1/jobs/{id}`` from the node that holds it; ``None``: no node holds it.

        Raises:
            NodeUnavailable: the node that holds it (or, for an id that names none, one of the
                nodes) did not answer.
        """
        reply = self._at_home("GET", job_id)
        return None if reply is None else reply.body

    def cancel(self, job_id: str) -> str:
        """``POST /v1/jobs/{id}/cancel``: ``requested``, ``cancelled``, ``succeeded``, ``failed``...

        ... or ``unknown`` (no node holds it). Raises :class:`NodeUnavailable` as :meth:`state`.
        """
        reply = self._at_home("POST", job_id, "/cancel")
        return "unknown" if reply is None else str(reply.body.get("state", "unknown"))

    def _at_home(self, method: str, job_id: str, suffix: str = "") -> Reply | None:
        """The 200 of the node that holds ``job_id``; ``None`` if the nodes say none does."""
        path = f"/v1/jobs/{job_id}{suffix}"
        home = node_of(job_id)
        tried: list[tuple[str, str]] = []
        asked: set[str] = set()
        queue = self.nodes.order(self.nodes.url_of(home) if home else None)
        while queue:
            url = queue.pop(0)
            if url in asked:
                continue
            asked.add(url)
            reply, why, _ = self.nodes.send(url, method, path, b"{}" if method == "POST" else None)
            if reply is None:
                tried.append((url, why))
                continue
            if reply.status == 200:
                return reply
            if reply.status != 404:
                raise _refused(reply)
            if (
                home is not None
                and (reply.node == home or reply.body.get("asked") is True)
                and not self.nodes.cloned(home)  # two nodes of that name: ask every node
            ):
                return None  # the node that made the id (asked directly, or by this one) holds no such job
            there = self.nodes.url_of(home) if home else None
            if there is not None and there not in asked:
                queue.insert(0, there)  # that node answered before: ask it next
        if home is None and not tried:
            return None  # every node answered, none holds it
        if home is not None and not tried:
            tried.append(("-", f"node {home} is none of {', '.join(self.nodes.urls)}"))
        raise NodeUnavailable(tried, job_id=job_id, node=home)


def _refused(reply: Reply) -> HybridqError:
    """The one-line error for an answer that is neither 202 nor a failover case."""
    error = str(reply.body.get("error", ""))
    detail = str(reply.body.get("detail", error or f"HTTP {reply.status}"))
    if reply.status == 401:
        return ConfigError(f"{reply.url} refused the token (401): check token= or HYBRIDQ_TOKEN")
    if reply.status == 429:
        if error == "queue_full":
            return _queue_full(detail)
        return ConfigError(f"{reply.url}: {detail} (429: too many failed authentications from this address)")
    if reply.status in (400, 413, 415, 422):
        return EnvelopeError(f"{reply.url} refused the job ({reply.status}): {detail}")
    return HybridqError(f"{reply.url} answered {reply.status}: {detail}")


def _queue_full(detail: str) -> QueueFull:
    """A :class:`QueueFull` from a 429's detail (``"N jobs pending, capacity C: ..."``)."""
    numbers = [int(n) for n in re.findall(r"\d+", detail)]
    pending, capacity = [*numbers, 0, 0][:2]
    return QueueFull(pending, capacity)


def enqueue_all(client: RemoteClient, envelopes: Sequence[Envelope]) -> list[tuple[Envelope, str, str]]:
    """Post each envelope in turn: ``(envelope, id, key)`` per job, all acknowledged.

    On an error, the jobs acknowledged before it are on the error as ``acknowledged`` (their
    ids): unlike a local ``enqueue_many`` they are not all-or-none.
    """
    done: list[tuple[Envelope, str, str]] = []
    for env in envelopes:
        try:
            job_id, key = client.post(env)
        except HybridqError as exc:
            exc.acknowledged = [d[1] for d in done]  # type: ignore[attr-defined]
            raise
        done.append((env, job_id, key))
    return done
