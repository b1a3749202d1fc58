"""hybridq's RQ worker classes: RQ's, with hybridq's claim and outcome inside RQ's own round trips.

Under a plain RQ worker, :func:`hybridq.worker.execute` makes two Redis round trips of its own
per job, the claim before the task and the outcome after it, on top of the 20 RQ makes (W1 in
docs/benchmarks.md). :class:`SimpleWorker` and :class:`Worker` (``hybridq worker`` runs them)
fold both into pipelines RQ sends anyway, and cut RQ's own count:

* **the claim** rides at the end of the MULTI/EXEC pipeline RQ sends before it starts a job
  (``prepare_job_execution``: job status ``started``, ``started_at``, heartbeats). It runs after
  RQ's writes, in the same transaction, and :func:`~hybridq.worker.execute` reads its reply
  before it calls the task, exactly as it reads its own claim's: a stored outcome still means
  no run, a taken lease still means wait;
* **the outcome script** (outcome + completion event, one atomic Lua script, as before) rides
  with the job heartbeat RQ writes as soon as the job returned (``handle_execution_ended``, on
  the success and the failure path alike), before RQ records the job's result;
* **RQ's worker heartbeat** (``HSET`` and two ``EXPIRE``, sent three times per job outside any
  pipeline) goes as one pipeline: the same commands, one round trip instead of three. And one
  that would set the same TTL as one sent or queued less than :data:`HEARTBEAT_GAP_S` earlier
  is skipped (the two RQ sends around each dequeue, right after the heartbeat of its suspension
  check): the worker key then expires at most that much sooner than under RQ's classes. The
  worker key is RQ's listing of live workers; no job's fate depends on it (RQ finds abandoned
  jobs by their executions' expiry, hybridq by its lease).

A reply that is lost is handled as :func:`~hybridq.worker.execute` handles its own: the
pipeline before the job is sent again with the same token (RQ's part of it is idempotent, and
the claim recognises its own lease); the outcome script is sent again on its own, with its
token (a copy that got through answers 2 and is not counted twice). A script Redis does not know
(``NOSCRIPT``: Redis restarted) is answered with an error and did not run: ``execute`` then
claims on its own, or the outcome is sent on its own, and either call loads the script.

RQ's job statuses, registries and results are written by RQ's own code, unchanged; only where
hybridq's two scripts travel differs. Both pipelines use hybridq's own client of the worker's
Redis (calls time out in :data:`~hybridq.worker.scripts.CALL_TIMEOUT_S`, not after RQ's socket timeout).

The claim and the outcome ride along for hybridq deliveries only: any other job, and a delivery
that RQ or hybridq will refuse, runs as under RQ's classes (with the heartbeat change above).
Like :mod:`hybridq.worker`, this module must not import the journal.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

from redis.client import Pipeline
from redis.exceptions import RedisError
from rq import SimpleWorker as RQSimpleWorker
from rq import Worker as RQWorker
from rq.job import Job as RQJob
from rq.queue import Queue
from rq.utils import now
from rq.worker.base import BaseWorker

from hybridq.worker.guard import Job
from hybridq.worker.run import RUN_ATTR, Run, finish, finished, plan, release
from hybridq.worker.scripts import CLAIM_SHA, FINISH_SHA, client, retrying

__all__ = ["HEARTBEAT_GAP_S", "SimpleWorker", "Worker", "unsubscribe_promptly"]

#: A worker heartbeat with the TTL of one sent or queued less than this long before is skipped.
HEARTBEAT_GAP_S = 1.0

# Module globals, read at each call (a test replaces _FINISH_SHA to force the fallback).
_CLAIM_SHA = CLAIM_SHA
_FINISH_SHA = FINISH_SHA


def unsubscribe_promptly(worker: BaseWorker) -> None:
    """RQ's ``unsubscribe``, with the pub/sub thread told to stop *before* the UNSUBSCRIBE goes.

    RQ sends UNSUBSCRIBE, then ``PubSubWorkerThread.stop()``, which joins the thread with no
    time limit since redis-py 8.2. A thread that handled the UNSUBSCRIBE reply before ``stop()``
    cleared its flag is back in ``get_message(timeout=60)``, waiting the whole minute for a
    subscription (the join RQ follows it with, ``timeout=1``, never comes first): a burst or
    stopped worker then took 60 s to exit. Clearing the flag first, the reply ends the thread's
    loop; the join is bounded; the thread is a daemon, so one still waiting ends with the process.
    """
    thread: Any = worker.pubsub_thread  # RQ declares it None until subscribe()
    if not thread:
        return
    if "timeout" in inspect.signature(thread.stop).parameters:
        thread.stop(timeout=0)  # redis-py >= 8.2: the flag, without the unbounded join
    else:
        thread.stop()  # earlier redis-py: stop() only clears the flag
    pubsub: Any = worker.pubsub
    pubsub.unsubscribe()
    thread.join(timeout=1)
    pubsub.close()


class _Pipelining(BaseWorker):
    """What :class:`SimpleWorker` and :class:`Worker` add to RQ's classes (module docstring)."""

    #: Job class: hybridq's (RQ imports no function but hybridq's entry point, see hybridq/worker/guard.py).
    job_class = Job
    #: RQ logs "result is kept for N seconds" after every job at INFO: one line per job that says
    #: nothing about hybridq's outcome (the forwarder's ledger keeps that).
    log_result_lifespan = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # `rq worker -w hybridq.rqworker.SimpleWorker` passes RQ's own job class by default:
        # keep hybridq's guard then (a subclass given on purpose is kept).
        if kwargs.get("job_class") in (RQJob, "rq.job.Job"):
            kwargs["job_class"] = Job
        super().__init__(*args, **kwargs)

    #: (time.monotonic(), TTL) of the last heartbeat sent or queued in a pipeline.
    _last_beat: tuple[float, int] | None = None

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        """RQ's heartbeat in one round trip, or none if one with its TTL was just sent."""
        ttl = timeout or self.worker_ttl + 60  # RQ's default
        at = time.monotonic()
        if pipeline is not None:
            # Counted as sent: if RQ's pipeline fails, the error ends what RQ was doing anyway.
            super().heartbeat(timeout, pipeline=pipeline)
            self._last_beat = (at, ttl)
            return
        last = self._last_beat
        if last is not None and last[1] == ttl and at - last[0] < HEARTBEAT_GAP_S:
            return  # the key's expiry would move less than HEARTBEAT_GAP_S
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(timeout, pipeline=pipe)
            pipe.execute()
        self._last_beat = (at, ttl)

    def unsubscribe(self) -> None:
        """RQ's, without its minute-long wait at exit (:func:`unsubscribe_promptly`)."""
        unsubscribe_promptly(self)

    def execute_job(self, job: RQJob, queue: Queue) -> None:
        """RQ's; then the next heartbeat is sent whatever came before (it shortens the TTL)."""
        super().execute_job(job, queue)
        # A forked work-horse's heartbeat set the job's longer TTL, unknown to this process.
        self._last_beat = None

    def prepare_job_execution(self, job: RQJob, remove_from_intermediate_queue: bool = False) -> None:
        """RQ's bookkeeping before the job starts, with a hybridq delivery's claim in its pipeline."""
        run = plan(job)
        if run is None:
            super().prepare_job_execution(job, remove_from_intermediate_queue)
            return
        self.log.debug("Worker %s: preparing for execution of job ID %s", self.name, job.id)
        conn = client(self.connection)
        # Sent again, with the same token, when the reply is lost: RQ's part is idempotent, and
        # a claim that did run finds the lease its own.
        reply = retrying(lambda: self._prepare_and_claim(conn, job, run, remove_from_intermediate_queue))
        # An error reply (NOSCRIPT: the script is not loaded) means the claim did not run:
        # execute() claims on its own, before the task, as under a plain RQ worker.
        run.claim_reply = None if isinstance(reply, Exception) else reply
        self.procline(f"Processing {job.func_name} from {job.origin} since {time.time()}")  # type: ignore[no-untyped-call]

    def _prepare_and_claim(
        self, conn: Any, job: RQJob, run: Run, remove_from_intermediate_queue: bool
    ) -> Any:
        """The pipeline of RQ's ``prepare_job_execution`` (rq 3.0), then the claim; its reply."""
        with conn.pipeline() as pipe:
            heartbeat_ttl = self.get_heartbeat_ttl(job)
            self.heartbeat(heartbeat_ttl, pipeline=pipe)
            job.heartbeat(now(), heartbeat_ttl, pipeline=pipe)
            job.prepare_for_execution(self.name, pipeline=pipe)
            pipe.persist(job.key)
            if remove_from_intermediate_queue:
                queue = Queue(job.origin, connection=self.connection)
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.evalsha(_CLAIM_SHA, len(run.claim_keys), *run.claim_keys, *run.claim_args)
            *replies, claim = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply  # what RQ's own pipeline.execute() raises
        return claim

    def handle_execution_ended(self, job: RQJob, queue: Queue, heartbeat_ttl: int) -> None:
        """RQ's job heartbeat after the job, with a hybridq delivery's outcome script beside it."""
        run: Run | None = job.__dict__.pop(RUN_ATTR, None)  # once, whichever path calls this
        if run is None or run.finish is None:  # not a pipelined delivery, or its task never ran
            super().handle_execution_ended(job, queue, heartbeat_ttl)
            return
        job.ended_at = now()
        keys_, args = run.finish
        beat: Any = None
        kept: Any = None
        try:
            with client(self.connection).pipeline(transaction=False) as pipe:
                job.heartbeat(now(), heartbeat_ttl, pipeline=pipe)
                pipe.evalsha(_FINISH_SHA, len(keys_), *keys_, *args)
                beat, kept = pipe.execute(raise_on_error=False)
        except RedisError:
            pass  # the reply was lost: whether the script ran is unknown; sent again below
        try:
            if isinstance(kept, int):
                finished(run, kept)
            else:
                # Lost (it may have run: a retry with its token answers 2) or refused (NOSCRIPT: it
                # did not): sent on its own, retried while Redis is unreachable, as execute() does.
                finish(client(self.connection), run)
        finally:
            release(run)  # the lease was renewed until now: stored, or given up
        if beat is None or isinstance(beat, Exception):
            job.heartbeat(now(), heartbeat_ttl)  # RQ's own call, raising as RQ's would


class SimpleWorker(_Pipelining, RQSimpleWorker):
    """RQ's ``SimpleWorker`` (jobs run in the worker process), pipelined for hybridq deliveries."""


class Worker(_Pipelining, RQWorker):
    """RQ's ``Worker`` (a forked work-horse per job), pipelined for hybridq deliveries.

    The work-horse sends both pipelines: it is the process that runs the job.
    """
