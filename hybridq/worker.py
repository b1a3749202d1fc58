"""The worker side: the entry point RQ workers call, the idempotency store, the worker loop.

The forwarder pushes every job as an RQ job whose function is :func:`execute` and whose single
argument is the delivery (the envelope, the owning forwarder, the attempt; see
:class:`hybridq.protocol.Delivery`). So a plain ``rq worker --serializer
rq.serializers.JSONSerializer QUEUE`` runs hybridq jobs with every guarantee below, and
``hybridq worker`` (:func:`run_worker`) is that plus a loop that survives Redis going away. It
runs hybridq's worker classes (:mod:`hybridq.rqworker`), which send the claim (1.) and the
record (3.) inside the pipelines RQ sends before and after each job instead of as round trips
of their own: :func:`_plan` prepares the claim, and :func:`execute` reads its reply where it
would have made the call, and leaves the record for the worker to send.

Redis write access must not be code execution. :class:`Job`, the job class every hybridq worker
uses (``rq worker --job-class hybridq.worker.Job`` for a plain RQ worker), makes RQ resolve no
function but :func:`execute` (or one :mod:`hybridq.allow` allows, when no signing key is
configured) before it imports anything. Then, for each delivery, :func:`execute`:

0. **checks** the envelope's signature when this worker holds a signing key
   (:mod:`hybridq.signing`), then that its function is allowed (:mod:`hybridq.allow`) and
   imports; a job failing the signature or refused for security fails for good, reported to
   the forwarder, with nothing imported or claimed; one this worker is merely not set up for
   (no ``--allow`` covers it, or its task does not import here) is left for another worker,
   with no attempt used (:func:`_leave`, :mod:`hybridq.waiting`);
1. **claims** the idempotency key in one script: a stored success (or a final failure) is
   returned without calling the task (a *suppressed duplicate*); otherwise it takes the key's
   lease (``SET NX PX``), so two deliveries of one key never run the task at the same time (the
   second waits, then finds the first one's result);
2. **renews** the lease from a thread (one per process) while the task runs and until its
   outcome is stored or given up: when the worker or its work-horse is killed, the lease expires
   within ``lease_s`` and the forwarder delivers the job again;
3. **records** the outcome and a completion event for the owning forwarder in one atomic step
   (a Lua script: all or nothing, like MULTI/EXEC), and frees the lease.

This module is the worker side: it must not import the journal (pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import redis
from redis.exceptions import RedisError
from rq import get_current_job
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from hybridq import keys, redisurl, waiting
from hybridq.allow import resolve
from hybridq.context import CurrentJob, _current
from hybridq.envelope import Envelope
from hybridq.errors import DuplicateOfFailedJob, StaleDelivery
from hybridq.guard import Job, NotAllowed
from hybridq.protocol import (
    ENTRY_POINT,
    ClaimStatus,
    CompletionEvent,
    Delivery,
    FinishReply,
    Outcome,
    StoredOutcome,
)
from hybridq.signing import EVENT_MAC, SignatureError, expiry_refusal, keyring, sign_event
from hybridq.waiting import TaskUnavailable

__all__ = [
    "ENTRY_POINT",
    "DuplicateOfFailedJob",
    "Job",
    "NotAllowed",
    "StaleDelivery",
    "TaskUnavailable",
    "execute",
    "run_worker",
]

log = logging.getLogger("hybridq.worker")

#: Longest error text stored with an outcome (a traceback); events carry only its last line.
MAX_ERROR_CHARS = 8192
#: How long to keep trying to record an outcome while Redis is unreachable (seconds). Past it,
#: the lease expires and the forwarder delivers the job again: at-least-once, never lost.
FINISH_PATIENCE_S = 30.0
#: Socket timeout of a worker's own Redis calls (claim, lease renewal, outcome), in seconds.
CALL_TIMEOUT_S = 5.0
#: RQ's worker TTL for ``hybridq worker``: RQ's own socket timeout is this plus 10 s less 15 s
#: (its blocking dequeue waits TTL - 15 s), so a hung Redis is noticed in 30 s, not 415 s.
WORKER_TTL_S = 35
#: How often a delivery that finds its key's lease taken checks again (seconds).
BUSY_POLL_S = 0.25
#: The longest wait between two attempts of RQ's own loop to reach a Redis that went away.
RECONNECT_MAX_S = 5.0
#: An RQ loop that served this long before it ended starts the restart backoff from scratch.
STABLE_S = 60.0

# KEYS: result, lease, RQ's job hash, the owner's epoch key. ARGV: token, lease ms, job id,
# requeue, attempt, the delivery's epoch generation.
# Returns {0, ""} claimed; {1, stored} suppressed (return stored); {2, stored} stale (this
# attempt, or a later one, of this job already failed: report that); {3, holder} busy (another
# delivery runs it now); {4, why} fenced: Redis brought this delivery back from before the
# forwarder's current epoch (an older snapshot, a lagging replica promoted), or restarted and
# the forwarder has not yet noticed; the job may have finished already, so it must not run (the
# forwarder's refill pass delivers it again if its ledger says it has not finished).
#
# The epoch key holds "generation:run_id:token" (Completions.check_epoch). A delivery older than
# the generation is stale. A run_id that is not the server's own means this server's state is
# not the one the forwarder last saw (restarted, or a replica promoted): every claim waits for
# the forwarder to look (within about a second), as its ledger alone knows what finished. INFO
# costs about 4 us per claim (redis 6.2); an ACL that denies it leaves the generation check.
# No epoch key (an older forwarder, or Redis lost it and nothing it held can be older), or no
# KEYS[4] (a caller of the older script's arguments), fences nothing.
_CLAIM = """
if redis.call("GET", KEYS[2]) == ARGV[1] then
    return {0, ""}  -- this very claim already ran (its reply was lost): the lease is ours
