"""The dashboard's pages: overview, recent jobs and search, one job's trace; the shared responses.

Plain (sync) endpoints: Starlette runs them in its thread pool, so the journal and ledger reads
never block the event loop. The POSTs are CSRF-protected (:mod:`hybridq.http.dashboard.csrf`).
Every page is a Jinja2 template (:mod:`hybridq.http.dashboard.templating`, autoescape on).

The ledger is read incrementally, once per server (:class:`LedgerView`), and one page is built at
a time: a render holds the GIL, and pages piling up (several tabs on a big journal) would starve
the API served by the same process. A page that cannot start within ``HEAVY_WAIT_S`` gets 503
with ``Retry-After``.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from hybridq.errors import HybridqError
from hybridq.http.config import ServeConfig
from hybridq.http.dashboard import csrf
from hybridq.http.dashboard.filters import MAX_TEXT
from hybridq.http.dashboard.fleet_view import fleet_section
from hybridq.http.dashboard.jobs_list import STATUSES, recent_jobs
from hybridq.http.dashboard.ledger_view import LedgerView
from hybridq.http.dashboard.templating import page_number, render, url_id
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ops.status import stats
from hybridq.ops.trace import Trace, job_trace
from hybridq.workflows.canvas import ANCHOR_FUNC, step_id
from hybridq.workflows.store import steps_of

__all__ = ["HEADERS", "Pages"]

_STATIC = Path(__file__).parent / "static"
_STATIC_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
#: Every dashboard response's headers. The chart is inline SVG drawn by the server: it needs
#: no script and no inline style (its colours are classes of dashboard.css), so the policy stays.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",  # what frame-ancestors says, for browsers without CSP 2
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
#: The throughput window (seconds).
WINDOW_S = 300.0
#: How long a page waits for the one before it to be built, before answering 503 (seconds).
HEAVY_WAIT_S = 2.0
#: A ``stats()`` that had to scan (no forwarder snapshot) is reused for this many times its cost.
STATS_REUSE = 10.0
#: A page's body: the template, and what it is filled with.
Body = tuple[str, Mapping[str, Any]]


def message(title: str, text: str, *, status: int, **extra: Any) -> Response:
    """A page that only says ``text`` (an error), with the dashboard's headers."""
    body = render("message.html", title=title, message=text, **extra)
    return HTMLResponse(body, status_code=status, headers=HEADERS)


