"""``hybridq worker``'s default: a pool of long-lived processes, each running many jobs at once.

:func:`run_pool` checks Redis once, then forks ``processes`` children (one per core by default),
each an :class:`~hybridq.worker.engine.Engine` with its own threads, and supervises them:

* a child that ends to be replaced (``--max-jobs``, ``--max-memory``, a job stuck past its
  timeout) is replaced at once; one that dies (a task crashed the interpreter, the OOM killer)
  is replaced too, after a backoff that grows while children keep dying young. Its jobs are
  delivered again by the forwarder once their leases lapse (docs/worker.md);
* a child whose watchdog stopped stamping its liveness for :data:`HANG_S` (a C call holding the
  GIL) is killed, and replaced;
* it renews the leases its children hold, as they do themselves (:mod:`hybridq.worker.keeper`):
  a task holding the GIL for longer than its lease does not lose it;
* SIGTERM or SIGINT asks every child to stop warmly (take nothing more, finish, record, exit); a
  second one kills them. A child Redis refuses (password, database, ACL) stops the pool (exit 1);
* with ``--burst``, the pool ends once every child found the queues empty;
* with ``--with-scheduler``, it runs RQ's scheduler (for plain RQ jobs scheduled on the queues).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import signal
import struct
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from hybridq.protocol import keys
from hybridq.security.signing import keyring
from hybridq.transport import redisurl
from hybridq.worker import lease
from hybridq.worker.engine import EXIT_RECYCLE, EXIT_REFUSED, Engine
from hybridq.worker.gcpace import pace_pool_process
from hybridq.worker.keeper import Channel, Keeper
from hybridq.worker.loop import check_access
from hybridq.worker.runner import CANCEL_GRACE_S

__all__ = ["HANG_S", "PoolOptions", "run_pool"]

log = logging.getLogger("hybridq.worker")

#: A child whose watchdog has not stamped its liveness for this long is killed (seconds).
HANG_S = 60.0
#: A child that dies within this long of its start counts as dying young (seconds).
YOUNG_S = 10.0
#: The longest wait before a child that keeps dying young is started again (seconds).
RESTART_MAX_S = 30.0
_TICK_S = 0.2
#: RQ's pub/sub command channel prefix (rq.command.PUBSUB_CHANNEL_TEMPLATE).
RQ_PUBSUB = f"{keys.RQ_PREFIX}:pubsub:"


@dataclass(frozen=True)
class PoolOptions:
    """How each child process runs (``hybridq worker``'s options)."""

    processes: int
    threads: int = 8
    async_concurrency: int = 100
    max_jobs: int | None = None
    max_memory_mb: float | None = None
    with_scheduler: bool = False
    #: How long a cancelled job may run on before it is stopped (seconds).
    cancel_grace_s: float = CANCEL_GRACE_S


@dataclass
class _Child:
    index: int
    pid: int
    started: float
    #: Its RQ pub/sub command channel (dropped when it ends).
    channel: str


def run_pool(
    queues: Sequence[str], *, url: str, options: PoolOptions, burst: bool = False, name: str | None = None
) -> int:
    """Run the pool on ``queues`` until stopped, or out of work with ``burst``; its exit status.

    0 when stopped or done; 1 if Redis is unreachable in burst mode, or refuses a child (a
    refusal at start raises RedisRefused).
    """
    ring = keyring()  # a key configured but unusable stops the worker here, not in each child
    if ring is not None:
        log.info("verifying envelope signatures (%s, %d key(s))", ring.source, len(ring.keys))
    conn = redisurl.client(url, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        check_access(conn, queues)
    except RedisError as exc:
        if redisurl.refusal(exc) is not None:
            raise redisurl.transport_error(exc) from exc
        if burst:
            log.error("Redis unavailable (%s): --burst does not wait for it; exiting 1, nothing run", exc)
            return 1
        log.warning("Redis unavailable (%s): the worker processes wait for it", exc)
        down = True
    else:
        down = False
    finally:
        conn.close()
    pool = _Pool(list(queues), url, options, burst, name)
    pool.redis_down = down
    return pool.run()


class _Pool:
    def __init__(
        self, queues: list[str], url: str, options: PoolOptions, burst: bool, name: str | None
    ) -> None:
        self.queues = queues
        self.url = url
        self.options = options
        self.burst = burst
        #: The pool's RQ name; each process is "NAME.INDEX.N" (N: its restarts, so that a new
        #: process never meets the registration of the one it replaces).
        self.name = name or uuid.uuid4().hex[:12]
        self.spawns = [0] * max(1, options.processes)
        #: RQ's pub/sub command channels of the pool and its processes (see _commands).
        self.pubsub: Any = None
        self.pubsub_client: Any = None
        self.channels: set[str] = {f"{RQ_PUBSUB}{self.name}"}
        #: The channel of the shutdown command that stopped the pool, if one did.
        self.commanded: str | None = None
        self.size = max(1, options.processes)
        self.alive = mmap.mmap(-1, 8 * self.size)  # shared with the children: their liveness stamps
        self.children: dict[int, _Child] = {}
        self.stopping = 0
        self.code = 0
        self.finished: set[int] = set()
        self.delay = 0.25  # the first restart of a young process waits 0.5 s (1 s: one dying at start)
        #: Children to start again: (when, index).
        self.restarts: list[tuple[float, int]] = []
        self.scheduler: Any = None
        #: Renews the leases the children hold (they tell it through a pipe each).
        self.keeper = Keeper(url)
        #: Redis was unavailable at start (said once): the first children wait for it silently.
        self.redis_down = False

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._signal)
        log.info(
            "worker pool on %s: %d process(es) x %d thread(s)%s",
            ", ".join(self.queues),
            self.size,
            self.options.threads,
            " (burst)" if self.burst else "",
        )
        # RQ's worker classes, which each process registers with: loaded once here, not by each
        # process after the fork, on its way to its first job.
        import hybridq.rqworker  # noqa: F401, PLC0415

        for index in range(self.size):
            self._spawn(index)
        next_upkeep = 0.0
        while self.children or (self.restarts and not self.stopping):
            self._reap()
            self._restart_due()
            self._commands()
            self._check_hangs()
            if time.monotonic() >= next_upkeep and not self.stopping:
                next_upkeep = time.monotonic() + 10.0
                self._scheduler_upkeep()
            self.keeper.wait(_TICK_S)  # and renew the children's leases that are due
        if self.scheduler is not None and self.scheduler._process is not None:
            self.scheduler._process.terminate()
        if self.pubsub is not None:
            with contextlib.suppress(RedisError):
                self.pubsub.close()
        if self.commanded is not None and self.code == 0:
            log.warning(
                "stopped by RQ's shutdown command (Redis pub/sub channel %s), not by a signal: "
                "exiting 0; a supervisor restarts this worker only with Restart=always (docs/deploy.md)",
                self.commanded,
            )
        return self.code

    def _commands(self) -> None:
        """Stop the pool on RQ's pub/sub "shutdown" command to it or any of its processes.

        Anyone who may PUBLISH on Redis can send it (``rq shutdown``): it is said, not silent.
        Polled (no thread: this process forks).
        """
        try:
            if self.pubsub is None:
                # The client is kept: redis-py closes its connections, the subscription's
                # included, when the client object is collected (a command sent then was lost).
                # health_check_interval: a master gone without a reset (a host crash, a
                # partition, a failover) is noticed by a PING, and the pool subscribes anew.
                self.pubsub_client = redisurl.client(self.url, socket_timeout=5.0, health_check_interval=15)
                self.pubsub = self.pubsub_client.pubsub(ignore_subscribe_messages=True)
                self.pubsub.subscribe(*self.channels)
            message = self.pubsub.get_message(timeout=0)
        except RedisError:
            if self.pubsub is not None:
                with contextlib.suppress(RedisError):
                    self.pubsub.close()
            self.pubsub = None  # subscribed again next turn
            return
        if message is None or self.stopping:
            return
        try:
            command = json.loads(message["data"]).get("command")
        except (ValueError, TypeError, AttributeError):
            return
        if command == "shutdown":
            channel = message.get("channel")
            channel = channel.decode(errors="replace") if isinstance(channel, bytes) else str(channel)
            log.warning("RQ shutdown command received on %s: stopping after the current jobs", channel)
            self.commanded = channel
            self._signal(signal.SIGTERM, None)

    def _signal(self, _signum: int, _frame: object) -> None:
        self.stopping += 1
        kill = signal.SIGTERM if self.stopping == 1 else signal.SIGKILL
        if self.stopping == 1:
            log.info("stopping: each worker process finishes its jobs, records them and exits (again: kill)")
        for child in list(self.children.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, kill)

    def _spawn(self, index: int) -> None:
        struct.pack_into("d", self.alive, 8 * index, 0.0)
        parent = os.getpid()
        # No signal between the fork and the child's registration (it would not be passed on),
        # nor in the child before it drops the parent's handlers.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        leases_read, leases_write = os.pipe()  # the child's leases, to self.keeper
        pid = os.fork()
        if pid == 0:  # the child
            code = 2
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                _term_with_parent()
                os.close(leases_read)
                self.keeper.close_in_child()
                lease.supervise(Channel(leases_write))
                pace_pool_process()
                name = f"{self.name}.{index}.{self.spawns[index]}"
                engine = Engine(
                    self.url,
                    self.queues,
                    threads=self.options.threads,
                    async_concurrency=self.options.async_concurrency,
                    burst=self.burst,
                    name=name,
                    max_jobs=self.options.max_jobs,
                    max_memory_mb=self.options.max_memory_mb,
                    stamp=lambda at: struct.pack_into("d", self.alive, 8 * index, at),
                    parent=parent,
                    quiet=self.redis_down and self.spawns[index] == 0,
                )
                engine.runner.cancel_grace_s = self.options.cancel_grace_s
                code = engine.run()
            except BaseException:
                log.exception("worker process %d failed", os.getpid())
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(leases_write)
        self.keeper.add(pid, leases_read)
        self.children[pid] = _Child(
            index, pid, time.monotonic(), f"{RQ_PUBSUB}{self.name}.{index}.{self.spawns[index]}"
        )
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.channels.add(self.children[pid].channel)
        self.spawns[index] += 1
        if self.pubsub is not None:
            with contextlib.suppress(RedisError):
                self.pubsub.subscribe(*self.channels)

    def _reap(self) -> None:
        for pid, child in list(self.children.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done == 0:
                continue
            self.keeper.drop(pid)  # its leases lapse within a lease: its jobs are delivered again
            del self.children[pid]
            self.channels.discard(child.channel)
            if self.pubsub is not None:
                with contextlib.suppress(RedisError):
                    self.pubsub.unsubscribe(child.channel)
            code = os.waitstatus_to_exitcode(status)
            self._after(child, code)

    def _after(self, child: _Child, code: int) -> None:
        """Decide what follows the end of ``child`` (exit status ``code``; negative: a signal)."""
        if code == EXIT_REFUSED:
            self.code = 1
            if not self.stopping:
                self._signal(signal.SIGTERM, None)  # the configuration is wrong for every child
            return
        if self.stopping:
            return
        if code == 0 and self.burst:
            self.finished.add(child.index)
            return
        if code == 1 and self.burst:
            self.code = 1  # Redis unreachable: burst mode does not wait (logged by the child)
            return
        if code == EXIT_RECYCLE:
            self._spawn(child.index)
            return
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        (stamp,) = struct.unpack_from("d", self.alive, 8 * child.index)
        young = time.monotonic() - child.started < YOUNG_S
        if not young:
            self.delay = 0.0  # it had been serving: a job killed it, replace it at once
        elif stamp:  # serving, but dying young again and again: back off, from 0.5 s
            self.delay = min(RESTART_MAX_S, max(0.5, self.delay * 2))
        else:  # it died starting: back off while that keeps happening
            self.delay = min(RESTART_MAX_S, max(1.0, self.delay * 2))
        log.warning(
            "worker process %d died (%s): its jobs are delivered again once their leases lapse; "
            "starting another in %.0f s",
            child.pid,
            how,
            self.delay,
        )
        self.restarts.append((time.monotonic() + self.delay, child.index))

    def _restart_due(self) -> None:
        now = time.monotonic()
        for entry in [r for r in self.restarts if r[0] <= now]:
            self.restarts.remove(entry)
            if not self.stopping:
                self._spawn(entry[1])

    def _check_hangs(self) -> None:
        now = time.monotonic()
        for child in list(self.children.values()):
            (stamp,) = struct.unpack_from("d", self.alive, 8 * child.index)
            if stamp and now - stamp > HANG_S:
                log.error(
                    "worker process %d has not run its watchdog for %.0f s (a call holding the GIL?): "
                    "killing it",
                    child.pid,
                    now - stamp,
                )
                struct.pack_into("d", self.alive, 8 * child.index, 0.0)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)

    def _scheduler_upkeep(self) -> None:
        """Run RQ's scheduler (``--with-scheduler``): take its lock, start it if it is not running."""
        if not self.options.with_scheduler:
            return
        from rq.queue import Queue  # noqa: PLC0415
        from rq.scheduler import RQScheduler  # noqa: PLC0415
        from rq.serializers import JSONSerializer  # noqa: PLC0415

        try:
            if self.scheduler is None:
                conn = redisurl.client(self.url, socket_timeout=10.0, socket_connect_timeout=10.0)
                qs = [Queue(q, connection=conn, serializer=JSONSerializer) for q in self.queues]
                self.scheduler = RQScheduler(qs, connection=conn, serializer=JSONSerializer)
            process = self.scheduler._process
            if process is None or not process.is_alive():
                self.scheduler.acquire_locks(auto_start=True)
        except RedisError as exc:
            log.warning("RQ's scheduler: %s", exc)


def _term_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies.

    Linux only; elsewhere the engine notices its parent is gone on its next turn.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1