end
local epoch = KEYS[4] and redis.call("GET", KEYS[4])
if epoch then
    local gen, run_id = string.match(epoch, "^(%d+):(%x*):")
    local why = nil
    if gen and (tonumber(ARGV[6]) or 0) < tonumber(gen) then
        why = "stale"
    elseif gen and run_id ~= "" then
        local info = redis.pcall("INFO", "server")
        local current = type(info) == "string" and string.match(info, "run_id:(%x+)")
        if current and current ~= run_id then
            why = "unchecked"
        end
    end
    if why then
        if redis.call("EXISTS", KEYS[3]) == 1 then
            redis.call("HSET", KEYS[3], "hybridq_fenced", "1")  -- for the refill pass
        end
        return {4, why}
    end
end
local my_run = tonumber(ARGV[4]) * 100000 + tonumber(ARGV[5])
local stored = redis.call("GET", KEYS[1])
if stored then
    local ok, r = pcall(cjson.decode, stored)
    if ok and type(r) == "table" then
        local rq, at = tonumber(r.requeue) or 0, tonumber(r.attempt) or 0
        local my_rq, my_at = tonumber(ARGV[4]), tonumber(ARGV[5])
        if r.outcome == "succeeded" or (r.final and rq >= my_rq) then
            return {1, stored}
        end
        if r.job_id == ARGV[3] and (rq > my_rq or (rq == my_rq and at >= my_at)) then
            return {2, stored}
        end
    end
end
if redis.call("SET", KEYS[2], ARGV[1], "NX", "PX", ARGV[2]) then
    -- The task is about to start: from now on this run counts as an attempt (the forwarder
    -- tells "started, then lost" from "taken, never started" by this field).
    if redis.call("EXISTS", KEYS[3]) == 1 then
        redis.call("HSET", KEYS[3], "hybridq_started", my_run)
    end
    return {0, ""}
end
return {3, redis.call("GET", KEYS[2]) or ""}
"""

# KEYS: result, lease, events. ARGV: token, outcome JSON, key lifetime s, event JSON[, the event
# to send instead when a success is kept (signed by the worker: Lua cannot sign)].
# A success already stored (by a delivery that ran while this one had lost its lease) is kept,
# and the event reports it: the key succeeded, whatever this run did. Returns 0 stored, 1 kept
# the earlier success, 2 this run's outcome was already stored (a retry after a lost reply),
# 3 kept the success of a later attempt of this job (this run's outcome was superseded).
_FINISH = """
local stored = redis.call("GET", KEYS[1])
local keep = 0
if stored then
    local ok, r = pcall(cjson.decode, stored)
    if ok and type(r) == "table" then
        if r.token == ARGV[1] then return 2 end
        if r.outcome == "succeeded" then
            local mine = cjson.decode(ARGV[2])
            keep = 1
            if r.job_id == mine.job_id and (tonumber(r.attempt) or 0) > mine.attempt then keep = 3 end
        end
    end
