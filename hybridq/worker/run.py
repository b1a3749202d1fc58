"""One delivery's run: :func:`execute` (the entry point RQ calls), the claim, the outcome.

:func:`execute` admits the delivery (:mod:`hybridq.worker.admit`), claims its idempotency key, holds the
lease while the task runs (:mod:`hybridq.worker.lease`) and stores the outcome with its completion event
(:mod:`hybridq.worker.scripts`). A pipelining worker (:mod:`hybridq.rqworker`) plans the run before RQ
starts the job (:func:`plan`), sends the claim and the outcome script in RQ's own pipelines, and then
calls :func:`finished` and :func:`release`, or :func:`finish` when its pipeline's reply was lost.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from rq import get_current_job
from rq.job import Job as RQJob

from hybridq.context import CurrentJob, _current
from hybridq.envelope.codec import dumps_ascii  # json.dumps's text; its encoder made once, not per call
from hybridq.errors import Cancelled, RetryLaterExpired, StaleDelivery
from hybridq.protocol import (
    ENTRY_POINT,
    ClaimStatus,
    Delivery,
    FinishReply,
    Outcome,
    StartedEvent,
    StoredOutcome,
    host_pid,
    keys,
)
from hybridq.protocol.host import token_nonce
from hybridq.protocol.later import resolve
from hybridq.security.signing import keyring
from hybridq.tracing import end_run, start_run
from hybridq.worker import lease, quick, scripts
from hybridq.worker.admit import (
    admit,
    check,
    check_route,
    event,
    event_json,
    misrouted,
    report,
    signed_started,
    suppressed,
)
from hybridq.worker.refusal import is_limit_refusal, send_refusal
from hybridq.worker.scripts import CALL_TIMEOUT_S, FINISH_PATIENCE_S
from hybridq.worker.values import MAX_ERROR_CHARS, call, format_error, jsonable

#: Read per run as constants: a member read from its class costs ~900 instructions (docs/benchmarks.md).
_SUCCEEDED, _FAILED, _SUPERSEDED = Outcome.SUCCEEDED, Outcome.FAILED, FinishReply.SUPERSEDED
_KEPT = FinishReply.KEPT

__all__ = [
    "BUSY",
    "BUSY_POLL_S",
    "CLAIMED",
    "MAX_ERROR_CHARS",
    "RUN_ATTR",
    "Run",
    "begin",
    "claim",
    "conclude",
    "execute",
    "finish",
    "finished",
    "perform",
    "plan",
    "release",
    "release_all",
]

log = logging.getLogger("hybridq.worker")

#: How often a delivery that finds its key's lease taken checks again (seconds).
BUSY_POLL_S = 0.25


def execute(delivery: Mapping[str, Any]) -> Any:
    """Run one hybridq job under RQ (see the module docstring); RQ calls this, not users."""
    rq_job = get_current_job()
    if rq_job is None:
        raise RuntimeError("hybridq.worker.execute runs only inside an RQ worker")
    conn = scripts.client(rq_job.connection)
    run = _run_of(rq_job, delivery)
    if run is None:
        d = Delivery.from_json(delivery)
        check_route(rq_job, d.envelope)
        run = Run.new(delivery, d, admit(conn, d))
    answer = claim(conn, run)
    if answer is not CLAIMED:
        return answer
    value, error = perform(conn, run)
    failed = [error] if error is not None else []
    del error  # popped as it is raised: its traceback holds this frame (see perform)
    if not run.deferred:  # else the worker sends it in the pipeline RQ sends after the job (rqworker)
        try:
            finish(conn, run)
        finally:
            release(run)
    if failed:
        raise failed.pop()
    return value


def perform(conn: redis.Redis, run: Run) -> tuple[Any, Exception | None]:
    """Run ``run``'s claimed task; its (JSON-able) value and error.

    Its outcome script is left in ``run.finish``, and its lease is renewed until the outcome is
    stored (:func:`release`). A ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``) stores
    no outcome: the lease is let go (it lapses, and the forwarder delivers the job again) and the
    exception propagates.
    """
    context = begin(conn, run)
    token = quick.started(run.d.envelope.func)
    failed: list[Exception] = []  # its traceback holds this frame, its callers' too: no local names it
    value: Any = None
    try:
        value = call(run.func, run.d.envelope)  # a hybridq.task is callable too
    except Exception as exc:
        failed.append(exc)
    except BaseException:
        release(run)  # no outcome will be stored: let the lease lapse
        raise
    finally:
        _current.reset(context)
        quick.ran(run.d.envelope.func, token)
    return conclude(run, value, failed.pop() if failed else None)


def begin(conn: redis.Redis, run: Run) -> contextvars.Token[CurrentJob | None]:
    """Start holding ``run``'s lease and make it the current job (:func:`hybridq.current_job`)."""
    d, env = run.d, run.d.envelope
    if run.renewal is None:  # a pool worker holds it from the claim (hold_claimed)
        run.renewal = lease.hold(conn, run.claim_keys[1], run.token, d.lease_s, run.claim_keys[2])
    run.started = time.time()
    job = (env.id, env.idempotency_key, d.job_attempt, env.max_attempts, env.queue, env.func)
    run.span = start_run(env.trace, job_id=env.id, func=env.func, queue=env.queue, attempt=d.job_attempt)
    return _current.set(CurrentJob(*job, cancel_flag=run.renewal.cancelled))


