"""The API of ``hybridq serve`` (docs/http.md): enqueue over HTTP, look jobs up, stats, metrics.

* ``POST /v1/jobs`` validates the body, builds the job's envelope with :meth:`Queue.prepare`
  and commits it with ``enqueue_many_async`` on one committer queue for the whole server, so
  concurrent POSTs share the journal's group commits (one fsync for all) and the event loop
  never waits for the disk. It answers ``202`` only once the job is durable.
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
import dataclasses
import json
import logging
import math
from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from hybridq.envelope.model import Envelope, Retry, function_path, validate_job_id, validate_queue_name
from hybridq.errors import (
    BadRequest,
    EnvelopeError,
    HybridqError,
    JournalIOError,
    NoSuchTask,
    NotAllowed,
    QueueFull,
    RecordTooLarge,
    ResultNotKept,
)
from hybridq.http.body import BodyTimeout, BodyTooLarge, read_body
from hybridq.http.config import ServeConfig
from hybridq.http.idempotency import KeyReused, KeyStore, fingerprint, key_job_id, valid_key
from hybridq.job import Job, fetch_job
from hybridq.journal import MAX_PAYLOAD_BYTES
from hybridq.ops.status import stats
from hybridq.producer.queue import Queue
from hybridq.security import allow

__all__ = ["FIELDS", "Api", "BodyTooLarge"]

log = logging.getLogger("hybridq.http")

#: The fields of a ``POST /v1/jobs`` body (the contract: docs/http.md).
FIELDS = frozenset({"task", "args", "kwargs", "queue", "delay", "retry"})
#: Task paths remembered as checked (:meth:`Api._check_task`); past it, checked at every POST.
MAX_CHECKED_TASKS = 4096


def _error(status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number")


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
        #: POST outcomes by status code, for /metrics.
        self.posts: Counter[int] = Counter()
        self.registry = registry
        self._stats_registry: CollectorRegistry | None = None
        #: Task paths :meth:`_check_task` found runnable (a bounded cache).
        self._tasks_checked: set[str] = set()

    def routes(self) -> list[BaseRoute]:
        """The API's routes."""
        return [
            Route("/v1/jobs", self.post_job, methods=["POST"]),
            Route("/v1/jobs/{job_id}", self.get_job, methods=["GET"]),
            Route("/v1/stats", self.get_stats, methods=["GET"]),
            Route("/metrics", self.get_metrics, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
        ]

    # -- POST /v1/jobs ------------------------------------------------------------------------

    async def post_job(self, request: Request) -> Response:
        """Enqueue one job; 202 once it is durable (see docs/http.md for every answer)."""
        response = await self._post(request)
        self.posts[response.status_code] += 1
        return response

    async def _post(self, request: Request) -> Response:
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            return _error(415, "unsupported_media_type", "send the body as Content-Type: application/json")
        key = request.headers.get("idempotency-key")
        if key is not None and not valid_key(key):
            return _error(400, "bad_idempotency_key", "Idempotency-Key: 1-255 printable ASCII characters")
        scope = str(getattr(request.state, "token_scope", ""))  # whose key: the token's (auth.py)
        try:
            env = self._envelope(await self._body(request), key, scope)
            _check_size(env)
        except BodyTooLarge:
            return _error(413, "too_large", f"the body is over {self.config.max_body} bytes")
        except BodyTimeout:
            return _error(408, "timeout", f"the body did not arrive within {self.config.body_timeout_s:g} s")
        except ClientDisconnect:
            return Response(status_code=400)  # the client is gone: nobody reads it, nothing logged
        except RecordTooLarge as exc:  # a JournalError, but the client's to fix: not a retry
            return _error(413, "too_large", str(exc))
        except (BadRequest, EnvelopeError, NoSuchTask) as exc:  # EnvelopeError: NotSerializable too
            return _error(400, "bad_request", str(exc))
        except HybridqError as exc:  # the journal directory cannot be used (a JournalError)
            return self._unavailable(exc)
        try:
            if key is None:
                job, replay = await self._commit(env), False
            else:
                job, replay = await self._commit_keyed(env)
        except KeyReused as exc:
            return _error(422, "idempotency_key_reused", str(exc))
        except RecordTooLarge as exc:  # signing made it larger; raised before anything is written
            return _error(413, "too_large", str(exc))
        except QueueFull as exc:
            return _error(
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
        return _error(503, "journal_unavailable", detail, {"Retry-After": str(self.config.retry_after_s)})

    async def _body(self, request: Request) -> Any:
        """The JSON body, read up to ``max_body`` (413 as soon as it is over, not after)."""
        raw = await read_body(request, self.config.max_body, self.config.body_timeout_s)
        try:
            return json.loads(raw, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:
            if isinstance(exc, BadRequest):
                raise
            raise BadRequest("the body must be a JSON object") from None

    def _envelope(self, body: Any, key: str | None, scope: str = "") -> Envelope:
        """The job a body asks for, validated (raises :class:`BadRequest` or EnvelopeError)."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise BadRequest(f"unknown field(s): {', '.join(unknown)} (known: {', '.join(sorted(FIELDS))})")
        task = body.get("task")
        if not isinstance(task, str):
            raise BadRequest('"task" must be a string: a registered task or a path under --allow')
        path = function_path(task)  # a dotted path, not in __main__
        if not self._allowed(path):
            raise BadRequest(
                f"task {path!r} is not registered with @hybridq.task in this server nor under "
                "--allow (docs/http.md)"
            )
        self._check_task(path)
        args = body.get("args", [])
        kwargs = body.get("kwargs", {})
        if not isinstance(args, list):
            raise BadRequest('"args" must be a JSON array')
        if not isinstance(kwargs, dict):
            raise BadRequest('"kwargs" must be a JSON object')
        queue = body.get("queue", "default")
        if not isinstance(queue, str):
            raise BadRequest('"queue" must be a string')
        delay = body.get("delay")
        if delay is not None and (
            isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay)
        ):
            raise BadRequest('"delay" must be a number of seconds')
        env = self.committer.prepare(
            path,
            args,
            kwargs,
            # Scoped like the id: the forwarder merges jobs of one key, and two tokens' keys differ.
            idempotency_key=key if key is None or not scope else f"token-{scope[:16]}:{key}",
            job_id=None if key is None else key_job_id(key, scope),
            delay=delay,
            retry=_retry(body.get("retry")),
        )
        # One validated path for every queue name (no Queue object per name: its checks are
        # the name's, the rest are the committer's defaults).
        if queue != env.queue:
            env = dataclasses.replace(env, queue=validate_queue_name(queue))  # encoded again
        return env

    def _check_task(self, path: str) -> None:
        """Refuse (400) a task the server can tell no worker would run; else leave it to them.

        Where its module is imported here (``--import``, a registered task), the name must exist
        and pass the workers' own rules (:func:`hybridq.security.allow.resolve`, with this server's
        prefixes): a typo, or a class whose call runs another module's constructor, would only
        fail on a worker, or wait there for good. Nothing is imported for the check.
        """
        if path in self._tasks_checked:
            return
        try:
            if not allow.check_name(path):
                return  # no module of it here: the workers decide
            allow.resolve(path, self.config.allow)
        except (NoSuchTask, NotAllowed) as exc:
            raise BadRequest(str(exc)) from None
        if len(self._tasks_checked) < MAX_CHECKED_TASKS:
            self._tasks_checked.add(path)

    def _allowed(self, path: str) -> bool:
        if allow.allowed(path):
            return True
        return any(p in ("*", path) or path.startswith(p + ".") for p in self.config.allow)

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
        """A job's status, attempt, result or error; 404 for an unknown id."""
        job_id = request.path_params["job_id"]
        try:
            validate_job_id(job_id)
        except EnvelopeError:
            return _error(404, "not_found", "no job with this id")
        try:
            state = await asyncio.to_thread(self._job_state, job_id)
        except (HybridqError, OSError) as exc:
            return _error(503, "journal_unavailable", str(exc))
        if state is None:
            return _error(404, "not_found", "no job with this id")
        return JSONResponse(state)

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
            return _error(503, "journal_unavailable", str(exc))
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
        """Liveness: the process answers (no auth, no disk)."""
        del request
        return JSONResponse({"ok": True})


def _check_size(env: Envelope) -> None:
    """Raise :class:`RecordTooLarge` for a job whose record the journal would refuse (a 413)."""
    size = len(env.to_bytes())  # checked before anything is written, as the journal checks it
    if size > MAX_PAYLOAD_BYTES:
        raise RecordTooLarge(size, MAX_PAYLOAD_BYTES)


def _retry(value: Any) -> Retry | None:
    """``retry``: a number of attempts, or ``{"max_attempts", "backoff", "backoff_max", "jitter"}``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadRequest('"retry" must be a number of attempts or an object')
    if isinstance(value, int):
        return Retry(max_attempts=value)
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"max_attempts", "backoff", "backoff_max", "jitter"})
        if unknown:
            raise BadRequest(f'"retry": unknown field(s) {", ".join(unknown)}')
        try:
            return Retry.from_json(value)
        except (TypeError, KeyError) as exc:
            raise BadRequest(f'"retry": {exc}') from None
    raise BadRequest('"retry" must be a number of attempts or an object')


def job_state(job: Job) -> dict[str, Any]:
    """What ``GET /v1/jobs/{id}`` answers for ``job``."""
    status = job.status
    env = job.envelope
    out: dict[str, Any] = {
        "id": job.id,
        "status": status,
        "attempt": job.attempt,
        "task": env.func,
        "queue": env.queue,
        "enqueued_at": job.enqueued_at,
        "started_at": job.started_at,
        "ended_at": job.ended_at,
    }
    if status == "finished":
        try:
            out["result"] = job.result
        except ResultNotKept as exc:
            out["result"] = None
            out["result_not_kept"] = exc.reason
    elif status in ("failed", "retrying", "merged"):
        out["error"] = job.exc_info
    return out


def stats_body(out: dict[str, Any], capacity: int | None) -> dict[str, Any]:
    """``GET /v1/stats``: :func:`hybridq.stats`'s object, with ``queued`` and ``capacity``.

    Without the journal's path and the Redis URL (its user, host and port): a token lets its
    holder enqueue and read jobs, not learn where the server's files and Redis are.
    """
    body = dict(out)
    if isinstance(body.get("journal"), dict):
        body["journal"] = {k: v for k, v in body["journal"].items() if k != "path"}
    if isinstance(body.get("redis"), dict):
        body["redis"] = {k: v for k, v in body["redis"].items() if k != "url"}
    body["queued"] = out.get("not_yet_forwarded", 0)
    body["capacity"] = capacity
    body["pending_by_queue"] = out.get("queues", {})
    return body