end
local event = ARGV[4]
if keep == 0 then
    redis.call("SET", KEYS[1], ARGV[2], "EX", ARGV[3])
elseif ARGV[5] then
    event = ARGV[5]  -- the rewrite below, as the worker made and signed it (signing on)
else
    local e = cjson.decode(event)
    e.outcome, e.final, e.error, e.retry_delay = "succeeded", true, nil, nil
    event = cjson.encode(e)
end
redis.call("XADD", KEYS[3], "*", "e", event)
if redis.call("GET", KEYS[2]) == ARGV[1] then
    redis.call("DEL", KEYS[2])
end
return keep
"""

# KEYS: lease. ARGV: token, lease ms. 1 if renewed, 0 if the lease is no longer ours.
_RENEW = """
if redis.call("GET", KEYS[1]) == ARGV[1] then
    return redis.call("PEXPIRE", KEYS[1], ARGV[2])
end
return 0
"""


def execute(delivery: Mapping[str, Any]) -> Any:
    """Run one hybridq job under RQ (see the module docstring); RQ calls this, not users."""
    rq_job = get_current_job()
    if rq_job is None:
        raise RuntimeError("hybridq.worker.execute runs only inside an RQ worker")
    conn = _client(rq_job.connection)
    run = _run_of(rq_job, delivery)
    if run is None:
        d = Delivery.from_json(delivery)
        _check_route(rq_job, d.envelope)
        _admit(conn, d)
        run = _Run.new(delivery, d)
    answer = _claim(conn, run)
    if answer is not _CLAIMED:
        return answer
    d, env = run.d, run.d.envelope
    run.renewal = renewal = _renewer().add(conn, run.claim_keys[1], run.token, d.lease_s)
    context = _current.set(
        CurrentJob(env.id, env.idempotency_key, d.attempt, env.max_attempts, env.queue, env.func)
    )
    error: BaseException | None = None
    value: Any = None
    try:
        value = _call(env)
    except Exception as exc:
        error = exc
    except BaseException:
        _release(run)  # no outcome will be stored: let the lease lapse
        raise
    finally:
        _current.reset(context)
    # The lease is renewed until the outcome is stored or given up (_release): were it to lapse
    # while the outcome call fails, another delivery would run the finished task again. The
    # deadline ends the renewals even if nothing releases them.
    renewal.until = time.monotonic() + FINISH_PATIENCE_S + 2 * CALL_TIMEOUT_S
    final = error is None or d.attempt >= env.max_attempts
    value = _jsonable(value, env)
    outcome = StoredOutcome(
        outcome=Outcome.SUCCEEDED if error is None else Outcome.FAILED,
        result=value,
        error=_format_error(error) if error is not None else None,
        job_id=env.id,
        attempt=d.attempt,
        requeue=env.requeue,
        final=final,
        at=time.time(),
        token=run.token,  # tells a retried _FINISH that its first try got through
    )
    run.finish = _finish_call(run, outcome.to_json())
    if not run.deferred:
        try:
            _finish(conn, run)
        finally:
            _release(run)
    # else the worker sends it, in the pipeline RQ sends right after the job (hybridq.rqworker).
    if error is not None:
        raise error
    return value


#: What :func:`_claim` returns when the key is claimed: the task may run.
_CLAIMED: Any = object()


def _claim(conn: redis.Redis, run: _Run) -> Any:
    """Claim ``run``'s key; :data:`_CLAIMED`, or what :func:`execute` returns instead of running."""
    d, env = run.d, run.d.envelope
    reply = run.claim_reply  # the claim a pipelining worker already sent (hybridq.rqworker)
    while True:
        if reply is None:
            # Retried with the same token when the reply is lost: a claim that did happen is ours.
            reply = _retrying(lambda: _script(conn, _CLAIM)(keys=run.claim_keys, args=run.claim_args))
        status, stored = reply
        reply = None
        if status == ClaimStatus.CLAIMED:
            return _CLAIMED
        if status == ClaimStatus.SUPPRESSED:
            return _suppressed(conn, d, json.loads(stored))
        if status == ClaimStatus.STALE:
            # An old copy of an attempt that already failed. Its event may be what got lost (the
            # reason this copy exists): report that outcome again, or the retry never happens.
            log.info("job %s attempt %d already ran and failed: reporting that instead", env.id, d.attempt)
            failure = json.loads(stored)
            _report(conn, d, failure, dup=False)
            # RQ records this copy failed, as hybridq has it (returning would record it finished).
            raise StaleDelivery(f"job {env.id}: attempt {failure.get('attempt')} already ran and failed")
        if status == ClaimStatus.FENCED:
            # Not a failure of the job: nothing ran, and nothing is reported.
            log.warning(
                "job %s attempt %d: delivery from before the forwarder's current epoch (%s): not run; "
                "the forwarder delivers it again if it has not finished",
                env.id,
                d.attempt,
                stored.decode() if isinstance(stored, bytes) else stored,
            )
            return None
        # ClaimStatus.BUSY: another delivery of this key runs the task now: wait for it.
        time.sleep(BUSY_POLL_S)


