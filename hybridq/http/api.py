"""The API of ``hybridq serve`` (docs/http.md): enqueue over HTTP, look jobs up, stats, metrics.

* ``POST /v1/jobs`` validates the body and builds the job's envelope with :meth:`Queue.prepare`
  (:mod:`hybridq.http.job_body`) and commits it with ``enqueue_many_async`` on one committer
  queue for the whole server, so concurrent POSTs share the journal's group commits (one fsync
  for all) and the event loop never waits for the disk. It answers ``202`` only once the job is durable.
* ``GET /v1/jobs/{id}`` reads :func:`hybridq.fetch_job` (the journal, the ledger and the
  forwarder's lookup index: never Redis, so it is right after a Redis wipe).
* ``GET /v1/stats`` is :func:`hybridq.stats` (the forwarder's saved figures and the journal
  after them), ``GET /metrics`` the Prometheus text, ``GET /healthz`` a liveness answer.

Blocking reads (the lookup, the stats) run in threads, off the loop. A POST's body must say
``Content-Type: application/json`` (a cross-site form or ``no-cors`` fetch cannot, without a
CORS preflight), arrive within ``body_timeout_s`` (408) and stay under ``max_body`` (413).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from hybridq.cancels import cancel
from hybridq.envelope.model import Envelope, validate_job_id
from hybridq.errors import (
    BadRequest,
    EnvelopeError,
    HybridqError,
    JournalIOError,
    NoSuchTask,
    QueueFull,
    RecordTooLarge,
)
from hybridq.http.answers import (
    Forbidden,
    TaskCheck,
    check_size,
    error,
    job_state,
    json_only,
    stats_body,
)
from hybridq.http.body import BodyTimeout, BodyTooLarge, read_body
from hybridq.http.config import ServeConfig
from hybridq.http.idempotency import KeyReused, KeyStore, fingerprint, owned_by, valid_key
from hybridq.http.job_body import FIELDS, job_envelope, parse_body
from hybridq.http.node import NodeDown, node_name, node_of
from hybridq.job import fetch_job
from hybridq.ops.status import stats
from hybridq.producer.queue import Queue

if TYPE_CHECKING:
    from hybridq.http.peers import Peers

__all__ = ["FIELDS", "Api", "BodyTooLarge"]

log = logging.getLogger("hybridq.http")

#: The response header that names the answering node (:mod:`hybridq.http.node`).
NODE_HEADER = "Hybridq-Node"


class Api:
    """The API's state and endpoints over one journal.

    Args:
        config: the server's settings.
        registry: the Prometheus registry ``/metrics`` serves (``hybridq forward --serve``: the
            forwarder's); ``None``: the journal's figures from :func:`hybridq.stats`.
    """

    def __init__(self, config: ServeConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.journal = str(config.journal)
        #: Commits every POST's job: one committer, so all queues share its fsyncs.
        self.committer = Queue("default", self.journal, capacity=config.capacity)
        self.keys = KeyStore(self.journal)
        #: The journal's node name: every id this server makes carries it (hybridq.http.node).
        self.node = node_name(self.journal)
        #: The header naming it, on every answer about a job.
        self._named = {NODE_HEADER: self.node}
        #: Lookups of other nodes' jobs through Redis, and answers to theirs (hybridq.http.peers).
        self.peers: Peers | None = None
        if config.peers and config.redis_url is not None:
            from hybridq.http.peers import Peers  # noqa: PLC0415 - redis-py, only with --redis

            self.peers = Peers(config.redis_url, self.node, self._job_state)
            self.peers.start()
        #: POST outcomes by status code, for /metrics.
        self.posts: Counter[int] = Counter()
        self.registry = registry
        self._stats_registry: CollectorRegistry | None = None
        #: Which tasks a POST may name (registered, or under ``--allow``), checked once each.
        self.tasks = TaskCheck(config.allow)

    def routes(self) -> list[BaseRoute]:
        """The API's routes."""
        return [
            Route("/v1/jobs", self.post_job, methods=["POST"]),
            Route("/v1/jobs/{job_id}", self.get_job, methods=["GET"]),
            Route("/v1/jobs/{job_id}/cancel", self.cancel_job, methods=["POST"]),
            Route("/v1/stats", self.get_stats, methods=["GET"]),
            Route("/metrics", self.get_metrics, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
        ]

    # -- POST /v1/jobs ------------------------------------------------------------------------

    async def post_job(self, request: Request) -> Response:
        """Enqueue one job; 202 once it is durable (see docs/http.md for every answer)."""
        response = await self._post(request)
        self.posts[response.status_code] += 1
        response.headers[NODE_HEADER] = self.node
        return response

    async def _post(self, request: Request) -> Response:
        refused = json_only(request)
        if refused is not None:
            return refused
        key = request.headers.get("idempotency-key")
        if key is not None and not valid_key(key):
            return error(400, "bad_idempotency_key", "Idempotency-Key: 1-255 printable ASCII characters")
        scope = str(getattr(request.state, "token_scope", ""))  # whose key: the token's (auth.py)
        try:
            env = self._envelope(await self._body(request), key, scope)
            check_size(env)
        except BodyTooLarge:
            return error(413, "too_large", f"the body is over {self.config.max_body} bytes")
        except BodyTimeout:
            return error(408, "timeout", f"the body did not arrive within {self.config.body_timeout_s:g} s")
        except ClientDisconnect:
            return Response(status_code=400)  # the client is gone: nobody reads it, nothing logged
        except RecordTooLarge as exc:  # a JournalError, but the client's to fix: not a retry
            return error(413, "too_large", str(exc))
        except (BadRequest, EnvelopeError, NoSuchTask) as exc:  # EnvelopeError: NotSerializable too
            return error(400, "bad_request", str(exc))
        except HybridqError as exc:  # the journal directory cannot be used (a JournalError)
            return self._unavailable(exc)
        try:
            if key is None:
                job, replay = await self._commit(env), False
            else:
                job, replay = await self._commit_keyed(env)
        except KeyReused as exc:
            return error(422, "idempotency_key_reused", str(exc))
        except RecordTooLarge as exc:  # signing made it larger; raised before anything is written
            return error(413, "too_large", str(exc))
        except QueueFull as exc:
            return error(
                429,
                "queue_full",
                f"{exc.pending} jobs pending, capacity {exc.capacity}: retry later",
                {"Retry-After": str(self.config.retry_after_s)},
            )
        except (HybridqError, OSError) as exc:  # a JournalError, a SigningKeyError: 503, not a 500
            return self._unavailable(exc)
        location = f"{request.scope.get('root_path', '')}/v1/jobs/{job}"
        headers = {"Location": location}
        if replay:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse({"id": job}, status_code=202, headers=headers)

    def _unavailable(self, exc: BaseException) -> JSONResponse:
        log.warning("POST /v1/jobs: the journal cannot be written: %s", exc)
        detail = "the journal cannot be written; retry (with the same Idempotency-Key)"
        return error(503, "journal_unavailable", detail, {"Retry-After": str(self.config.retry_after_s)})

    async def _body(self, request: Request) -> Any:
        """The JSON body, read up to ``max_body`` (413 as soon as it is over, not after)."""
        return parse_body(await read_body(request, self.config.max_body, self.config.body_timeout_s))

    def _envelope(self, body: Any, key: str | None, scope: str = "") -> Envelope:
        """The job a body asks for, validated (:func:`hybridq.http.job_body.job_envelope`)."""
        return job_envelope(body, key, scope, committer=self.committer, tasks=self.tasks, node=self.node)

    async def _commit(self, env: Envelope) -> str:
        (job,) = await self.committer.enqueue_many_async([env])
        return job.id

    async def _commit_keyed(self, env: Envelope) -> tuple[str, bool]:
        """Commit a keyed job unless the journal holds it already; (its id, whether it did)."""
        print_ = fingerprint(env)
        async with self.keys.hold(env.id):
            found = await asyncio.to_thread(self.keys.find, env.id)
            if self.keys.check(env.id, found, print_):
                return env.id, True
            try:
                job_id = await self._commit(env)
            except JournalIOError:
                self.keys.unsure(env.id)
                raise
            self.keys.remember(job_id, print_)
            return job_id, False

    # -- reads --------------------------------------------------------------------------------

    async def get_job(self, request: Request) -> Response:
        """A job's status, attempt, result or error (another node's: asked of it); 404 if unknown."""
        return await self._from_peer(request) or await self._on_job(request, self._job_state)

    async def cancel_job(self, request: Request) -> Response:
        """Cancel a job (:func:`hybridq.cancel`): ``{"id", "state"}``; 404 for an unknown id.

        Only a job enqueued over HTTP with an ``Idempotency-Key`` by the request's token (any
        ``http-`` job without tokens); else 403 (docs/security.md). JSON only, as a POST (415).
        """
        refused = json_only(request)
        if refused is not None:
            return refused
        scope = str(getattr(request.state, "token_scope", ""))
        return await self._on_job(request, lambda job_id: self._cancel(job_id, scope))

    async def _on_job(self, request: Request, read: Callable[[str], dict[str, Any] | None]) -> Response:
        """``read(id)`` off the loop for a job of this journal; 404 for ``None`` or another node's id."""
        job_id = request.path_params["job_id"]
        refused = self._not_here(job_id)
        if refused is not None:
            return refused
        try:
            state = await asyncio.to_thread(read, job_id)
        except Forbidden as exc:
            return error(403, "forbidden", str(exc), self._named)
        except (HybridqError, OSError) as exc:
            return error(503, "journal_unavailable", str(exc))
        if state is None:
            return self._not_found()
        return self._answer(state)

    def _cancel(self, job_id: str, scope: str) -> dict[str, Any] | None:
        job = fetch_job(job_id, self.journal)
        if job is None:
            return None
        if not owned_by(job.envelope, scope):
            raise Forbidden(
                "over HTTP a token cancels only the jobs it enqueued with an Idempotency-Key "
                "(others: hybridq cancel on the node's host)"
            )
        (result,) = cancel([job_id], self.journal)
        return None if result.state == "unknown" else {"id": job_id, "state": result.state}

    def _not_here(self, job_id: str) -> Response | None:
        """The 404 for an id this journal cannot hold: invalid, or made by another node."""
        try:
            validate_job_id(job_id)
        except EnvelopeError:
            return self._not_found()
        node = node_of(job_id)
        if node is None or node == self.node:
            return None
        detail = f"job ids http-{node}-... are held by node {node}'s journal: ask that node"
        return error(404, "not_found", detail, self._named, node=node)

    async def _from_peer(self, request: Request) -> Response | None:
        """Another node's job, asked of it through Redis (``None``: not another node's, or no peers)."""
        job_id = request.path_params["job_id"]
        node = node_of(job_id)
        if self.peers is None or node is None or node == self.node:
            return None
        try:
            validate_job_id(job_id)
            state = await self.peers.ask_async(node, job_id)  # its own few threads, not the API's
        except EnvelopeError:
            return self._not_found()
        except NodeDown as exc:
            return error(503, "node_unavailable", str(exc), self._named, node=node)
        if state is None:
            detail = f"node {node} holds no job with this id"
            return error(404, "not_found", detail, self._named, node=node, asked=True)
        return self._answer(state)

    def _not_found(self) -> Response:
        return error(404, "not_found", "no job with this id", self._named)

    def _answer(self, body: dict[str, Any]) -> Response:
        return JSONResponse(body, headers=self._named)

    def _job_state(self, job_id: str) -> dict[str, Any] | None:
        job = fetch_job(job_id, self.journal)
        if job is None:
            return None
        return job_state(job)

    async def get_stats(self, request: Request) -> Response:
        """The journal's counts (:func:`hybridq.stats`) with the server's capacity."""
        del request
        try:
            out = await asyncio.to_thread(
                stats, self.journal, redis_url=self.config.redis_url, outbox=None, redis_for=None
            )
        except (HybridqError, OSError) as exc:
            return error(503, "journal_unavailable", str(exc))
        return JSONResponse(stats_body(out, self.config.capacity))

    async def get_metrics(self, request: Request) -> Response:
        """The Prometheus text exposition."""
        del request
        if self._stats_registry is None:
            from hybridq.http.metrics import StatsCollector  # noqa: PLC0415

            self._stats_registry = CollectorRegistry()
            self._stats_registry.register(StatsCollector(self, journal=self.registry is None))
            if self.registry is None and self.config.redis_url is not None:
                from hybridq.http.metrics import FleetCollector  # noqa: PLC0415

                # Every forwarder publishing to that Redis (status --all), labelled per journal.
                self._stats_registry.register(FleetCollector(self.config.redis_url))
        registries = [r for r in (self.registry, self._stats_registry) if r is not None]
        texts = await asyncio.to_thread(lambda: [generate_latest(r) for r in registries])
        return Response(b"".join(texts), media_type=CONTENT_TYPE_LATEST)

    async def healthz(self, request: Request) -> Response:
        """Liveness: the process answers (no auth, no disk), and its node name."""
        del request
        return self._answer({"ok": True, "node": self.node})