def conclude(run: Run, value: Any, error: Exception | None) -> tuple[Any, Exception | None]:
    """Make ``run``'s outcome script (into ``run.finish``) for what its task returned or raised."""
    d, env = run.d, run.d.envelope
    # The lease is renewed until the outcome is stored or given up (release): were it to lapse while
    # the outcome call fails, the finished task would run again. The deadline ends the renewals.
    if run.renewal is not None and not run.deferred_end:
        run.renewal.until = time.monotonic() + FINISH_PATIENCE_S + 2 * CALL_TIMEOUT_S
    error, later = resolve(d, error, time.time())  # a RetryLater in time is no error (logged): a wait
    final = error is None or d.job_attempt >= env.max_attempts or isinstance(error, RetryLaterExpired)
    value, run.result_json = jsonable(value, env)
    kind, error_text = (_SUCCEEDED, None) if error is None else (_FAILED, format_error(error))
    # token: tells a retried outcome script that its first try got through.
    fields = (kind, value, error_text, env.id, d.attempt, env.requeue, final, time.time(), run.token)
    if later is None and not isinstance(error, Cancelled):  # most runs: only the JSON is needed
        body = StoredOutcome.json_of(*fields)
    else:
        outcome = StoredOutcome(*fields)
        if later is not None:  # RQ records the run finished: not a failure, no traceback
            outcome = later.stored(outcome)
        if isinstance(error, Cancelled):  # asked to stop (hybridq cancel): the end, no retry
            outcome = outcome.cancelled()
        body, kind, error_text, final = outcome.to_json(), outcome.outcome, outcome.error, outcome.final
    run.finish, run.error_text = _finish_call(run, body), error_text
    end_run(run.span, kind.value, final=final, error=error)
    run.span = None
    return value, error


#: What :func:`claim` returns when the key is claimed: the task may run.
CLAIMED: Any = object()
#: What :func:`claim` returns when it stopped polling a key another delivery holds: not claimed.
BUSY: Any = object()


