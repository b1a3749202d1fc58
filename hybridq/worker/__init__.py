"""The worker side: the entry point RQ workers call, the idempotency store, the worker loop.

It owns everything a worker process does with a delivery (below), the RQ job class that keeps
RQ from importing anything a job hash names (``guard``) and the records of jobs a worker left for
another one (``waiting``). It may use the protocol, the envelope, the security checks, Redis and
RQ; never the journal, the ledger or the forwarder (import-linter checks it): a worker runs on
any host that reaches Redis.

The forwarder pushes every job as an RQ job whose function is :func:`execute` and whose single
argument is the delivery (the envelope, the owning forwarder, the attempt; see
:class:`hybridq.protocol.Delivery`). So a plain ``rq worker --serializer
rq.serializers.JSONSerializer QUEUE`` runs hybridq jobs with every guarantee below, and
``hybridq worker`` (:func:`run_worker`) is that plus a loop that survives Redis going away. It
runs hybridq's worker classes (:mod:`hybridq.rqworker`), which send the claim (1.) and the
record (3.) inside the pipelines RQ sends before and after each job instead of as round trips
of their own: :func:`~hybridq.worker.run.plan` prepares the claim, and :func:`execute` reads its
reply where it would have made the call, and leaves the record for the worker to send.

Redis write access must not be code execution. :class:`Job`, the job class every hybridq worker
uses (``rq worker --job-class hybridq.worker.Job`` for a plain RQ worker), makes RQ resolve no
function but :func:`execute` (or one :mod:`hybridq.security.allow` allows, when no signing key is
configured) before it imports anything. Then, for each delivery, :func:`execute`:

0. **checks** the envelope's signature when this worker holds a signing key
   (:mod:`hybridq.security.signing`), then that its function is allowed (:mod:`hybridq.security.allow`) and
   imports; a job failing the signature or refused for security fails for good, reported to
   the forwarder, with nothing imported or claimed; one this worker is merely not set up for
   (no ``--allow`` covers it, or its task does not import here) is left for another worker,
   with no attempt used (:mod:`hybridq.worker.waiting`);
1. **claims** the idempotency key in one script: a stored success (or a final failure) is
   returned without calling the task (a *suppressed duplicate*); otherwise it takes the key's
   lease (``SET NX PX``), so two deliveries of one key never run the task at the same time (the
   second waits, then finds the first one's result);
2. **renews** the lease from a thread (one per process; in the pool, its supervisor renews it
   too: :mod:`~hybridq.worker.keeper`) while the task runs and until its outcome is stored or
   given up: when the worker or its work-horse is killed, the lease expires within ``lease_s``
   and the forwarder delivers the job again;
3. **records** the outcome and a completion event for the owning forwarder in one atomic step
   (a Lua script: all or nothing, like MULTI/EXEC), and frees the lease.

The package, one job per module: :mod:`~hybridq.worker.run` (:func:`execute`, the claim and the
outcome), :mod:`~hybridq.worker.admit` (what is checked before the claim, and the events),
:mod:`~hybridq.worker.lease` (the renewer thread), :mod:`~hybridq.worker.scripts` (the Lua
scripts and the client they go through), :mod:`~hybridq.worker.loop` (:func:`run_worker`: RQ's
loop, ``hybridq worker --rq``); and ``hybridq worker``'s default, a pool of processes that run
many jobs each with the same claim, lease and outcome: :mod:`~hybridq.worker.pool` (the
supervisor), :mod:`~hybridq.worker.engine` (one process's loop), :mod:`~hybridq.worker.runner`
(threads, event loop, timeouts), :mod:`~hybridq.worker.perform` (one job of a batch),
:mod:`~hybridq.worker.intake` (what a job taken is: one to run here, or RQ's code's),
:mod:`~hybridq.worker.starter` (claims made as tasks start, reservations given back) and
:mod:`~hybridq.worker.batch_scripts` (the batched Lua); :mod:`~hybridq.worker.guard` (the job
class) and :mod:`~hybridq.worker.waiting` (jobs left for another worker).
:data:`ENTRY_POINT` (``hybridq.worker.execute``) and :class:`Job` (``hybridq.worker.Job``) are
paths RQ imports, from job hashes already in Redis and from ``rq worker --job-class``: they stay
here. The worker side must not import the journal (pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

from hybridq.errors import DuplicateOfFailedJob, NotAllowed, StaleDelivery, TaskUnavailable
from hybridq.protocol import ENTRY_POINT
from hybridq.worker.guard import Job

# Private names of the single-module worker (hybridq 0.1) that tests read through this module.
# Nothing in hybridq uses them here; to change their behaviour, patch the defining module.
from hybridq.worker.lease import _LeaseRenewer  # noqa: F401
from hybridq.worker.loop import RECONNECT_MAX_S, STABLE_S, WORKER_TTL_S, run_worker
from hybridq.worker.run import BUSY_POLL_S, MAX_ERROR_CHARS, execute
from hybridq.worker.scripts import _CLAIM, _FINISH, CALL_TIMEOUT_S, FINISH_PATIENCE_S, _script  # noqa: F401
from hybridq.worker.scripts import client as _client  # noqa: F401

__all__ = [
    "BUSY_POLL_S",
    "CALL_TIMEOUT_S",
    "ENTRY_POINT",
    "FINISH_PATIENCE_S",
    "MAX_ERROR_CHARS",
    "RECONNECT_MAX_S",
    "STABLE_S",
    "WORKER_TTL_S",
    "DuplicateOfFailedJob",
    "Job",
    "NotAllowed",
    "StaleDelivery",
    "TaskUnavailable",
    "execute",
    "run_worker",
]
