"""A small web API on hybridq: ``POST /jobs`` enqueues, ``GET /jobs/{id}`` reports from durable state.

Run it with ``run.py`` (a private Redis, the forwarder, a worker and this app), or by hand:
``HYBRIDQ_JOURNAL=/path/to/journal uvicorn app:app`` from this directory. It is a Starlette app;
FastAPI handlers would make the same calls.

* ``POST /jobs`` with ``{"text": "..."}``: ``await queue.enqueue_async(...)``, which returns once
  the job is durable in the journal without blocking the event loop (other requests keep being
  served while it waits for its fsync, and concurrent requests share fsyncs). Answers
  ``202 Accepted`` with the job id and a ``Location`` header. An ``Idempotency-Key`` header is
  passed on as the job's idempotency key: a client that retries a POST whose answer it lost gets
  one run, not two (docs/enqueue.md, "Enqueue-if-absent").
* ``GET /jobs/{id}``: the job's status and result, read with ``hybridq.fetch_job`` from the
  journal directory (the forwarder's lookup index and ledger on disk), never from Redis, so it
  answers while Redis is down; ``404`` for an unknown id.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import hybridq
import textjobs
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

#: The journal comes from $HYBRIDQ_JOURNAL (run.py sets it). The worker serves the queue "web".
queue = hybridq.Queue("web")

#: Longest accepted text (a job's record must stay well under hybridq's 1 MiB limit).
MAX_TEXT = 100_000


async def create_job(request: Request) -> JSONResponse:
    """``POST /jobs``: validate, enqueue (durably, off the loop), answer 202 with where to look."""
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return JSONResponse({"error": "the body must be JSON"}, status_code=400)
    text = body.get("text") if isinstance(body, dict) else None
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        return JSONResponse(
            {"error": f'give {{"text": "..."}} (at most {MAX_TEXT} characters)'}, status_code=400
        )
    key = request.headers.get("idempotency-key") or None
    try:
        job = await queue.enqueue_async(textjobs.word_count, text, idempotency_key=key)
    except hybridq.QueueFull:
        return JSONResponse({"error": "too many jobs pending"}, status_code=503, headers={"Retry-After": "5"})
    location = f"/jobs/{job.id}"
    return JSONResponse(
        {"id": job.id, "status_url": location}, status_code=202, headers={"Location": location}
    )


async def get_job(request: Request) -> JSONResponse:
    """``GET /jobs/{id}``: the job's durable status (the lookup reads files: run off the loop)."""
    state = await asyncio.to_thread(job_state, request.path_params["job_id"])
    if state is None:
        return JSONResponse({"error": "no such job"}, status_code=404)
    return JSONResponse(state)


# -- the lookup by id ---------------------------------------------------------------------------


def job_state(job_id: str) -> dict[str, Any] | None:
    """The job's id, status and result, or ``None`` for an unknown id (docs/api.md, "Looking a job up").

    ``hybridq.fetch_job`` reads the forwarder's lookup index (one row), not Redis: the result
    is the task's return value as the ledger keeps it (``None`` until the job has finished).
    """
    job = hybridq.fetch_job(job_id, journal=queue.journal)
    if job is None:
        return None
    state: dict[str, Any] = {"id": job.id, "status": job.status, "result": None}
    if state["status"] == "finished":
        try:
            state["result"] = job.result
        except hybridq.ResultNotKept as exc:  # over the 64 KiB cap, or an older worker's
            state["result_not_kept"] = exc.reason
    elif state["status"] in ("failed", "retrying"):
        state["error"] = job.exc_info
    return state


app = Starlette(
    routes=[
        Route("/jobs", create_job, methods=["POST"]),
        Route("/jobs/{job_id}", get_job, methods=["GET"]),
    ]
)