class Pages:
    """The dashboard's endpoints over one server's configuration, and what its pages share."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.journal = str(config.journal)
        self.view = LedgerView(self.journal, WINDOW_S)
        self._heavy = threading.BoundedSemaphore(1)
        self._stats: tuple[float, float, dict[str, Any]] | None = None  # (when, cost, figures)

    # -- responses ---------------------------------------------------------------------------

    def html(
        self,
        request: Request,
        template: str,
        context: Mapping[str, Any],
        *,
        status: int = 200,
        sid: str | None = None,
    ) -> Response:
        """A page; sets the session cookie if the browser has none (``sid``: the one its forms use)."""
        known, new = csrf.session(request)
        response = HTMLResponse(render(template, **context), status_code=status, headers=HEADERS)
        if new:
            response.set_cookie(
                csrf.COOKIE,
                sid or known,
                httponly=True,
                samesite="strict",
                path="/",
                secure=request.url.scheme == "https",
            )
        return response

    def guarded(self, request: Request, build: Callable[[str], Body], **context: Any) -> Response:
        """A page whose template and values ``build(session id)`` gives; an unreadable journal: 503.

        One page is built at a time; one that waited ``HEAVY_WAIT_S`` for its turn: 503.
        """
        sid, _ = csrf.session(request)

        def page() -> Response:
            try:
                template, values = build(sid)
                return self.html(request, template, {**context, **values}, sid=sid)
            except (HybridqError, OSError) as exc:
                failure = {"title": "Unavailable", "message": str(exc)}
                return self.html(request, "message.html", failure, status=503, sid=sid)

        return self.in_turn(page)

    def in_turn(self, respond: Callable[[], Response]) -> Response:
        """``respond()`` once no other page is being built (a POST that reads as much as a page too).

        One at a time; one that waited ``HEAVY_WAIT_S`` for its turn: 503 Busy, nothing done.
        """
        if not self._heavy.acquire(timeout=HEAVY_WAIT_S):
            return busy()
        try:
            return respond()
        finally:
            self._heavy.release()

    def figures(self) -> dict[str, Any]:
        """``stats()``; one that had to scan (no forwarder snapshot) is reused a while."""
        now = time.monotonic()
        if self._stats is not None and now - self._stats[0] < self._stats[1] * STATS_REUSE:
            return self._stats[2]
        s = stats(self.journal, redis_url=None, outbox=None, redis_for=None)  # the journal only
        self._stats = (now, time.monotonic() - now, s)
        return s

    # -- overview ----------------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        """The forwarder's figures, then the queues' recent throughput: one section each."""
        return self.guarded(request, lambda _: self._overview(), title="Overview", active="/", refresh=True)

    def _overview(self) -> Body:
        """The overview's sections, in order: each a template under ``sections/`` and its values.

        A new section (a fleet of journals, say) is one more entry here and one template.
        """
        s = self.figures()
        sections = [self._cards(s), self._rates(s)]
        if self.config.redis_url is not None:
            sections.append(fleet_section(self.config.redis_url))  # every forwarder on that Redis
        return "overview.html", {"sections": sections}

    def _cards(self, s: Mapping[str, Any]) -> dict[str, Any]:
        capacity = getattr(self.config, "capacity", None)
        forwarder = s.get("forwarder")
        cards = [
            ("accepted", s.get("accepted")),
            ("pending", s.get("pending")),
            ("capacity", "unbounded" if capacity is None else f"{s.get('pending', 0)} / {capacity}"),
            ("oldest pending", ("age", s.get("oldest_pending_age_s"))),
            ("forwarded", s.get("forwarded")),
            ("forwarding lag", ("age", s.get("forwarding_lag_s"))),
            ("succeeded", s.get("succeeded")),
            ("failed", s.get("failed")),
            ("retrying", s.get("retrying")),
            ("failed (listed)", s.get("failed_listed")),
            ("cancelled", s.get("cancelled")),
            ("forwarder", "not running" if forwarder is None else forwarder),
        ]
        return {"template": "sections/cards.html", "cards": cards}

    def _rates(self, s: Mapping[str, Any]) -> dict[str, Any]:
        recent = self.view.recent()
        pending = s.get("queues", {})
        rows = []
        for name in sorted(set(pending) | set(recent)):
            done = recent.get(name, {})
            ok, bad = done.get("succeeded", 0), done.get("failed", 0)
            rows.append((name, pending.get(name, 0), ok, bad, (ok + bad) / (WINDOW_S / 60)))
        return {"template": "sections/rates.html", "rows": rows}

    # -- recent jobs, and the search box -----------------------------------------------------

    def search(self, request: Request) -> Response:
        """``/jobs``: the recent jobs, by task name and status (:mod:`~hybridq.http.dashboard.jobs_list`).

        The search box's ``/jobs?id=...`` goes to that job's trace.
        """
        job_id = request.query_params.get("id", "").strip()
        if job_id:
            return RedirectResponse(f"/jobs/{url_id(job_id)}", status_code=303)
        at = page_number(request.query_params.get("page"))
        task = request.query_params.get("task", "").strip()
        status = request.query_params.get("status", "")
        if status and status not in STATUSES:
            return message(
                "Bad search", f"status is one of {', '.join(STATUSES)}", status=400, active="/jobs"
            )
        if len(task) > MAX_TEXT:
            return message(
                "Bad search", f"task is longer than {MAX_TEXT} characters", status=400, active="/jobs"
            )
        return self.guarded(
            request, lambda _: recent_jobs(self.journal, at, task, status), title="Jobs", active="/jobs"
        )

    # -- one job's trace ---------------------------------------------------------------------

    def job(self, request: Request) -> Response:
        """One job's trace, from the journal, the checkpoint and the ledger (Redis: a side box)."""
        job_id = request.path_params["job_id"]
        found: list[Trace] = []

        def build(_: str) -> Body:
            trace = job_trace(self.journal, job_id, self.view.entries(job_id))
            if trace is None:
                return "message.html", {"message": ""}  # not sent: the 404 below is
            found.append(trace)
            flow = steps_of(self.journal, job_id, step_id) if trace.func == ANCHOR_FUNC else []
            return "job.html", {"trace": trace, "redis": self._redis_box(trace), "flow": flow}

        response = self.guarded(request, build, title=f"Job {job_id}", search=job_id)
        if response.status_code == 200 and not found:
            unknown = {
                "title": "Unknown job",
                "message": "No job with id",
                "code": job_id,
                "after": " in this journal.",
                "search": job_id,
            }
            return self.html(request, "message.html", unknown, status=404)
        return response

    def _redis_box(self, trace: Trace) -> dict[str, str] | None:
        """What Redis holds of the job now (``{}``: Redis does not answer; ``None``: no Redis)."""
        url = self.config.redis_url
        if url is None:
            return None
        from hybridq.http.dashboard.live import redis_view  # noqa: PLC0415 - only with a Redis

        env = next((a.envelope for a in reversed(trace.acceptances) if a.envelope is not None), None)
        checkpoint = load_checkpoint(self.journal)
        view = redis_view(
            url, trace.job_id, env.key_id if env else None, checkpoint.owner if checkpoint else None
        )
        return {} if view is None else view

    # -- static files ------------------------------------------------------------------------

    def static(self, request: Request) -> Response:
        """The dashboard's own script and stylesheet (nothing else is served)."""
        name = request.path_params["name"]
        media = _STATIC_TYPES.get(name)
        if media is None:
            return Response("not found", status_code=404)
        return FileResponse(_STATIC / name, media_type=media, headers={"Cache-Control": "max-age=300"})


def busy() -> Response:
    """503: another page is being built (the client tries again after ``Retry-After``)."""
    reply = message("Busy", "Another page is being built: try again in a moment.", status=503)
    reply.headers["Retry-After"] = "2"
    return reply


def unavailable(exc: BaseException) -> Response:
    """503: the journal (or the ledger) cannot be read or written now."""
    return message("Unavailable", str(exc), status=503)


def redirect(path: str, **query: str) -> Response:
    """303 to a dashboard ``path`` with ``query``."""
    return RedirectResponse(f"{path}?{urllib.parse.urlencode(query)}" if query else path, status_code=303)
