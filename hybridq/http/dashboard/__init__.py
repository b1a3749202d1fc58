"""The dashboard under ``/`` (docs/dashboard.md): overview, queues and the last hour, jobs, failures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import Route

from hybridq.http.dashboard.failed import FailedPages
from hybridq.http.dashboard.pages import Pages
from hybridq.http.dashboard.queues import QueuesPage

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from hybridq.http.config import ServeConfig

__all__ = ["routes"]


def routes(config: ServeConfig) -> list[BaseRoute]:
    """The dashboard's routes, mounted by the server's application.

    ``GET /`` (overview), ``GET /queues`` (per queue, and the last hour's chart), ``GET /failed``
    (with its filter), ``POST /failed/requeue`` and ``POST /failed/bulk`` (CSRF-protected),
    ``GET /jobs`` (the recent jobs, by task and status; ``?id=``: the search box),
    ``GET /jobs/{job_id}`` (the trace) and ``GET /_dashboard/{name}`` (its script and stylesheet).
    """
    pages = Pages(config)
    failed = FailedPages(pages)
    return [
        Route("/", pages.overview, methods=["GET"], name="dashboard"),
        Route("/queues", QueuesPage(pages).queues, methods=["GET"], name="dashboard_queues"),
        Route("/failed", failed.failed, methods=["GET"], name="dashboard_failed"),
        Route("/failed/requeue", failed.requeue, methods=["POST"], name="dashboard_requeue"),
        Route("/failed/bulk", failed.bulk, methods=["POST"], name="dashboard_bulk"),
        Route("/jobs", pages.search, methods=["GET"], name="dashboard_search"),
        Route("/jobs/{job_id:str}", pages.job, methods=["GET"], name="dashboard_job"),
        Route("/_dashboard/{name:str}", pages.static, methods=["GET"], name="dashboard_static"),
    ]
