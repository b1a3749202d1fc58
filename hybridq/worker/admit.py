"""What a worker checks before it claims a delivery: route, signature, allowlist, importability.

A refused job (a bad signature, a function refused) fails for good and is reported to the
owning forwarder; a job this worker is merely not set up for is left for another worker, with
no attempt used (:mod:`hybridq.worker.waiting`); a misrouted copy is refused and not reported. Also
how a worker reports a stored outcome as a delivery's completion event (:func:`report`, and
:func:`suppressed` for a key that already has one), and the signed started events a claim sends
(:func:`signed_started`).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import redis
from redis.exceptions import RedisError
from rq.job import Job as RQJob

from hybridq.envelope.model import Envelope
from hybridq.errors import DuplicateOfFailedJob, NoSuchTask, NotAllowed, SignatureError, TaskUnavailable
from hybridq.protocol import CompletionEvent, Delivery, Outcome, StartedEvent, host_pid, keys
from hybridq.security.allow import resolve
from hybridq.security.signing import expiry_refusal, keyring, sign_event
from hybridq.worker import waiting
from hybridq.worker.scripts import retrying

__all__ = [
    "admit",
    "check",
    "check_route",
    "event",
    "event_json",
    "misrouted",
    "refusal",
    "report",
    "signed_started",
    "suppressed",
]

log = logging.getLogger("hybridq.worker")


def check(env: Envelope) -> tuple[Callable[..., Any] | None, Exception | None]:
    """The function this worker would run for ``env``, or why it will not.

    ``(func, None)``: signed as required and allowed, and it imports here. ``(None, error)``:
    refused (a bad signature, a function not allowed). ``(None, None)``: allowed, but it does
    not import here (:func:`admit` leaves the job, :func:`hybridq.worker.waiting.unimportable` says
    why). The function is resolved once per delivery: its module's import-time code runs once.

    The signature first (a job changed in Redis could name any allowed function), then the
    allowlist, applied to what the path leads to (:func:`hybridq.security.allow.resolve`, in the process
    that runs the task). A key configured but
    unreadable raises SigningKeyError: fail closed, never fall back to unsigned.
    """
    ring = keyring()
    if ring is not None:
        try:
            ring.verify(env)
        except SignatureError as exc:
            return None, exc
        expired = expiry_refusal(env)
        if expired is not None:
            return None, expired
    try:
        return resolve(env.func), None
    except (NotAllowed, NoSuchTask) as exc:  # NoSuchTask: its module imports here, without it
        return None, exc
    except Exception:  # admit finds it unimportable and says why
        return None, None


def refusal(env: Envelope) -> Exception | None:
    """Why this worker refuses ``env`` (a bad signature, a function not allowed), or ``None``."""
    return check(env)[1]


def misrouted(rq_job: RQJob, env: Envelope) -> NotAllowed | None:
    """Why ``rq_job`` is not where the forwarder put ``env`` (another id, another queue), or ``None``.

    The forwarder pushes each envelope as the RQ job of the same id, on the queue it names (and
    signs). A copy under another id, or moved to another queue (``origin``, or a worker that
    does not serve the envelope's queue took it), is someone replaying it from Redis.
    """
    if rq_job.id != env.id:
        return NotAllowed(f"RQ job {rq_job.id} carries the envelope of job {env.id}: a copy, not run")
    if rq_job.origin != env.queue:
        return NotAllowed(
            f"job {env.id} is for queue {env.queue}, but RQ queued it on {rq_job.origin}: not run"
        )
    serving = getattr(rq_job, "serving", None)  # known under hybridq worker (Job.serving_only)
    if serving is not None and env.queue not in serving:
        return NotAllowed(f"job {env.id} is for queue {env.queue}, which this worker does not serve: not run")
    return None


def check_route(rq_job: RQJob, env: Envelope) -> None:
    """Raise :class:`NotAllowed` for a misrouted job (:func:`misrouted`), reporting nothing.

    Not reported: the job hash was changed in Redis, and a failure event would end the real job
    for good; unreported, the forwarder finds it stranded and delivers it again, as pushed.
    """
    error = misrouted(rq_job, env)
    if error is not None:
        log.error("%s", error)
        raise error


def admit(conn: redis.Redis, d: Delivery) -> Callable[..., Any]:
    """The function to run for ``d``; or refuse or leave (raise) it. Before the claim.

    Before anything is imported or claimed. A refused job (a bad signature, a function refused
    although its module is allowed here, a standard-library function, a name its module lacks)
    fails for good (a retry would be refused the same way), and the forwarder records it. A job
    this worker is merely not set up for (no ``--allow`` covers its module, or its module does
    not import here: a rolling deploy) is left for a worker that can run it, with no attempt used
    (:func:`_leave`). A key that cannot be read raises SigningKeyError here: nothing runs,
    nothing is reported, and the forwarder delivers the job again later.
    """
    env = d.envelope
    func, error = check(env)
    if error is not None:
        if waiting.not_set_up_for(env.func, error):
            _leave(conn, d, str(error))
        _refuse(conn, d, error)
    if func is None:
        _leave(conn, d, waiting.unimportable(env.func))
    return func


def _leave(conn: redis.Redis, d: Delivery, reason: str) -> NoReturn:
    """Leave the job for a worker that can run it: no claim, no attempt used, nothing reported.

    RQ marks this delivery failed; the task never started, so the forwarder's reconcile pass
    finds the job stranded and delivers the same attempt again about two leases later. The job
    is listed in :mod:`hybridq.worker.waiting` meanwhile (``hybridq status``, ``hybridq doctor``).
    """
    env = d.envelope
    message = f"{reason}; left for a worker that can run it (no attempt used)"
    log.warning("job %s: %s", env.id, message)
    info = {"func": env.func, "queue": env.queue, "reason": reason, "worker": socket.gethostname()}
    try:
        waiting.record(conn, env.id, info, lease_s=d.lease_s)
    except RedisError as exc:  # visibility only: the job is left either way
        log.warning("job %s: cannot list it as waiting: %s", env.id, exc)
    raise TaskUnavailable(message)


def _refuse(conn: redis.Redis, d: Delivery, error: Exception) -> NoReturn:
    """Fail a refused job for good: report it to the owning forwarder, then raise ``error``."""
    log.error("job %s: %s", d.envelope.id, error)
    refused = {"outcome": Outcome.FAILED.value, "final": True, "attempt": d.attempt, "error": str(error)}
    report(conn, d, refused, dup=False)
    raise error


def report(conn: redis.Redis, d: Delivery, stored: Mapping[str, Any], *, dup: bool) -> None:
    """Send a stored outcome to the owning forwarder again, as this delivery's event."""
    body = json.dumps(sign_event(d.owner, event(d, stored, dup=dup).to_json()))
    retrying(lambda: conn.xadd(keys.events(d.owner), {"e": body}))


def event(
    d: Delivery,
    outcome: Mapping[str, Any],
    *,
    dup: bool,
    result_json: str | None = None,
    started: float | None = None,
) -> CompletionEvent:
    """The event reporting ``outcome`` for ``d`` (the caller signs it, with signing keys).

    ``result_json``: the result's JSON text if made already; ``started``: when the task started.
    """
    return CompletionEvent.of(
        d, outcome, dup=dup, at=time.time(), result_json=result_json, started=started, worker=host_pid()
    )


def event_json(
    d: Delivery,
    outcome: Mapping[str, Any],
    *,
    dup: bool,
    result_json: str | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """:func:`event`'s JSON (``event(...).to_json()``), without making the event."""
    return CompletionEvent.json_of(
        d, outcome, dup=dup, at=time.time(), result_json=result_json, started=started, worker=host_pid()
    )


def suppressed(conn: redis.Redis, d: Delivery, stored: Mapping[str, Any]) -> Any:
    """Report a stored outcome for this delivery without running the task."""
    env = d.envelope
    log.info(
        "job %s: idempotency key already %s (by job %s): not running it again",
        env.id,
        stored.get("outcome"),
        stored.get("job_id"),
    )
    report(conn, d, stored, dup=True)
    if stored.get("outcome") != Outcome.SUCCEEDED:
        raise DuplicateOfFailedJob(f"idempotency key failed for good in job {stored.get('job_id')}")
    return stored.get("result")


def signed_started(owner: str, event: StartedEvent) -> str:
    """``event`` as the claim script adds it to ``owner``'s stream: signed, when this process holds keys.

    Sent by a claim only when the task is not quick; a limited run's refused variant is made
    only when its claim is refused (:mod:`hybridq.worker.refusal`).
    """
    return json.dumps(sign_event(owner, event.to_json()))
