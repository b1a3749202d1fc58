"""What a pool process makes of the jobs it takes: a job to run here, or one for RQ's own code.

:func:`prepare` makes a :class:`~hybridq.worker.runner.Taken` of a job hash's fields (what
:data:`~hybridq.worker.batch_scripts.TAKE` returns), with the task's function resolved and
admitted once per path (:class:`Resolver`); a job it cannot make one of (not a hybridq delivery
this worker can run) is run by RQ's own worker code (:func:`run_by_rq`), as ``hybridq worker
--simple`` would.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError
from rq.queue import Queue
from rq.serializers import JSONSerializer

from hybridq.envelope.model import Envelope
from hybridq.protocol import ENTRY_POINT, Delivery, keys
from hybridq.security.signing import keyring
from hybridq.transport.rq_codec import plain_data
from hybridq.worker.admit import check
from hybridq.worker.run import Run
from hybridq.worker.runner import Taken

__all__ = ["Resolver", "prepare", "run_by_rq"]

log = logging.getLogger("hybridq.worker")


def prepare(job_id: str, queue: str, fields: list[Any], resolve: Callable[[Envelope], Any]) -> Taken | None:
    """The job to run from its hash's fields, or ``None`` if RQ's code must run it."""
    data, origin, run_no, on_success, on_failure, on_stopped, timeout, result_ttl, failure_ttl = fields
    if run_no is None or on_success or on_failure or on_stopped or origin is None or origin.decode() != queue:
        return None
    try:
        # Decoded as RQ's JSONSerializer does (UTF-8), not by json.loads's guess at the encoding
        # of bytes: about 0.9 us less a job (docs/benchmarks.md, "The pool's Python per job").
        func_name, instance, args, kwargs = json.loads(plain_data(data).decode())
        if func_name != ENTRY_POINT or instance is not None or len(args) != 1 or kwargs:
            return None
        d = Delivery.from_json(args[0])
        env = d.envelope
        if env.id != job_id or env.queue != queue:
            return None  # a copy of another job: RQ's code refuses it, unreported
        func = resolve(env)
        if func is None:
            return None  # refused or not importable here: RQ's code reports or leaves it
        item = Taken(job_id, queue, Run.new(args[0], d, func))
        seconds = int(timeout) if timeout else Queue.DEFAULT_TIMEOUT
        item.timeout = None if seconds < 0 else float(seconds)
        item.result_ttl = int(result_ttl) if result_ttl else 500
        item.failure_ttl = int(failure_ttl) if failure_ttl else 31536000
    except Exception:
        return None
    return item


class Resolver:
    """The function to run for an envelope (:func:`~hybridq.worker.admit.check`).

    Resolved once per path when no signing key is configured (a signature is each envelope's own).
    """

    def __init__(self) -> None:
        self._funcs: dict[str, Callable[..., Any]] = {}

    def __call__(self, env: Envelope) -> Callable[..., Any] | None:
        """The function for ``env``; ``None`` if refused or not importable here."""
        if keyring() is not None:
            return check(env)[0]
        func = self._funcs.get(env.func)
        if func is None:
            func = check(env)[0]
            if func is not None:
                self._funcs[env.func] = func
        return func


def run_by_rq(rq_worker: Any, rq_queue: Queue, job_id: str, *, several_queues: bool) -> None:
    """Run one job with RQ's own worker code (hybridq's pipelining SimpleWorker), in this thread."""
    conn = rq_worker.connection
    try:
        job = rq_queue.job_class.fetch(job_id, connection=conn, serializer=JSONSerializer)
        rq_worker.execute_job(job, rq_queue)
    except Exception:  # RQ logs and records what a job does; this is what it did not catch
        log.exception("job %s: RQ's worker code failed on it", job_id)
    finally:
        if several_queues:  # RQ removes it from its intermediate list only when it serves one queue
            with contextlib.suppress(RedisError):
                conn.lrem(keys.rq_intermediate(rq_queue.name), 1, job_id)
