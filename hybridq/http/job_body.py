"""A ``POST /v1/jobs`` body, read into the job's envelope (docs/http.md, the body's fields).

Kept apart from :mod:`hybridq.http.api` (the routes and their answers): what a body may say and
how each field is checked -- the JSON (no ``NaN``), the known fields, the task (registered, or
under ``--allow``), the arguments (tagged values decoded), the queue, the delay -- and the id a
POST's job gets (minted with the node's name, or derived from its ``Idempotency-Key``). Every
refusal is one :class:`~hybridq.errors.BadRequest` (or ``EnvelopeError``) line: a 400.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from hybridq.envelope.model import Envelope, function_path, new_job_id, validate_queue_name
from hybridq.envelope.tagged import decode_call
from hybridq.errors import BadRequest
from hybridq.http.answers import TaskCheck, retry_of
from hybridq.http.idempotency import ID_PREFIX, key_job_id, scoped_key
from hybridq.producer.queue import Queue

__all__ = ["FIELDS", "job_envelope", "parse_body"]

#: The fields of a ``POST /v1/jobs`` body (the contract: docs/http.md).
FIELDS = frozenset({"task", "args", "kwargs", "queue", "delay", "retry", "priority", "limit_key"})


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> Any:
    """The JSON of a body (``NaN`` and the infinities refused: not JSON numbers)."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, BadRequest):
            raise
        raise BadRequest("the body must be a JSON object") from None


def job_envelope(
    body: Any, key: str | None, scope: str, *, committer: Queue, tasks: TaskCheck, node: str
) -> Envelope:
    """The job a body asks for, validated (raises :class:`BadRequest` or EnvelopeError).

    ``committer``: the server's queue (its defaults, its ``prepare``); ``tasks``: which tasks a
    POST may name; ``node``: the node name its minted ids carry (:mod:`hybridq.http.node`).
    """
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)} (known: {', '.join(sorted(FIELDS))})")
    task = body.get("task")
    if not isinstance(task, str):
        raise BadRequest('"task" must be a string: a registered task or a path under --allow')
    path = function_path(task)  # a dotted path, not in __main__
    if not tasks.allowed(path):
        raise BadRequest(
            f"task {path!r} is not registered with @hybridq.task in this server nor under "
            "--allow (docs/http.md)"
        )
    tasks.check(path)
    args = body.get("args", [])
    kwargs = body.get("kwargs", {})
    if not isinstance(args, list):
        raise BadRequest('"args" must be a JSON array')
    if not isinstance(kwargs, dict):
        raise BadRequest('"kwargs" must be a JSON object')
    try:  # tagged values (docs/http.md) as the task will get them; the producer tags them again
        args, kwargs = decode_call(args, kwargs)
    except ValueError as exc:
        raise BadRequest(f'"args"/"kwargs": {exc}') from None
    queue = body.get("queue", "default")
    if not isinstance(queue, str):
        raise BadRequest('"queue" must be a string')
    delay = body.get("delay")
    if delay is not None and (
        isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay)
    ):
        raise BadRequest('"delay" must be a number of seconds')
    env = committer.prepare(
        path,
        args,
        kwargs,
        idempotency_key=key if key is None else scoped_key(key, scope),
        job_id=f"{ID_PREFIX}{node}-{new_job_id()}" if key is None else key_job_id(key, scope, node),
        delay=delay,
        retry=retry_of(body.get("retry")),
        priority=body.get("priority", 0),  # checked by prepare: one-line EnvelopeError, a 400
        limit_key=body.get("limit_key"),
        _fresh_key=key is None,  # an id minted here, per POST: no other call names it
    )
    # One validated path for every queue name (no Queue object per name: its checks are
    # the name's, the rest are the committer's defaults).
    if queue != env.queue:
        env = dataclasses.replace(env, queue=validate_queue_name(queue))  # encoded again
    return env