@dataclass(eq=False, slots=True)
class _Run:
    """One delivery's run: its claim, then its outcome script.

    :func:`execute` makes one; a pipelining worker (:mod:`hybridq.rqworker`) makes it before RQ
    starts the job (:func:`_plan`), sends the claim in RQ's own pipeline and leaves the reply
    here, and sends the outcome script (``finish``, left by :func:`execute`) in the pipeline RQ
    sends after the job.
    """

    #: The delivery as RQ passes it to :func:`execute` (the very object: see :func:`_run_of`).
    raw: Mapping[str, Any]
    d: Delivery
    #: The lease value, and the mark a retried script recognises as its own.
    token: str
    #: The claim script's keys (result, lease, RQ job hash) and arguments.
    claim_keys: list[str]
    claim_args: list[str | int]
    #: The reply of a claim the worker sent already; ``None``: :func:`execute` claims.
    claim_reply: Any = None
    #: Whether the worker, not :func:`execute`, sends the outcome script.
    deferred: bool = False
    #: The outcome script's keys and arguments, once the task ran.
    finish: tuple[list[str], list[str | int]] | None = None
    #: The lease's renewal, from the claim until the outcome is stored or given up.
    renewal: _Renewal | None = None

    @classmethod
    def new(cls, raw: Mapping[str, Any], d: Delivery) -> _Run:
        env = d.envelope
        token = f"{env.id}/{d.attempt}/{socket.gethostname()}/{os.getpid()}/{os.urandom(4).hex()}"
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
        return cls(raw, d, token, claim_keys, claim_args)


#: The attribute of an RQ job under which a pipelining worker leaves its :class:`_Run`.
_RUN_ATTR = "_hybridq_run"


def _plan(rq_job: RQJob) -> _Run | None:
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
        if (
            _misrouted(rq_job, d.envelope) is not None
            or _refusal(d.envelope) is not None
            or waiting.unimportable(d.envelope.func) is not None
        ):
            return None
    except Exception:  # execute() meets the same error and deals with it
        return None
    run = _Run.new(raw, d)
    run.deferred = True
    setattr(rq_job, _RUN_ATTR, run)
    return run


def _run_of(rq_job: RQJob, raw: Mapping[str, Any]) -> _Run | None:
    """The run a pipelining worker planned for ``rq_job`` (:func:`_plan`); ``None`` if none.

    RQ calls :func:`execute` with the very delivery object :func:`_plan` read from the job;
    anything else is not that run (and gets one of its own).
    """
    run: _Run | None = getattr(rq_job, _RUN_ATTR, None)
    if run is None or run.raw is not raw:
        return None
    return run


