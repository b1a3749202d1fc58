"""One process of the pool worker: jobs taken, started and ended in batches, run on a Runner.

:class:`Engine` is the loop of one ``hybridq worker`` process (:mod:`hybridq.worker.pool` starts
one per core). Each turn it ends the jobs its :class:`~hybridq.worker.runner.Runner` finished
and takes as many queued jobs as it has room for (:data:`~hybridq.worker.batch_end.END` and
:data:`~hybridq.worker.batch_scripts.TAKE`, one round trip): a job taken is only reserved. It is
claimed when a thread is about to run it, with the other jobs starting then
(:data:`~hybridq.worker.batch_scripts.START`, :mod:`hybridq.worker.starter`); a reservation that
waits half a lease, and every one a stopping process holds, is given back to its queue. A few
round trips per batch, not a dozen per job. Each job runs as under an RQ worker
(:mod:`hybridq.worker.run`: docs/worker.md). A job that is not a hybridq delivery this worker
can run (a plain RQ job, a hand-written hash, a task refused or not importable here) is run by
RQ's own code (:class:`~hybridq.rqworker.SimpleWorker`, in the main thread), which refuses,
leaves or runs it exactly as ``hybridq worker --simple`` would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from queue import Empty
from typing import Any

from redis.exceptions import RedisError
from rq.queue import Queue
from rq.serializers import JSONSerializer

from hybridq.protocol import keys
from hybridq.transport import redisurl
from hybridq.worker import batch_scripts, scripts
from hybridq.worker.guard import Job
from hybridq.worker.intake import Resolver, prepare, run_by_rq
from hybridq.worker.loop import WORKER_TTL_S, check_access
from hybridq.worker.perform import Performer, is_async
from hybridq.worker.runner import Runner, Taken
from hybridq.worker.starter import Reservations, Starter

__all__ = ["EXEC_TTL_S", "EXIT_RECYCLE", "EXIT_REFUSED", "Engine"]

log = logging.getLogger("hybridq.worker")

#: The exit status of a process that ends to be replaced (max jobs, max memory, a stuck job).
EXIT_RECYCLE = 3
#: The exit status of a process Redis refuses (password, database, ACL): not restarted.
EXIT_REFUSED = 4
#: How long RQ's records of a running job's execution last without a heartbeat (seconds).
EXEC_TTL_S = 120
#: How long one wait for a job on an idle single queue blocks in Redis (seconds).
IDLE_BLOCK_S = 1.0
#: How often the process's RQ heartbeats are sent and its limits checked (seconds).
BEAT_S = 10.0


class Engine:
    """The loop of one pool worker process (see the module docstring).

    Args:
        url: the Redis URL.
        queues: the queue names, served in this order.
        threads: worker threads; async_concurrency: most ``async def`` jobs at once.
        burst: return once the queues are empty and every job taken has ended.
        name: the RQ worker name of this process.
        max_jobs: end (for a fresh process) after this many jobs; ``None``: never.
        max_memory_mb: end after the process's peak RSS passes this; ``None``: never.
        stamp: the runner's liveness stamp (shared with the pool).
        parent: the pid of the pool process; this one stops if it is gone.
        quiet: the pool logged that Redis is unavailable: wait for it without a line of its own.
    """

    def __init__(
        self,
        url: str,
        queues: Sequence[str],
        *,
        threads: int,
        async_concurrency: int,
        burst: bool = False,
        name: str | None = None,
        max_jobs: int | None = None,
        max_memory_mb: float | None = None,
        stamp: Callable[[float], None] = lambda _now: None,
        parent: int | None = None,
        quiet: bool = False,
    ) -> None:

        self.queues = list(queues)
        self.burst = burst
        self.name = name or uuid.uuid4().hex
        self.max_jobs = max_jobs
        self.max_memory_mb = max_memory_mb
        # RQ's code (registration, heartbeats, jobs run by RQ's code) uses this connection: a hung
        # Redis must time out, as RQ's own worker makes it (it sets its socket timeout in work()).
        self.conn = redisurl.client(url, socket_timeout=WORKER_TTL_S + 10, socket_connect_timeout=10)
        self.client = scripts.client(self.conn)
        job_class = Job.serving_only(self.queues)
        self.rq_queues = {
            q: Queue(q, connection=self.conn, serializer=JSONSerializer, job_class=job_class)
            for q in self.queues
        }
        self._job_class = job_class
        self.rq_worker: Any = None
        #: Started by a pool that said already that Redis is unavailable: wait for it silently.
        self.quiet = quiet
        self.starter = Starter(self.client, self.name, EXEC_TTL_S)
        performer = Performer(self.client, starter=self.starter)
        self.runner = Runner(
            threads, async_concurrency, performer.work, performer.work_async, performer.stuck, stamp
        )
        performer.runner = self.runner
        self.stopping = False
        #: The pool process that started this one (it stops when that one is gone); or None.
        self.parent = parent
        self.ended = 0
        self._queue_keys = [keys.rq_queue(q) for q in self.queues]
        self._resolve = Resolver()
        #: The jobs taken and not yet ended, and those waiting to run alone (_run_isolated).
        self.reserved = Reservations(self.client, self.runner)
        self._isolated = self.reserved.isolated
        #: Jobs done (or dropped) to end in the next turn's round trip.
        self._later: list[Taken] = []
        self._next_beat = 0.0
        self._idle_s = 0.0

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until stopped (0), out of work in burst mode (0), or due for replacement."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._stop)
        try:
            self._connect()
        except _Refused:
            return EXIT_REFUSED
        except RedisError:
            return 1  # burst mode, Redis unreachable (logged)
        log.info(
            "Listening on %s (worker %s, %d threads)", ", ".join(self.queues), self.name, self.runner.threads
        )
        try:
            return self._serve()
        except _Refused:
            return EXIT_REFUSED
        finally:
            self.runner.close()
            if self.rq_worker is not None:
                with contextlib.suppress(RedisError):
                    self.rq_worker.register_death()

    def _serve(self) -> int:
        code = 0
        while True:
            self._beat()
            self.reserved.expire()
            reason = self._leaving()
            if reason is not None:
                self.runner.leaving = True  # a job polling for a busy key gives up (it waits for good)
                self.reserved.give_back(everything=True)  # nothing more starts here
                if self.runner.pending() == 0:
                    # A job may have finished between the last drain and the count: it is on
                    # `done` (put there before it stopped counting), and is ended before the exit.
                    self._end_done(block_s=0.0)
                    if reason != "stopped":
                        log.info("worker %s: %s: exiting for a fresh process", self.name, reason)
                        code = EXIT_RECYCLE
                    return code
                self._end_done(block_s=0.2)
                continue
            if self._isolated:
                self._run_isolated()
                continue
            try:
                ended = self._turn()
            except RedisError as exc:
                if self._unavailable(exc) and self.burst:
                    return 1
                continue  # stopping: the jobs running still finish (_leaving)
            if ended is not None:
                return ended

    def _turn(self) -> int | None:
        """One round trip: end what finished, start what threads are free for, take what fits.

        The jobs started are exactly those the free threads run next: their claims are made
        now, and the threads start them as the reply comes. Returns an exit status to end with
        (burst mode, out of work), else None.
        """
        ready, runner = self.reserved.ready, self.runner
        pending = runner.pending()  # before the drain: if none was pending, the drain gets them all
        done = self._done(0.0)
        self.ended += len(done)  # counted now: --max-jobs's room below
        starting = [ready.popleft() for _ in range(min(runner.threads - runner.sync_pending, len(ready)))]
        # No more than --max-jobs taken in this process's life.
        lifetime = None if self.max_jobs is None else self.max_jobs - self.ended
        room = runner.room(lifetime, waiting=len(ready) + len(starting) + len(self._isolated))
        idle = pending == 0 and not ready and not starting
        take = room if room >= runner.batch() or (room and idle) else 0
        self.reserved.held.difference_update(done)
        running = self.reserved.unrecorded()
        if not (done or starting or take or running):
            self._later = self._done(0.05 if room or ready else 0.5)  # ended in the next turn
            return None
        try:
            taken = self.starter.exchange(done, starting, self._taker(take), running)
        finally:
            for item in starting:
                if item.dropped:  # its claim could not be sent (logged): never started here
                    self._later.append(item)
                else:
                    runner.submit(item)  # claimed (or its answer is there): a free thread starts it now
        if take and self._idle_s:
            log.warning("Redis available again")
            self._idle_s = 0.0
        if taken:
            self._reserve(taken)
        elif idle and take:
            if self.burst:
                return 0
            self._wait_for_work()
        return None

    def _leaving(self) -> str | None:
        if self.stopping:
            return "stopped"
        if self.parent is not None and os.getppid() != self.parent:
            log.warning("worker %s: its pool process is gone: stopping", self.name)
            self.stopping = True
            return "stopped"
        if self.runner.poisoned:
            return "a job is stuck past its timeout"
        if self.max_jobs is not None and self.ended >= self.max_jobs:
            return f"ran {self.ended} jobs (--max-jobs)"
        if self.max_memory_mb is not None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if peak >= self.max_memory_mb:
                return f"peak memory {peak:.0f} MB (--max-memory {self.max_memory_mb:g})"
        return None

    def _stop(self, _signum: int, _frame: object) -> None:
        self.stopping = True

    def _connect(self) -> None:
        """Check access and register with RQ; retry while Redis is unreachable (not in burst)."""
        delay = 0.5
        while True:
            try:
                check_access(self.conn, self.queues)
                if self.rq_worker is None:
                    self.rq_worker = self._new_rq_worker()
                self.rq_worker.register_birth()
                self.rq_worker.set_state("idle")
            except RedisError as exc:
                if self._unavailable(exc, delay):
                    raise
                delay = min(5.0, delay * 2)
            else:
                self._idle_s = 0.0  # "Listening on" says it is back
                self._next_beat = time.monotonic() + BEAT_S  # registered: no heartbeat before the 1st take
                return

    def _new_rq_worker(self) -> Any:
        """RQ's worker object of this process; it talks to Redis as it is made (so: once it answers)."""
        from hybridq.rqworker import SimpleWorker  # noqa: PLC0415 - RQ's worker module is heavy

        return SimpleWorker(
            list(self.rq_queues.values()),
            connection=self.conn,
            serializer=JSONSerializer,
            name=self.name,
            job_class=self._job_class,
            worker_ttl=WORKER_TTL_S,
        )

    def _unavailable(self, exc: RedisError, delay: float = 1.0) -> bool:
        """Deal with Redis failing a call of the loop; True if the loop must end."""
        if redisurl.refusal(exc) is not None:
            log.error("%s", redisurl.transport_error(exc))
            raise _Refused from exc
        if self.burst:
            log.error("Redis unavailable (%s): --burst does not wait for it; exiting 1", exc)
            return True
        if not self._idle_s:
            log.log(logging.DEBUG if self.quiet else logging.WARNING, "Redis unavailable (%s): retrying", exc)
        self._idle_s = delay
        time.sleep(delay)
        return self.stopping

    # -- taking and starting ----------------------------------------------------------------------

    def _taker(self, room: int) -> tuple[list[str], list[Any]] | None:
        """The keys and arguments of a take of up to ``room`` jobs (None: none to take)."""
        return batch_scripts.take_args(self._queue_keys, room) if room else None

    def _wait_for_work(self) -> None:
        """Block until a queue may hold work: BLMOVE on a single queue, a short sleep on several."""
        if len(self.queues) > 1:
            time.sleep(0.05)
            return
        try:
            taken = batch_scripts.wait_one(self.client, self._queue_keys[0], IDLE_BLOCK_S)
        except RedisError as exc:
            self._unavailable(exc)
            return
        self._reserve(taken)

    def _reserve(self, taken: list[Any]) -> None:
        """Keep the jobs ``taken`` (reserved, not claimed) until they start (:meth:`_turn`).

        An ``async def`` task goes to the event loop at once; its coroutine claims it as it
        starts there (:mod:`hybridq.worker.starter`).
        """
        now = time.monotonic()
        for job_id, index, fields in taken:
            queue = self.queues[int(index) - 1]
            item = prepare(job_id.decode(), queue, fields, self._resolve)
            if item is None:  # RQ's code runs it here, once nothing else runs (_run_isolated)
                self._isolated.append(Taken(job_id.decode(), queue, taken_at=now))
                continue
            item.taken_at = now
            item.run.deferred_end = True
            self.reserved.held.add(item)
            if item.run.d.lost:
                self._isolated.append(item)  # run alone: it may be what killed its last process
            elif is_async(item.run.func):
                self.runner.start_async(item)
            else:
                self.reserved.ready.append(item)

    def _run_isolated(self) -> None:
        """Run the next job whose earlier run vanished once nothing else runs; take nothing meanwhile.

        A job that kills its process (a crash in C code, the OOM killer) would take the jobs
        running beside it down with it, at every delivery: alone, it takes only itself. It is
        only reserved while it waits (claimed when it starts), so nothing it shares a key with
        waits for it.
        """
        if self.runner.pending():
            self._end_done(block_s=0.2)
            return
        item = self._isolated.popleft()
        if item.run is None:
            run_by_rq(
                self.rq_worker, self.rq_queues[item.queue], item.job_id, several_queues=len(self.queues) > 1
            )
            self.ended += 1
            return
        log.info(
            "job %s: a run of it vanished before (%d so far): running it alone", item.job_id, item.run.d.lost
        )
        self.runner.submit(item)
        while self.runner.pending():
            self._end_done(block_s=0.2)
            self._beat()
            if self._leaving() is not None:  # a job polling for a busy key gives up (_serve)
                self.runner.leaving = True

    # -- ending -----------------------------------------------------------------------------------

    def _done(self, block_s: float) -> list[Taken]:
        """The jobs the runner has finished (and those kept for this turn); waits up to ``block_s``."""
        done, self._later = self._later, []
        with contextlib.suppress(Empty):
            if block_s > 0 and not done:
                done.append(self.runner.done.get(timeout=block_s))
            while True:
                done.append(self.runner.done.get_nowait())
        return done

    def _end_done(self, block_s: float) -> None:
        """End every job the runner has finished, in one call; wait up to ``block_s`` for one."""
        done = self._done(block_s)
        self.reserved.held.difference_update(done)
        self.ended += len(done)
        running = self.reserved.unrecorded()
        if running or any(not i.dropped for i in done):
            self.starter.exchange(done, [], None, running)

    # -- upkeep -----------------------------------------------------------------------------------

    def _beat(self) -> None:
        """Every BEAT_S: RQ's worker heartbeat and the running jobs' executions kept alive."""
        at = time.monotonic()
        if at < self._next_beat:
            return
        self._next_beat = at + BEAT_S
        try:
            self.rq_worker.heartbeat()
            started = [item for item in self.reserved.held if item.exec_id]
            batch_scripts.keep_alive(self.client, self.name, started, EXEC_TTL_S)
        except RedisError as exc:
            log.warning("cannot send RQ's heartbeats: %s", exc)


class _Refused(Exception):
    """Redis refuses this worker's configuration (logged): the process ends with EXIT_REFUSED."""
