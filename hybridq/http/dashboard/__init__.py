"""The dashboard under ``/`` (docs/http.md): queues, recent jobs, failed jobs with requeue, traces."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import Route

from hybridq.http.dashboard.pages import Pages

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from hybridq.http.config import ServeConfig

__all__ = ["routes"]


def routes(config: ServeConfig) -> list[BaseRoute]:
    """The dashboard's routes, mounted by the server's application.

    ``GET /`` (overview), ``GET /failed``, ``POST /failed/requeue`` (CSRF-protected),
    ``GET /jobs`` (the recent jobs; ``?id=``: the search box), ``GET /jobs/{job_id}`` (the trace) and
    ``GET /_dashboard/{name}`` (its script and stylesheet).
    """
    pages = Pages(config)
    return [
        Route("/", pages.overview, methods=["GET"], name="dashboard"),
        Route("/failed", pages.failed, methods=["GET"], name="dashboard_failed"),
        Route("/failed/requeue", pages.requeue, methods=["POST"], name="dashboard_requeue"),
        Route("/jobs", pages.search, methods=["GET"], name="dashboard_search"),
        Route("/jobs/{job_id:str}", pages.job, methods=["GET"], name="dashboard_job"),
        Route("/_dashboard/{name:str}", pages.static, methods=["GET"], name="dashboard_static"),
    ]