def _refusal(env: Envelope) -> Exception | None:
    """Why this worker refuses ``env`` (a bad signature, a function not allowed), or ``None``.

    The signature first (a job changed in Redis could name any allowed function), then the
    allowlist: :func:`hybridq.allow.resolve`, which imports the allowed module to see what the
    path leads to (this runs in the process that runs the task). A module or name that does not
    import here is not a refusal: :func:`_admit` leaves the job for another worker
    (:func:`hybridq.waiting.unimportable`). A key configured but unreadable raises
    SigningKeyError: fail closed, never fall back to unsigned.
    """
    ring = keyring()
    if ring is not None:
        try:
            ring.verify(env)
        except SignatureError as exc:
            return exc
        expired = expiry_refusal(env)
        if expired is not None:
            return expired
    try:
        resolve(env.func)
    except NotAllowed as exc:
        return exc
    except Exception:  # noqa: S110 - _admit finds it unimportable and says why
        pass
    return None


def _misrouted(rq_job: RQJob, env: Envelope) -> NotAllowed | None:
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


def _check_route(rq_job: RQJob, env: Envelope) -> None:
    """Raise :class:`NotAllowed` for a misrouted job (:func:`_misrouted`), reporting nothing.

    Not reported: the job hash was changed in Redis, and a failure event would end the real job
    for good; unreported, the forwarder finds it stranded and delivers it again, as pushed.
    """
    error = _misrouted(rq_job, env)
    if error is not None:
        log.error("%s", error)
        raise error


def _admit(conn: redis.Redis, d: Delivery) -> None:
    """Refuse or leave (raise) a delivery this worker will not or cannot run; before the claim.

    Before anything is imported or claimed. A refused job (a bad signature, a function refused
    although its module is allowed here, a standard-library function) fails for good (a retry
    would be refused the same way), and the forwarder records it. A job this worker is merely
    not set up for (no ``--allow`` covers its module, or its task does not import here: a
    rolling deploy) is left for a worker that can run it, with no attempt used
    (:func:`_leave`). A key that cannot be read raises SigningKeyError here: nothing runs,
    nothing is reported, and the forwarder delivers the job again later.
    """
    env = d.envelope
    error = _refusal(env)
    if error is not None:
        if waiting.not_set_up_for(env.func, error):
            _leave(conn, d, str(error))
        _refuse(conn, d, error)
    reason = waiting.unimportable(env.func)
    if reason is not None:
        _leave(conn, d, reason)


def _leave(conn: redis.Redis, d: Delivery, reason: str) -> NoReturn:
    """Leave the job for a worker that can run it: no claim, no attempt used, nothing reported.

    RQ marks this delivery failed; the task never started, so the forwarder's reconcile pass
    finds the job stranded and delivers the same attempt again about two leases later. The job
    is listed in :mod:`hybridq.waiting` meanwhile (``hybridq status``, ``hybridq doctor``).
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
    _report(conn, d, refused, dup=False)
    raise error


def _call(env: Envelope) -> Any:
    func = resolve(env.func)  # the same resolution _refusal checked; a hybridq.task is callable
    return func(*env.args, **env.kwargs)


def _suppressed(conn: redis.Redis, d: Delivery, stored: Mapping[str, Any]) -> Any:
    """Report a stored outcome for this delivery without running the task."""
    env = d.envelope
    log.info(
        "job %s: idempotency key already %s (by job %s): not running it again",
        env.id,
        stored.get("outcome"),
        stored.get("job_id"),
    )
    _report(conn, d, stored, dup=True)
    if stored.get("outcome") != Outcome.SUCCEEDED:
        raise DuplicateOfFailedJob(f"idempotency key failed for good in job {stored.get('job_id')}")
    return stored.get("result")


def _report(conn: redis.Redis, d: Delivery, stored: Mapping[str, Any], *, dup: bool) -> None:
    """Send a stored outcome to the owning forwarder again, as this delivery's event."""
    event = json.dumps(sign_event(d.owner, _event(d, stored, dup=dup).to_json()))
    _retrying(lambda: conn.xadd(keys.events(d.owner), {"e": event}))


