"""The dashboard's failed jobs: the list with its filter, one requeue, and bulk requeue or cancel.

Two lists, one filter (:class:`~hybridq.http.dashboard.filters.Filter`: task, error text, time):

* ``failed`` -- jobs that failed for good (``hybridq failed list``, from the ledger): requeue them
  (one, or every one the filter selects);
* ``retrying`` -- jobs whose last attempt failed and that wait for their next one (from the
  lookup index): cancel them (every one the filter selects), so they stop failing.

A bulk action is two POSTs: the first shows how many jobs the filter selects and asks; the
second carries the digest of that selection (:func:`~hybridq.http.dashboard.filters.selection`)
and acts only if the filter still selects the same jobs, at most :data:`BULK_MAX` of them (the
oldest). Both carry the CSRF token of :mod:`hybridq.http.dashboard.csrf`, and the server's token
or session cookie like every request (docs/http.md).
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from hybridq.cancels import REQUESTED, cancel_at
from hybridq.envelope.model import Envelope
from hybridq.errors import BadRequest, HybridqError, JobNotFailed
from hybridq.http.dashboard import csrf
from hybridq.http.dashboard.filters import Filter, selection
from hybridq.http.dashboard.pages import HEADERS, Body, Pages, message, redirect, unavailable
from hybridq.http.dashboard.templating import as_json, page_number, render
from hybridq.lookup.search import retrying
from hybridq.ops.failures import FailedJob, requeue

__all__ = ["BULK_MAX", "PER_PAGE", "FailedPages"]

#: Failed jobs per page of ``/failed``.
PER_PAGE = 50
#: The most jobs one bulk action touches (the oldest selected; the page says how many are left).
BULK_MAX = 1000
#: Per list: the action its bulk form offers.
ACTIONS = {"failed": "requeue", "retrying": "cancel"}


@dataclass(frozen=True, slots=True)
class Listed:
    """One job of either list, as the page and the bulk actions see it."""

    id: str
    queue: str | None
    func: str | None
    attempts: int
    at: float
    error: str | None
    call: str | None  # the failed job's arguments as text (``None``: it cannot be requeued)
    #: The job and where its current run is recorded (what a confirmation's digest covers).
    run: tuple[object, ...]
    loc: tuple[str, int, int]


class FailedPages:
    """``/failed`` and its POSTs, over the dashboard's :class:`~hybridq.http.dashboard.pages.Pages`."""

    def __init__(self, pages: Pages) -> None:
        self.pages = pages
        self.journal = pages.journal

    # -- the lists ---------------------------------------------------------------------------

    def failures(self, chosen: Filter) -> list[Listed]:
        """The jobs that failed for good the filter selects, oldest first, each without its call.

        Their ``call`` is ``""`` for a job that can be requeued (``None``: it cannot), their
        ``error`` ``None``: the arguments and error texts (tracebacks of up to 8 KB) of every
        failure at once were most of a page's peak memory; :meth:`shown` fills both in for the
        page's jobs only.
        """

        def brief(f: FailedJob) -> Listed | None:
            if not chosen.matches(f.func, f.error, f.failed_at):
                return None
            call = None if f.envelope is None else ""
            return Listed(f.id, f.queue, f.func, f.attempts, f.failed_at, None, call, (f.id, *f.loc), f.loc)

        return sorted(self.pages.view.failed_briefly(brief), key=lambda j: j.at)

    def shown(self, jobs: list[Listed]) -> list[Listed]:
        """``jobs`` with their calls and errors, as a page shows them (one requeued since: no call)."""
        now = self.pages.view.failures_at([job.loc for job in jobs])
        return [
            dataclasses.replace(job, call=None)
            if f is None
            else dataclasses.replace(job, call=_call(f.envelope), error=f.error)
            for job, f in zip(jobs, now, strict=True)
        ]

    def _listed(self, job_ids: list[str]) -> Callable[[str], list[FailedJob]]:
        """A requeue's read of the list: only the failures of ``job_ids`` are kept whole."""
        wanted = set(job_ids)
        return lambda _journal: self.pages.view.failed_briefly(lambda f: f if f.id in wanted else None)

    def retrying(
        self, chosen: Filter, *, limit: int, offset: int = 0, oldest_first: bool = False, errors: bool = True
    ) -> tuple[int, list[Listed]]:
        """How many retrying jobs the filter selects, and ``limit`` of them (SQL does the filtering)."""
        got = retrying(
            self.journal,
            task=chosen.task,
            error=chosen.error,
            between=(chosen.since, chosen.until),
            limit=limit,
            offset=offset,
            oldest_first=oldest_first,
            errors=errors,
        )
        total, rows = got if got is not None else (0, [])
        return total, [
            Listed(r.id, r.queue, r.func, r.attempt, r.at, r.error, None, r.run, r.loc) for r in rows
        ]

    def failed(self, request: Request) -> Response:
        """The jobs that failed for good (or, ``?list=retrying``, that are retrying), filtered."""
        params = request.query_params
        kind = params.get("list", "failed")
        if kind not in ACTIONS:
            return message("Bad filter", "list is failed or retrying", status=400, active="/failed")
        try:
            chosen = Filter.parse(params)
        except BadRequest as exc:
            return message("Bad filter", str(exc), status=400, active="/failed")
        at = page_number(params.get("page"))
        done = params.get("requeued")
        return self.pages.guarded(
            request,
            lambda sid: self._failed(sid, kind, chosen, at, done),
            title="Failed jobs",
            active="/failed",
        )

    def _failed(self, sid: str, kind: str, chosen: Filter, at: int, requeued: str | None) -> Body:
        if kind == "failed":
            everyone = self.failures(chosen)
            total, actionable = len(everyone), sum(j.call is not None for j in everyone)
            at = min(at, _pages(total))
            jobs = self.shown(everyone[::-1][(at - 1) * PER_PAGE : at * PER_PAGE])  # newest first
        else:
            total, jobs = self.retrying(chosen, limit=PER_PAGE, offset=(at - 1) * PER_PAGE)
            if at > _pages(total):  # past the last page: the last one
                at = _pages(total)
                total, jobs = self.retrying(chosen, limit=PER_PAGE, offset=(at - 1) * PER_PAGE)
            actionable = total
        return "failed.html", {
            "token": csrf.token(self.journal, sid),
            "kind": kind,
            "action": ACTIONS[kind],
            "filter": chosen.params(),
            "query": {"list": kind if kind != "failed" else "", **chosen.params()},
            "jobs": jobs,
            "total": total,
            "actionable": actionable,
            "bulk_max": BULK_MAX,
            "at": at,
            "pages": _pages(total),
            "requeued": requeued if requeued and self.pages.view.was_requeued(requeued) else None,
        }

    # -- one requeue -------------------------------------------------------------------------

    async def requeue(self, request: Request) -> Response:
        """POST: requeue one listed failure (what ``hybridq failed requeue ID`` does); 403 without CSRF."""
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        job_id = form.get("job_id", "")
        try:
            await run_in_threadpool(lambda: requeue([job_id], self.journal, failed=self._listed([job_id])))
        except JobNotFailed:
            return message("Not requeued", f"{job_id} is not a listed failure.", status=409)
        except (HybridqError, OSError) as exc:
            return unavailable(exc)
        return redirect("/failed", requeued=job_id)

    # -- bulk actions ------------------------------------------------------------------------

    async def bulk(self, request: Request) -> Response:
        """POST: requeue (or cancel) what a filter selects: first the count and a question, then it.

        Built in its turn, one page at a time as every page (503 Busy after ``HEAVY_WAIT_S``).
        """
        form = await self._form(request)
        if isinstance(form, Response):
            return form
        action = form.get("action", "")
        kind = {v: k for k, v in ACTIONS.items()}.get(action)
        if kind is None:
            return message("Bad request", "action is requeue or cancel", status=400, active="/failed")
        try:
            chosen = Filter.parse(form)
        except BadRequest as exc:
            return message("Bad filter", str(exc), status=400, active="/failed")
        sid, _ = csrf.session(request)
        confirm = form.get("confirm", "")
        return await run_in_threadpool(self.pages.in_turn, lambda: self._bulk(sid, kind, chosen, confirm))

    def _selected(self, kind: str, chosen: Filter) -> tuple[int, list[Listed]]:
        """How many jobs a bulk action's filter selects, and the oldest :data:`BULK_MAX` (no error text)."""
        if kind == "retrying":
            return self.retrying(chosen, limit=BULK_MAX, oldest_first=True, errors=False)
        everyone = [j for j in self.failures(chosen) if j.call is not None]
        return len(everyone), everyone[:BULK_MAX]

    def _bulk(self, sid: str, kind: str, chosen: Filter, confirm: str, *, changed: bool = False) -> Response:
        """Ask (no ``confirm``, or one that no longer matches), else act on the selection."""
        try:
            total, acting = self._selected(kind, chosen)
        except (HybridqError, OSError) as exc:
            return unavailable(exc)
        digest = selection(j.run for j in acting)
        if confirm != digest:  # the first POST, or the list changed since the count was shown
            changed = changed or bool(confirm)
            return self._confirm(sid, kind, chosen, total, len(acting), digest, changed=changed)
        try:
            if kind == "failed":
                ids = [j.id for j in acting]
                requeue(ids, self.journal, failed=self._listed(ids))
                acted = len(acting)
            else:
                acted = sum(
                    r.state == REQUESTED for r in cancel_at(((j.id, j.loc) for j in acting), self.journal)
                )
        except JobNotFailed:  # requeued by someone else since the check: nothing was written
            return self._bulk(sid, kind, chosen, "", changed=True)  # the new count, to confirm
        except (HybridqError, OSError) as exc:
            return unavailable(exc)
        return self._page(
            "bulk_done.html",
            title="Requeued" if kind == "failed" else "Cancelled",
            action=ACTIONS[kind],
            acted=acted,
            left=total - len(acting),
            query=urllib.parse.urlencode({"list": kind, **chosen.params()}),
        )

    def _confirm(
        self, sid: str, kind: str, chosen: Filter, total: int, acting: int, digest: str, *, changed: bool
    ) -> Response:
        return self._page(
            "bulk_confirm.html",
            status=409 if changed else 200,
            title="Confirm",
            action=ACTIONS[kind],
            kind=kind,
            filter=chosen.params(),
            total=total,
            acting=acting,
            digest=digest,
            changed=changed,
            token=csrf.token(self.journal, sid),
        )

    @staticmethod
    def _page(template: str, *, status: int = 200, **context: Any) -> Response:
        return HTMLResponse(
            render(template, active="/failed", **context), status_code=status, headers=HEADERS
        )

    # -- the POSTs' bodies -------------------------------------------------------------------

    async def _form(self, request: Request) -> dict[str, str] | Response:
        """The POST's form, if it is small enough and carries a valid CSRF token (else the answer)."""
        limit = self.pages.config.max_body
        declared = request.headers.get("content-length")
        if declared is not None and (
            not (declared.isascii() and declared.isdigit()) or int(declared) > limit
        ):
            return HTMLResponse("request too large", status_code=413, headers=HEADERS)
        raw = bytearray()
        async for chunk in request.stream():  # capped while read (a chunked body has no length)
            raw += chunk
            if len(raw) > limit:
                return HTMLResponse("request too large", status_code=413, headers=HEADERS)
        form = {k: v[0] for k, v in urllib.parse.parse_qs(raw.decode(errors="replace")).items()}
        try:
            allowed = await run_in_threadpool(csrf.allowed, self.journal, request, form)
        except OSError as exc:
            return unavailable(exc)
        if not allowed:
            return message(
                "Forbidden", "Missing or invalid CSRF token: reload the page and try again.", status=403
            )
        return form


def _pages(total: int) -> int:
    return max(1, -(-total // PER_PAGE))


def _call(env: Envelope | None) -> str | None:
    """A failed job's call as text (``None``: no envelope this version accepts: not requeueable)."""
    if env is None:
        return None
    return as_json({"args": list(env.args), "kwargs": dict(env.kwargs)})
