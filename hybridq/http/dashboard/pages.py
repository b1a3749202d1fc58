"""The dashboard's pages: overview, recent jobs, failed jobs (with requeue), one job's trace.

Plain (sync) endpoints: Starlette runs them in its thread pool, so the journal and ledger reads
never block the event loop. The POST is CSRF-protected (:mod:`hybridq.http.dashboard.csrf`).

The ledger is read incrementally, once per server (:class:`LedgerView`), and one page is built at
a time: a render holds the GIL, and pages piling up (several tabs on a big journal) would starve
the API served by the same process. A page that cannot start within ``HEAVY_WAIT_S`` gets 503
with ``Retry-After``.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from hybridq.errors import HybridqError, JobNotFailed
from hybridq.http.config import ServeConfig
from hybridq.http.dashboard import csrf
from hybridq.http.dashboard.fleet_view import fleet_section
from hybridq.http.dashboard.jobs_list import recent_jobs
from hybridq.http.dashboard.ledger_view import LedgerView
from hybridq.http.dashboard.render import (
    age,
    as_json,
    error_cell,
    esc,
    job_link,
    page,
    page_number,
    pager,
    table,
    url_id,
    when,
)
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ops.failures import requeue
from hybridq.ops.status import stats
from hybridq.ops.trace import Trace, job_trace

__all__ = ["Pages"]

_STATIC = Path(__file__).parent / "static"
_STATIC_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_HEADERS = {
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
#: Failed jobs per page of ``/failed``.
PER_PAGE = 50
#: How long a page waits for the one before it to be built, before answering 503 (seconds).
HEAVY_WAIT_S = 2.0
#: A ``stats()`` that had to scan (no forwarder snapshot) is reused for this many times its cost.
STATS_REUSE = 10.0


class Pages:
    """The dashboard's endpoints over one server's configuration."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.journal = str(config.journal)
        self.view = LedgerView(self.journal, WINDOW_S)
        self._heavy = threading.BoundedSemaphore(1)
        self._stats: tuple[float, float, dict[str, Any]] | None = None  # (when, cost, figures)

    # -- responses ---------------------------------------------------------------------------

    def _html(
        self, request: Request, title: str, body: str, *, status: int = 200, sid: str | None = None, **kw: Any
    ) -> Response:
        """A page; sets the session cookie if the browser has none (``sid``: the one its forms use)."""
        known, new = csrf.session(request)
        response = HTMLResponse(page(title, body, **kw), status_code=status, headers=_HEADERS)
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

    def _guarded(self, request: Request, title: str, build: Callable[[str], str], **kw: Any) -> Response:
        """A page whose body ``build(session id)`` makes; a journal that cannot be read: 503.

        One page is built at a time; one that waited ``HEAVY_WAIT_S`` for its turn: 503.
        """
        sid, _ = csrf.session(request)
        if not self._heavy.acquire(timeout=HEAVY_WAIT_S):
            return _busy()
        try:
            body = build(sid)
        except (HybridqError, OSError) as exc:
            return self._html(request, "Unavailable", f'<p class="error">{esc(exc)}</p>', status=503, sid=sid)
        finally:
            self._heavy.release()
        return self._html(request, title, body, sid=sid, **kw)

    # -- overview ----------------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        """Queues: pending, oldest pending age, throughput, capacity; the forwarder's figures."""
        return self._guarded(request, "Overview", lambda _: self._overview(), active="/", refresh=True)

    def _figures(self) -> dict[str, Any]:
        """``stats()``; one that had to scan (no forwarder snapshot) is reused a while."""
        now = time.monotonic()
        if self._stats is not None and now - self._stats[0] < self._stats[1] * STATS_REUSE:
            return self._stats[2]
        s = stats(self.journal, redis_url=None, outbox=None, redis_for=None)  # the journal only
        self._stats = (now, time.monotonic() - now, s)
        return s

    def _overview(self) -> str:
        s = self._figures()
        recent = self.view.recent()
        capacity = getattr(self.config, "capacity", None)
        queues = sorted(set(s.get("queues", {})) | set(recent))
        rows = []
        for name in queues:
            done = recent.get(name, {})
            ok, bad = done.get("succeeded", 0), done.get("failed", 0)
            rows.append(
                [
                    f'<span class="queue">{esc(name)}</span>',
                    esc(s.get("queues", {}).get(name, 0)),
                    esc(ok),
                    esc(bad),
                    esc(f"{(ok + bad) / (WINDOW_S / 60):.1f}"),
                ]
            )
        queue_table = table(
            ["queue", "pending", "succeeded (5 min)", "failed (5 min)", "jobs / min"], rows, cls="queues"
        )
        forwarder = s.get("forwarder")
        cards = [
            ("accepted", s.get("accepted")),
            ("pending", s.get("pending")),
            ("capacity", "unbounded" if capacity is None else f"{s.get('pending', 0)} / {capacity}"),
            ("oldest pending", age(s.get("oldest_pending_age_s"))),
            ("forwarded", s.get("forwarded")),
            ("forwarding lag", age(s.get("forwarding_lag_s"))),
            ("succeeded", s.get("succeeded")),
            ("failed", s.get("failed")),
            ("retrying", s.get("retrying")),
            ("failed (listed)", s.get("failed_listed")),
            ("cancelled", s.get("cancelled")),
            ("forwarder", "not running" if forwarder is None else forwarder),
        ]
        card_html = "".join(
            f'<div class="card" data-name="{esc(k)}"><div class="k">{esc(k)}</div>'
            f'<div class="v">{esc(v)}</div></div>'
            for k, v in cards
        )
        fleet = "" if self.config.redis_url is None else fleet_section(self.config.redis_url)
        return f'<section class="cards">{card_html}</section><h2>Queues</h2>{queue_table}{fleet}'

    # -- failed jobs -------------------------------------------------------------------------

    def failed(self, request: Request) -> Response:
        """Jobs that failed for good (``hybridq failed list``), each with a requeue button."""
        done = request.query_params.get("requeued")
        at = page_number(request.query_params.get("page"))
        return self._guarded(
            request, "Failed jobs", lambda sid: self._failed(sid, done, at), active="/failed"
        )

    def _failed(self, sid: str, requeued: str | None, at: int = 1) -> str:
        token = csrf.token(self.journal, sid)
        everyone = self.view.failed()
        pages = max(1, -(-len(everyone) // PER_PAGE))
        at = min(at, pages)
        shown = everyone[::-1][(at - 1) * PER_PAGE : at * PER_PAGE]  # newest first
        rows = []
        for job in shown:
            env = job.envelope
            call = as_json({"args": list(env.args), "kwargs": dict(env.kwargs)}) if env is not None else "-"
            button = (
                f'<form method="post" action="/failed/requeue">'
                f'<input type="hidden" name="{csrf.FIELD}" value="{esc(token)}">'
                f'<input type="hidden" name="job_id" value="{esc(job.id)}">'
                f'<button type="submit" class="requeue" data-job="{esc(job.id)}">Requeue</button></form>'
                if env is not None
                else "cannot be requeued"
            )
            rows.append(
                [
                    job_link(job.id),
                    esc(job.queue or "-"),
                    esc(job.func or "-"),
                    f"<code>{esc(call[:300])}</code>",
                    esc(job.attempts),
                    esc(when(job.failed_at)),
                    error_cell(job.error),
                    button,
                ]
            )
        note = ""
        if requeued and self.view.was_requeued(requeued):  # not any text a link may carry
            note = (
                f'<p class="flash">Requeued <a href="/jobs/{esc(url_id(requeued))}">{esc(requeued)}</a>: '
                "accepted again, it runs with its attempts starting over.</p>"
            )
        if not rows:
            return note + '<p class="empty">No job failed for good.</p>'
        headers = ["job", "queue", "task", "call", "attempts", "failed at (UTC)", "error", ""]
        return (
            note
            + pager("/failed", len(everyone), at, pages, "failed jobs")
            + table(headers, rows, cls="failed")
        )

    async def requeue(self, request: Request) -> Response:
        """POST: requeue one listed failure (what ``hybridq failed requeue ID`` does); 403 without CSRF."""
        declared = request.headers.get("content-length")
        if declared is not None and (
            not (declared.isascii() and declared.isdigit()) or int(declared) > self.config.max_body
        ):
            return HTMLResponse("request too large", status_code=413, headers=_HEADERS)
        raw = bytearray()
        async for chunk in request.stream():  # capped while read (a chunked body has no length)
            raw += chunk
            if len(raw) > self.config.max_body:
                return HTMLResponse("request too large", status_code=413, headers=_HEADERS)
        form = {k: v[0] for k, v in urllib.parse.parse_qs(raw.decode(errors="replace")).items()}
        try:
            allowed = await run_in_threadpool(csrf.allowed, self.journal, request, form)
        except OSError as exc:
            return _unavailable(exc)
        if not allowed:
            return HTMLResponse(
                page(
                    "Forbidden",
                    '<p class="error">Missing or invalid CSRF token: reload the page and try again.</p>',
                ),
                status_code=403,
                headers=_HEADERS,
            )
        job_id = form.get("job_id", "")
        try:
            await run_in_threadpool(lambda: requeue([job_id], self.journal, failed=self.view.failed))
        except JobNotFailed:
            return HTMLResponse(
                page("Not requeued", f'<p class="error">{esc(job_id)} is not a listed failure.</p>'),
                status_code=409,
                headers=_HEADERS,
            )
        except (HybridqError, OSError) as exc:
            return _unavailable(exc)
        return RedirectResponse(f"/failed?requeued={urllib.parse.quote(job_id)}", status_code=303)

    # -- one job's trace ---------------------------------------------------------------------

    def search(self, request: Request) -> Response:
        """``/jobs``: the recent jobs (:mod:`~hybridq.http.dashboard.jobs_list`).

        The search box's ``/jobs?id=...`` goes to that job's trace.
        """
        job_id = request.query_params.get("id", "").strip()
        if job_id:
            return RedirectResponse(f"/jobs/{url_id(job_id)}", status_code=303)
        at = page_number(request.query_params.get("page"))
        return self._guarded(request, "Jobs", lambda _: recent_jobs(self.journal, at), active="/jobs")

    def job(self, request: Request) -> Response:
        """One job's trace, from the journal, the checkpoint and the ledger (Redis: a side box)."""
        job_id = request.path_params["job_id"]
        found: list[Trace] = []

        def build(_: str) -> str:
            trace = job_trace(self.journal, job_id, self.view.entries(job_id))
            if trace is None:
                return ""
            found.append(trace)
            return self._trace(trace)

        response = self._guarded(request, f"Job {job_id}", build, search=job_id)
        if response.status_code == 200 and not found:
            return self._html(
                request,
                "Unknown job",
                f'<p class="error">No job with id <code>{esc(job_id)}</code> in this journal.</p>',
                status=404,
                search=job_id,
            )
        return response

    def _trace(self, trace: Trace) -> str:
        gone = "not kept (its journal segment was compacted)"
        summary = [
            ("status", trace.status),
            ("task", trace.func or "-"),
            ("queue", trace.queue or "-"),
            ("attempts", trace.attempts),
            ("args", as_json(list(trace.args)) if trace.args_known else gone),
            ("kwargs", as_json(trace.kwargs) if trace.args_known else gone),
        ]
        if trace.result_note is None or trace.status == "succeeded":
            summary.append(
                ("result", as_json(trace.result) if trace.result_note is None else trace.result_note)
            )
        summary.append(("epoch generation now", trace.generation))
        dl = "".join(f'<dt>{esc(k)}</dt><dd class="{esc(k)}"><code>{esc(v)}</code></dd>' for k, v in summary)
        steps = []
        for step in trace.steps:
            details = "".join(f"<span><b>{esc(k)}</b> {esc(v)}</span>" for k, v in step.details)
            reason = f'<div class="reason">{esc(step.reason)}</div>' if step.reason else ""
            steps.append(
                f'<li class="step step-{esc(step.kind)}" data-kind="{esc(step.kind)}">'
                f'<span class="kind">{esc(step.kind)}</span> <time>{esc(when(step.at))}</time> '
                f'<span class="title">{esc(step.title)}</span>{reason}'
                f'<div class="details">{details}</div><span class="source">{esc(step.source)}</span></li>'
            )
        body = f'<dl class="summary">{dl}</dl><h2>Trace</h2><ol class="trace">{"".join(steps)}</ol>'
        return body + self._redis_box(trace)

    def _redis_box(self, trace: Trace) -> str:
        url = self.config.redis_url
        if url is None:
            return ""
        from hybridq.http.dashboard.live import redis_view  # noqa: PLC0415 - only with a Redis

        env = next((a.envelope for a in reversed(trace.acceptances) if a.envelope is not None), None)
        checkpoint = load_checkpoint(self.journal)
        view = redis_view(
            url, trace.job_id, env.key_id if env else None, checkpoint.owner if checkpoint else None
        )
        if view is None:
            return (
                '<h2>In Redis now</h2><p class="redis down">'
                "Redis does not answer: the trace above is complete without it.</p>"
            )
        rows = [[esc(k), f"<code>{esc(v)}</code>"] for k, v in view.items()]
        note = "<p>Redis's side only (lost on a flush; the trace above does not need it).</p>"
        return f"<h2>In Redis now</h2>{note}{table(['', ''], rows, cls='redis')}"

    # -- static files ------------------------------------------------------------------------

    def static(self, request: Request) -> Response:
        """The dashboard's own script and stylesheet (nothing else is served)."""
        name = request.path_params["name"]
        media = _STATIC_TYPES.get(name)
        if media is None:
            return Response("not found", status_code=404)
        return FileResponse(_STATIC / name, media_type=media, headers={"Cache-Control": "max-age=300"})


def _busy() -> Response:
    """503: another page is being built (the client tries again after ``Retry-After``)."""
    body = page("Busy", '<p class="error">Another page is being built: try again in a moment.</p>')
    return HTMLResponse(body, status_code=503, headers={**_HEADERS, "Retry-After": "2"})


def _unavailable(exc: BaseException) -> Response:
    return HTMLResponse(
        page("Unavailable", f'<p class="error">{esc(exc)}</p>'), status_code=503, headers=_HEADERS
    )