def _finish_call(run: _Run, outcome: Mapping[str, Any]) -> tuple[list[str], list[str | int]]:
    """The keys and arguments of the outcome script (:data:`_FINISH`) for ``outcome``."""
    d = run.d
    plain = _event(d, outcome, dup=False)
    event = sign_event(d.owner, plain.to_json())
    args: list[str | int] = [run.token, json.dumps(outcome), max(1, int(d.key_ttl_s)), json.dumps(event)]
    if EVENT_MAC in event:  # what _FINISH makes of the event when it keeps a success, signed
        args.append(json.dumps(sign_event(d.owner, plain.kept_success_json())))
    result_key, lease_key = run.claim_keys[:2]
    return [result_key, lease_key, keys.events(d.owner)], args


def _finish(conn: redis.Redis, run: _Run) -> None:
    """Send ``run``'s outcome script, retried (with its token) while Redis is unreachable."""
    assert run.finish is not None
    keys_, args = run.finish
    _finished(run, _retrying(lambda: _script(conn, _FINISH)(keys=keys_, args=args)))


def _release(run: _Run) -> None:
    """Stop renewing ``run``'s lease: its outcome is stored, or was given up."""
    if run.renewal is not None:
        _renewer().remove(run.renewal)
        run.renewal = None


def _finished(run: _Run, kept: int) -> None:
    """Log what the outcome script found (its reply)."""
    if kept == FinishReply.SUPERSEDED:
        # Its outcome was recorded (and the next attempt ran) while this run's reply was lost,
        # or this run lost its lease and the job was delivered again: the success stands.
        log.info(
            "job %s: a later attempt already succeeded; this run's outcome is superseded", run.d.envelope.id
        )
    elif kept == FinishReply.KEPT:
        log.warning(
            "job %s: its key already had a stored success (this run had lost its lease): "
            "the task ran twice for one key",
            run.d.envelope.id,
        )


def _event(d: Delivery, outcome: Mapping[str, Any], *, dup: bool) -> CompletionEvent:
    """The event reporting ``outcome`` for ``d`` (the caller signs it, with signing keys)."""
    return CompletionEvent.of(d, outcome, dup=dup, at=time.time())


def _retrying(call: Any) -> Any:
    """Run a Redis call, retrying while Redis is unreachable, for up to FINISH_PATIENCE_S."""
    deadline = time.monotonic() + FINISH_PATIENCE_S
    delay = 0.1
    while True:
        try:
            return call()
        except RedisError as exc:
            if time.monotonic() >= deadline:
                log.error("cannot reach Redis (%s): the job will be delivered again", exc)
                raise
            time.sleep(random.uniform(delay / 2, delay))  # noqa: S311 - jitter
            delay = min(2.0, delay * 2)


def _jsonable(value: Any, env: Envelope) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        log.warning("job %s (%s) returned a value JSON cannot hold; storing its repr()", env.id, env.func)
        return repr(value)
    return value


def _format_error(error: BaseException) -> str:
    text = "".join(traceback.format_exception(error))
    return text if len(text) <= MAX_ERROR_CHARS else "...\n" + text[-MAX_ERROR_CHARS:]


def _client(conn: redis.Redis) -> redis.Redis:
    """A client of ``conn``'s Redis whose calls time out after :data:`CALL_TIMEOUT_S`.

    RQ raises its connection's socket timeout above its blocking dequeue (415 s by default): on
    that connection, a hung or blackholed Redis would hold a claim or an outcome that long.
    """
    pool = conn.connection_pool
    client = _clients.get(pool)
    if client is None:
        options = {
            **pool.connection_kwargs,
            "socket_timeout": CALL_TIMEOUT_S,
            "socket_connect_timeout": CALL_TIMEOUT_S,
        }
        client = redis.Redis(
            connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **options)
        )
        _clients[pool] = client
    return client


_clients: weakref.WeakKeyDictionary[redis.ConnectionPool, redis.Redis] = weakref.WeakKeyDictionary()


def _script(conn: redis.Redis, source: str) -> Any:
    """``source`` as a script of ``conn``: sent once, then called by its SHA (EVALSHA)."""
    scripts = _scripts.get(conn)
    if scripts is None:
        scripts = _scripts[conn] = {}
    script = scripts.get(source)
    if script is None:
        script = scripts[source] = conn.register_script(source)
    return script


