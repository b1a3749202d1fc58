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
* ``GET /jobs/{id}``: the job's status, read from the journal and the forwarder's ledger on
  disk, never from Redis, so it answers while Redis is down; ``404`` for an unknown id.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import hybridq
import textjobs
from hybridq.envelope import Envelope
from hybridq.journal import JournalReader, RecordId
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
# TO BE REPLACED by hybridq.fetch_job (issue 17 item 1) when it lands: this whole section becomes
#
#     def job_state(job_id: str) -> dict[str, Any] | None:
#         job = hybridq.fetch_job(job_id, journal=queue.journal)
#         if job is None:
#             return None
#         return {"id": job.id, "status": job.status, "result": job.result}
#
# Until then it finds the job's record by reading the whole journal (cost grows with the journal;
# a job whose segment was compacted after it finished is reported unknown) and asks
# Job.get_status(), which reads the forwarder's ledger. No result: the ledger does not keep it yet.


def job_state(job_id: str) -> dict[str, Any] | None:
    """The job's id, status and result (``None`` for now), or ``None`` for an unknown id."""
    job = _find_job(job_id)
    if job is None:
        return None
    return {"id": job.id, "status": job.get_status(), "result": None}


def _find_job(job_id: str) -> hybridq.Job | None:
    needle = f'"id":"{job_id}"'.encode()  # a cheap filter before decoding a record
    found = None
    for rec in JournalReader(queue.journal).records():
        if needle not in rec.payload:
            continue
        try:
            env = Envelope.from_bytes(rec.payload)
        except ValueError:
            continue  # not a job record
        if env.id == job_id:  # the latest record under the id wins (a requeue)
            found = hybridq.Job(
                env, RecordId(rec.writer_id, rec.seq, rec.segment_index, rec.offset), queue.journal
            )
    return found


app = Starlette(
    routes=[
        Route("/jobs", create_job, methods=["POST"]),
        Route("/jobs/{job_id}", get_job, methods=["GET"]),
    ]
)
