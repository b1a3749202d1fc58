"""What ``hybridq serve``'s API answers (docs/http.md): a job's state, the stats, errors, body checks.

Kept apart from :mod:`hybridq.http.api` (the routes): the shapes of the JSON it sends, its
error answers, and the checks of a POST's type, ``retry`` and record size.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hybridq.envelope.model import Envelope, Retry
from hybridq.envelope.tagged import encode
from hybridq.errors import BadRequest, Forbidden, NoSuchTask, NotAllowed, RecordTooLarge, ResultNotKept
from hybridq.job import Job
from hybridq.journal import MAX_PAYLOAD_BYTES
from hybridq.security import allow

__all__ = [
    "MAX_CHECKED_TASKS",
    "Forbidden",
    "TaskCheck",
    "check_size",
    "error",
    "job_state",
    "json_only",
    "retry_of",
    "stats_body",
]


def error(
    status: int, error: str, detail: str, headers: dict[str, str] | None = None, **more: Any
) -> JSONResponse:
    """The API's error answer: ``{"error": error, "detail": detail, **more}`` (docs/http.md)."""
    return JSONResponse({"error": error, "detail": detail, **more}, status_code=status, headers=headers)


def json_only(request: Request) -> Response | None:
    """The 415 for a POST that is not ``Content-Type: application/json``.

    A cross-site form or ``no-cors`` fetch cannot send that type without a CORS preflight, which
    this server never grants: so no page a browser on the node's network visits can POST here.
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        return error(415, "unsupported_media_type", "send the body as Content-Type: application/json")
    return None


def check_size(env: Envelope) -> None:
    """Raise :class:`RecordTooLarge` for a job whose record the journal would refuse (a 413)."""
    size = len(env.to_bytes())  # checked before anything is written, as the journal checks it
    if size > MAX_PAYLOAD_BYTES:
        raise RecordTooLarge(size, MAX_PAYLOAD_BYTES)


def retry_of(value: Any) -> Retry | None:
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
            out["result"] = encode(job.result)[0]  # tagged again, as the request's arguments
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


#: Task paths remembered as checked (:meth:`TaskCheck.check`); past it, checked at every POST.
MAX_CHECKED_TASKS = 4096


class TaskCheck:
    """The tasks a ``POST /v1/jobs`` may name, with the server's ``--allow`` prefixes."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        #: Task paths :meth:`check` found runnable (a bounded cache).
        self._checked: set[str] = set()

    def check(self, path: str) -> None:
        """Refuse (400) a task the server can tell no worker would run; else leave it to them.

        Where its module is imported here (``--import``, a registered task), the name must exist
        and pass the workers' own rules (:func:`hybridq.security.allow.resolve`, with this server's
        prefixes): a typo, or a class whose call runs another module's constructor, would only
        fail on a worker, or wait there for good. Nothing is imported for the check.
        """
        if path in self._checked:
            return
        try:
            if not allow.check_name(path):
                return  # no module of it here: the workers decide
            allow.resolve(path, self.prefixes)
        except (NoSuchTask, NotAllowed) as exc:
            raise BadRequest(str(exc)) from None
        if len(self._checked) < MAX_CHECKED_TASKS:
            self._checked.add(path)

    def allowed(self, path: str) -> bool:
        """Whether a POST may name ``path``: a registered task, or one under ``--allow``."""
        if allow.allowed(path):
            return True
        return any(p in ("*", path) or path.startswith(p + ".") for p in self.prefixes)