_scripts: weakref.WeakKeyDictionary[redis.Redis, dict[str, Any]] = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class _Renewal:
    conn: redis.Redis
    key: str
    token: str
    lease_ms: int
    interval_s: float
    due: float
    lost: bool = False
    #: When to stop renewing even if nobody removed it (monotonic; set once the task returned).
    until: float = math.inf


class _LeaseRenewer:
    """One thread per process renews every lease the process holds, each every third of its length.

    Starting a thread per job cost more than the job's two Redis round trips (W1 profile), and
    waking it for every job costs CPU too: it is woken only for a renewal due before it would
    look again anyway (a job's first renewal is a third of a lease away; the thread usually
    already waits less than that).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._renewals: set[_Renewal] = set()
        self._wake = threading.Condition()
        #: When the thread looks at the renewals next (monotonic); guarded by ``_wake``.
        self._wake_at = math.inf
        self._thread = threading.Thread(target=self._run, name="hybridq-lease", daemon=True)
        self._thread.start()

    def add(self, conn: redis.Redis, key: str, token: str, lease_s: float) -> _Renewal:
        interval = max(0.05, lease_s / 3)
        renewal = _Renewal(
            conn, key, token, max(1, int(lease_s * 1000)), interval, time.monotonic() + interval
        )
        with self._wake:
            self._renewals.add(renewal)
            if renewal.due < self._wake_at:
                self._wake.notify()
        return renewal

    def remove(self, renewal: _Renewal) -> None:
        with self._wake:
            self._renewals.discard(renewal)

    def _run(self) -> None:
        while True:
            with self._wake:
                now = time.monotonic()
                self._renewals -= {r for r in self._renewals if r.until <= now}
                due = [r for r in self._renewals if r.due <= now]
                if not due:
                    soonest = min((r.due for r in self._renewals), default=now + 60.0)
                    timeout = max(0.01, soonest - now)
                    self._wake_at = now + timeout
                    self._wake.wait(timeout)
                    self._wake_at = math.inf  # looking now: add() need not wake it
                    continue
                for r in due:
                    r.due = now + r.interval_s
            for r in due:
                self._renew(r)

    def _renew(self, r: _Renewal) -> None:
        try:
            renewed = _script(r.conn, _RENEW)(keys=[r.key], args=[r.token, r.lease_ms])
        except RedisError as exc:
            log.warning("cannot renew the lease on %s: %s", r.key, exc)
            return
        with self._wake:
            if r not in self._renewals:
                return  # its outcome was stored meanwhile (which frees the lease)
        if not renewed and not r.lost:
            r.lost = True
            log.warning("lost the lease on %s: the job may be delivered again while it runs", r.key)


_renewer_instance: _LeaseRenewer | None = None
_renewer_lock = threading.Lock()


def _renewer() -> _LeaseRenewer:
    """This process's renewer (a forked work-horse starts its own: threads do not survive fork)."""
    global _renewer_instance
    with _renewer_lock:
        if _renewer_instance is None or _renewer_instance.pid != os.getpid():
            _renewer_instance = _LeaseRenewer()
        return _renewer_instance


# -- the worker process -------------------------------------------------------------------------


