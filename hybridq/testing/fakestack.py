"""The real forward → RQ → worker path in one process, on fakeredis: no redis-server needed.

:func:`fake_stack` runs hybridq's own :class:`~hybridq.forwarder.loop.Forwarder` (its Lua scripts
included) against an in-process `fakeredis <https://pypi.org/project/fakeredis/>`_ server with
Lua support, and hybridq's RQ worker class (:class:`hybridq.rqworker.SimpleWorker`, the one
``hybridq worker --rq`` runs, with the claim and outcome scripts) in burst mode, in the calling
thread. :meth:`FakeStack.run` repeats forward, work, harvest until no job is pending: jobs end in
the durable ledger exactly as in production (``hybridq.failed_jobs`` lists the failures).

Needs ``fakeredis[lua]`` (``pip install 'hybridq[testing]'``). What it does not model is in
``docs/testing.md``: one worker, no worker process (no pool, no kill), no Redis persistence or
restart, fakeredis's own fidelity.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from hybridq.extras import require
from hybridq.forwarder.loop import Forwarder
from hybridq.ops.status import collect_status
from hybridq.producer.queue import Queue
from hybridq.rqworker import SimpleWorker
from hybridq.security.allow import ENV_VAR as ALLOW_VAR
from hybridq.transport.rq import RQTransport
from hybridq.worker import Job as WorkerJob

__all__ = ["FakeStack", "fake_stack"]

#: Rounds of :meth:`FakeStack.run` at most: a task that enqueues itself forever stops there.
MAX_ROUNDS = 10_000


class FakeStack:
    """A forwarder and a worker on one fakeredis server, for one journal (see the module docstring).

    While active (``with``), ``HYBRIDQ_JOURNAL`` names its journal, so ``Queue()`` and
    ``task.delay()`` enqueue there, and ``allow`` is added to ``HYBRIDQ_ALLOW``; both are put
    back at exit. The forwarder's clock is :attr:`clock`: :meth:`run` moves it on to the next
    due retry or delayed job instead of waiting for it.
    """

    def __init__(
        self,
        journal: str | os.PathLike[str],
        *,
        queues: Iterable[str] = ("default",),
        allow: str | Iterable[str] = (),
        **forwarder_options: Any,
    ) -> None:
        require("testing", "fake_stack")
        import fakeredis  # noqa: PLC0415 - an optional dependency

        self.server = fakeredis.FakeServer()
        #: The client of everything here; look at RQ's keys with it.
        self.redis = fakeredis.FakeRedis(server=self.server)
        self.journal = os.fspath(journal)
        self.queues = list(queues)
        self.allow = [allow] if isinstance(allow, str) else list(allow)
        #: Seconds the forwarder's clock is ahead of the wall clock.
        self.offset = 0.0
        self.transport = RQTransport(connection=self.redis)
        self.forwarder = Forwarder(self.journal, self.transport, clock=self.clock, **forwarder_options)
        self.worker = SimpleWorker(
            self.queues, connection=self.redis, serializer=JSONSerializer, job_class=WorkerJob
        )
        self._env: dict[str, str | None] = {}

    def clock(self) -> float:
        """The forwarder's clock: the wall clock plus :attr:`offset`."""
        return time.time() + self.offset

    def __enter__(self) -> Self:
        self.forwarder.open()
        allowed = [p for p in os.environ.get(ALLOW_VAR, "").split(",") if p] + self.allow
        for name, value in (("HYBRIDQ_JOURNAL", self.journal), (ALLOW_VAR, ",".join(allowed))):
            self._env[name] = os.environ.get(name)
            os.environ[name] = value
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        for name, value in self._env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.forwarder.close()

    def queue(self, name: str = "default") -> Queue:
        """A queue on this stack's journal."""
        return Queue(name, self.journal)

    def run(self, *, timeout: float = 30.0) -> dict[str, Any]:
        """Forward, work and harvest until no job is pending; ``hybridq status --json``'s counts.

        Retries and delayed jobs are not waited for: the forwarder's clock skips to them.

        Raises:
            TimeoutError: jobs are still pending after ``timeout`` seconds (wall clock).
        """
        deadline = time.monotonic() + timeout
        for _ in range(MAX_ROUNDS):
            moved = self.forwarder.step()
            worked = self.worker.work(burst=True, logging_level="WARNING")
            moved += self.forwarder.step()  # harvests what the worker just reported
            status = collect_status(self.journal)
            if status["pending"] == 0:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"{status['pending']} jobs still pending after {timeout:g} s")
            if not moved and not worked:
                self._skip_to_next_due()
                time.sleep(0.01)  # an event or a lease in flight
        raise TimeoutError(f"run() made {MAX_ROUNDS} rounds and jobs are still pending")

    def _skip_to_next_due(self) -> None:
        """Move the forwarder's clock on to its next held job or retry, if one waits."""
        due = [held.run_at for held in self.forwarder.checkpoint.held]
        due += [run_at for run_at, _attempt in self.forwarder.state.index.retries.values()]
        now = self.clock()
        later = [t for t in due if t > now]
        if later:
            self.offset += min(later) - now

    def result(self, job_id: str) -> Any:
        """What the task of ``job_id`` returned, as RQ keeps it (``None`` if it has not)."""
        return RQJob.fetch(job_id, connection=self.redis, serializer=JSONSerializer).return_value()


def fake_stack(
    journal: str | os.PathLike[str],
    *,
    queues: Iterable[str] = ("default",),
    allow: str | Iterable[str] = (),
    **forwarder_options: Any,
) -> FakeStack:
    """A :class:`FakeStack` on ``journal``, to use as a context manager (``with ... as stack:``)."""
    return FakeStack(journal, queues=queues, allow=allow, **forwarder_options)