def claim(conn: redis.Redis, run: Run, poll: Callable[[], bool] | None = None) -> Any:
    """Claim ``run``'s key: :data:`CLAIMED`, or what :func:`execute` returns instead of running.

    Uses ``run.claim_reply`` if the claim was sent already. A suppressed duplicate returns the
    stored result (or raises DuplicateOfFailedJob), a stale copy raises StaleDelivery, a fenced
    (or cancelled) one returns ``None``; a busy key is polled until it is one of those, or claimed,
    every :data:`BUSY_POLL_S`; with ``poll``, while ``poll()`` (which waits between polls) says
    so, and :data:`BUSY` once it does not: not claimed, another delivery holds the key.
    """
    d, env = run.d, run.d.envelope
    reply = run.claim_reply  # the claim a pipelining worker already sent (hybridq.rqworker)
    while True:
        if reply is None:
            # Retried with the same token when the reply is lost: a claim that did happen is ours.
            reply = scripts.retrying(lambda: scripts.claim(conn, run.claim_keys, run.claim_args))
        status, stored = reply
        reply = None
        if status == ClaimStatus.CLAIMED:
            return CLAIMED
        if status == ClaimStatus.SUPPRESSED:
            return suppressed(conn, d, json.loads(stored))
        if status == ClaimStatus.STALE:
            # An old copy of an attempt that failed; its event may be what got lost (why this copy
            # exists): report that outcome again, or the retry never happens.
            failure = json.loads(stored)
            later = failure.get("outcome") == Outcome.LATER  # not a failure: RQ records it finished
            what = "said RetryLater" if later else "ran and failed"
            log.info("job %s attempt %d already %s: reporting that instead", env.id, d.attempt, what)
            report(conn, d, failure, dup=False)
            if later:
                return None
            # RQ records this copy failed, as hybridq has it (returning would record it finished).
            raise StaleDelivery(f"job {env.id}: attempt {failure.get('attempt')} already ran and failed")
        if status == ClaimStatus.CANCELLED:  # before it started (hybridq cancel): the forwarder settles it
            log.info("job %s attempt %d: cancelled before it started: not run", env.id, d.attempt)
            return None
        if status == ClaimStatus.FENCED:
            # Not a failure of the job: nothing ran, and nothing is reported (no attempt used).
            why = stored.decode() if isinstance(stored, bytes) else str(stored)
            log.warning(
                "job %s attempt %d: not run (%s: a delivery from before the forwarder's current epoch, "
                "or its limit key has no room); the forwarder delivers it again if it has not finished",
                env.id,
                d.attempt,
                why,
            )
            if is_limit_refusal(d, why):  # the forwarder takes it back at its next step
                send_refusal(conn, d, why)
            return None
        # ClaimStatus.BUSY: another delivery of this key runs the task now: wait for it.
        if poll is None:
            time.sleep(BUSY_POLL_S)
        elif not poll():
            return BUSY


@dataclass(eq=False, slots=True)
class Run:
    """One delivery's run: its claim, then its outcome script.

    :func:`execute` makes one; a pipelining worker (:mod:`hybridq.rqworker`) makes it before RQ
    starts the job (:func:`plan`), sends the claim in RQ's own pipeline and leaves the reply
    here, and sends the outcome script (``finish``, left by :func:`execute`) in the pipeline RQ
    sends after the job.
    """

    #: The delivery as RQ passes it to :func:`execute` (the very object: see :func:`_run_of`).
    raw: Mapping[str, Any]
    d: Delivery
    #: The lease value, and the mark a retried script recognises as its own.
    token: str
    #: The claim script's keys (result, lease, RQ job hash, epoch[, events]) and arguments.
    claim_keys: list[str]
    claim_args: list[str | int]
    #: The task's function, resolved and admitted once (:func:`hybridq.worker.admit.check`).
    func: Callable[..., Any]
    #: The reply of a claim the worker sent already; ``None``: :func:`execute` claims.
    claim_reply: Any = None
    #: Whether the worker, not :func:`execute`, sends the outcome script.
    deferred: bool = False
    #: The outcome script's keys and arguments, once the task ran.
    finish: tuple[list[str], list[str | int]] | None = None
    #: The lease's renewal, from the claim until the outcome is stored or given up.
    renewal: lease.Renewal | None = None
    #: The stored error text (a traceback) of a failed run, once the task raised.
    error_text: str | None = None
    #: The JSON text of what the task returned, once it did (made once, for every record of it).
    result_json: str | None = None
    #: A pool worker ends the run in a batch, later, and releases it then (renewed until then).
    deferred_end: bool = False
    #: When the task started (wall clock): the completion event reports it.
    started: float | None = None
    span: Any = None  # the run's trace span, from begin() to conclude() (None: untraced)

    @classmethod
    def new(cls, raw: Mapping[str, Any], d: Delivery, func: Callable[..., Any]) -> Run:
        """A run of ``d`` with a fresh token (unique per run; a limited one ends in its policy)."""
        env = d.envelope
        token = f"{env.id}/{d.attempt}/{host_pid()}/{token_nonce()}{'#L' + d.limit if d.limit else ''}"
        key_id = env.key_id
        claim_keys = [keys.result(key_id), keys.lease(key_id), keys.rq_job(env.id), keys.epoch(d.owner)]
        claim_args: list[str | int] = [
            token,
            max(1, int(d.lease_s * 1000)),
            env.id,
            env.requeue,
            d.attempt,
            d.gen,
        ]
        # A started event (not for a quick task); a limited run's refused one: worker.refusal.
        if d.report_start and not quick.is_quick(env.func):
            claim_keys.append(keys.events(d.owner))
            claim_args.append(signed_started(d.owner, StartedEvent.of(d, time.time())))
        return cls(raw, d, token, claim_keys, claim_args, func)