def run_worker(
    queues: Sequence[str],
    *,
    url: str,
    burst: bool = False,
    simple: bool = False,
    name: str | None = None,
    max_backoff_s: float = 30.0,
) -> int:
    """Run an RQ worker on ``queues`` until it is asked to stop; restart it when Redis goes away.

    RQ's own loop quits on a Redis timeout or an unexpected error, and cannot start while Redis
    is down; this loop starts it again after a backoff (doubling, with jitter, up to
    ``max_backoff_s``) instead of exiting or spinning. Returns 0 (stopped or, with ``burst``,
    out of work) or 1 (burst mode could not reach Redis).
    """
    # RQ's worker module is heavy; rqworker imports this module.
    from hybridq.rqworker import SimpleWorker, Worker  # noqa: PLC0415

    worker_class = SimpleWorker if simple else Worker
    commanded: list[str] = []  # RQ's pub/sub "shutdown" command arrived (see _log_commands)
    ring = keyring()  # a key configured but unusable stops the worker here, not on every job
    if ring is not None:
        log.info("verifying envelope signatures (%s, %d key(s))", ring.source, len(ring.keys))
    delay = 1.0
    down_since: float | None = None
    while True:
        conn = redis.Redis.from_url(url)
        started = time.monotonic()
        try:
            _check_access(conn, queues)
            # job_class: RQ must not import whatever function a job hash names (see Job).
            worker = worker_class(
                queues,
                connection=conn,
                serializer=JSONSerializer,
                name=name,
                job_class=Job.serving_only(queues),  # and no job moved from another queue
                worker_ttl=WORKER_TTL_S,
            )
            # RQ waits up to 60 s between reconnection attempts while it polls a dead Redis;
            # cap it so that work resumes within seconds of Redis coming back.
            worker.max_connection_wait_time = RECONNECT_MAX_S
            _log_commands(worker, commanded)
            worker.work(burst=burst, with_scheduler=False)
        except RedisError as exc:
            if redisurl.refusal(exc) is not None:
                raise redisurl.transport_error(exc) from exc  # retrying cannot fix it
            if burst:
                log.error("Redis unavailable (%s): --burst does not wait for it; exiting 1, nothing run", exc)
                return 1
            if down_since is None:
                down_since = time.monotonic()
                log.warning("Redis unavailable (%s): retrying, backing off up to %.0f s", exc, max_backoff_s)
        else:
            # A SIGTERM/SIGINT while idle ends RQ's loop without setting _stop_requested (it raises
            # StopRequested); the shutdown date is set either way. RQ has no public flag.
            if burst or worker._stop_requested or worker._shutdown_requested_date is not None:
                if commanded:
                    log.warning(
                        "stopped by RQ's shutdown command (Redis pub/sub channel %s), not by a signal: "
                        "exiting 0; a supervisor restarts this worker only with Restart=always "
                        "(docs/deploy.md)",
                        commanded[0],
                    )
                return 0
            log.warning("the RQ worker loop ended on its own (Redis went away?): starting it again")
            if time.monotonic() - started > STABLE_S:
                delay = 1.0  # it had been serving for a while: this is a new incident
        finally:
            conn.close()
        time.sleep(random.uniform(delay / 2, delay))  # noqa: S311 - jitter
        delay = min(max_backoff_s, delay * 2)
        if down_since is not None and _reachable(url):
            log.warning("Redis available again after %.1f s", time.monotonic() - down_since)
            down_since, delay = None, 1.0


def _check_access(conn: redis.Redis, queues: Sequence[str]) -> None:
    """Touch what a worker needs (login, database, its queues' and hybridq's keys).

    RQ's loop logs and swallows what it does not expect, a refusal included, so a wrong password,
    database or ACL is caught here, before RQ starts: RedisRefused instead of a restart loop.
    """
    pipe = conn.pipeline(transaction=False)
    pipe.ping()
    for queue in queues:
        pipe.llen(keys.rq_queue(queue))
    pipe.exists(keys.result("-"), keys.lease("-"), keys.events("-"), keys.waiting())
    pipe.execute()


def _log_commands(worker: Any, commanded: list[str]) -> None:
    """Note RQ's pub/sub "shutdown" command, so that run_worker can say why it stopped.

    Anyone who may PUBLISH on Redis can send it (``rq shutdown``); it looks like a SIGINT to RQ.
    """
    handle = worker.handle_payload

    def on_payload(message: dict[str, Any]) -> None:
        try:
            command = json.loads(message["data"]).get("command")
        except (ValueError, TypeError, KeyError, AttributeError):
            command = None  # RQ's own handler reports what it cannot parse
        if command == "shutdown":
            channel = message.get("channel")
            commanded.append(channel.decode(errors="replace") if isinstance(channel, bytes) else str(channel))
            log.warning("RQ shutdown command received on %s: stopping after the current job", commanded[-1])
        handle(message)

    worker.handle_payload = on_payload  # RQ subscribes with it when work() starts


def _reachable(url: str) -> bool:
    conn = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        conn.ping()
    except RedisError:
        return False
    finally:
        conn.close()
    return True