#: The attribute of an RQ job under which a pipelining worker leaves its :class:`Run`.
RUN_ATTR = "_hybridq_run"


def plan(rq_job: RQJob) -> Run | None:
    """The run of ``rq_job`` if a worker may claim it before RQ starts it, else ``None``.

    ``None`` (then :func:`execute` does everything itself, as under a plain RQ worker) for a job
    that is not a hybridq delivery RQ will run (another function, an instance, callbacks: the
    job class refuses those before :func:`execute` runs), a delivery that does not parse, or
    one whose signature or function is refused (:func:`execute` reports the refusal). Never
    raises: a key file that cannot be read is :func:`execute`'s to report, too.
    """
    try:
        if (
            rq_job.func_name != ENTRY_POINT
            or rq_job.instance is not None
            or rq_job._success_callback_name
            or rq_job._failure_callback_name
            or rq_job._stopped_callback_name
            or len(rq_job.args) != 1
            or rq_job.kwargs
        ):
            return None
        raw = rq_job.args[0]
        d = Delivery.from_json(raw)
        if misrouted(rq_job, d.envelope) is not None:
            return None
        func, _ = check(d.envelope)
        if func is None:  # refused, or it does not import here
            return None
    except Exception:  # execute() meets the same error and deals with it
        return None
    run = Run.new(raw, d, func)
    run.deferred = True
    setattr(rq_job, RUN_ATTR, run)
    return run


def _run_of(rq_job: RQJob, raw: Mapping[str, Any]) -> Run | None:
    """The run a pipelining worker planned for ``rq_job`` (:func:`plan`); ``None`` if none.

    RQ calls :func:`execute` with the very delivery object :func:`plan` read from the job;
    anything else is not that run (and gets one of its own).
    """
    run: Run | None = getattr(rq_job, RUN_ATTR, None)
    if run is None or run.raw is not raw:
        return None
    return run


def _finish_call(run: Run, outcome: Mapping[str, Any]) -> tuple[list[str], list[str | int]]:
    """The keys and arguments of the outcome script (:func:`.scripts.finish`) for ``outcome``."""
    d = run.d
    ring = keyring()
    if ring is None:  # the event's JSON only, not the event (docs/benchmarks.md: about 2 us a job)
        signed = event_json(d, outcome, dup=False, result_json=run.result_json, started=run.started)
    else:
        plain = event(d, outcome, dup=False, result_json=run.result_json, started=run.started)
        signed = ring.sign_event(d.owner, plain.to_json())
    args: list[str | int] = [run.token, dumps_ascii(outcome), max(1, int(d.key_ttl_s)), dumps_ascii(signed)]
    if ring is not None:  # what the script makes of the event when it keeps a success, signed
        args.append(dumps_ascii(ring.sign_event(d.owner, plain.kept_success_json())))
    result_key, lease_key = run.claim_keys[:2]
    return [result_key, lease_key, keys.events(d.owner)], args


def finish(conn: redis.Redis, run: Run) -> None:
    """Send ``run``'s outcome script, retried (with its token) while Redis is unreachable."""
    assert run.finish is not None
    keys_, args = run.finish
    finished(run, scripts.retrying(lambda: scripts.finish(conn, keys_, args)))


def release(run: Run) -> None:
    """Stop renewing ``run``'s lease: its outcome is stored, or was given up."""
    release_all([run])


def release_all(runs: list[Run], *, freed: bool = False) -> None:
    """:func:`release` each of ``runs`` (``freed``: their outcomes deleted their leases)."""
    renewals = [run.renewal for run in runs if run.renewal is not None]
    for run in runs:
        run.renewal = None
    if renewals:
        lease.release_all(renewals, freed=freed)


def finished(run: Run, kept: int) -> None:
    """Log what the outcome script found (its reply)."""
    if kept == _SUPERSEDED:
        # Recorded (and the next attempt ran) while this reply was lost, or redelivered: the success stands.
        log.info(
            "job %s: a later attempt already succeeded; this run's outcome is superseded", run.d.envelope.id
        )
    elif kept == _KEPT:
        log.warning(
            "job %s: its key already had a stored success (this run had lost its lease): "
            "the task ran twice for one key",
            run.d.envelope.id,
        )
