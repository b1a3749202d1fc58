"""The processes, servers and faults of one torture run (:mod:`hybridq.testing.torture`).

Its task (:func:`task`), the Redis master and its lagging replica, the fault proxies, the
forwarder, the two pools and the producer's enqueues; the faults act on them.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from hybridq.context import current_job
from hybridq.testing.faultproxy import FaultProxy
from hybridq.testing.torture_check import EffectsTail, read_runs

if TYPE_CHECKING:
    from hybridq.testing.torture import TortureConfig

__all__ = ["KINDS", "QUEUE", "REPLICA_LAG_S", "TASK", "HarnessError", "Stack", "post_mortem", "task"]

QUEUE = "torture"
#: The task, by path (``python -m`` runs this module as ``__main__``).
TASK = "hybridq.testing.torture_stack.task"
#: The kinds of job, and how often each is enqueued.
KINDS = (("quick", 0.55), ("io", 0.25), ("long", 0.12), ("gil", 0.08))
#: The replica's link lags by this much each way (seconds).
REPLICA_LAG_S = 0.3


def task(effects: str, token: str, kind: str, seconds: float) -> str:
    """The torture job: ``B`` at its start, its work, ``E`` at its end (one write each)."""
    job = current_job()
    job_id, attempt = (job.id, job.attempt) if job is not None else ("-", 0)
    _note(effects, "B", job_id, token, attempt)
    if kind == "gil":
        import ctypes  # noqa: PLC0415

        libc = ctypes.PyDLL(None)  # a C call that keeps the GIL: no thread of this process runs
        libc.sleep.argtypes = [ctypes.c_uint]
        left = max(1, round(seconds))
        while left > 0:
            left = libc.sleep(left)
    elif seconds > 0:
        time.sleep(seconds)
    _note(effects, "E", job_id, token, attempt)
    return token


def _note(path: str, kind: str, job_id: str, token: str, attempt: int) -> None:
    line = f"{kind} {job_id} {token} {attempt} {os.getpid()} {time.time():.6f}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Stack:
    """The processes and servers of one run (see the module docstring)."""

    def __init__(self, cfg: TortureConfig, root: str, say: Callable[[str], None]) -> None:
        from hybridq.producer.queue import Queue  # noqa: PLC0415 - only the harness enqueues

        self.cfg, self.root, self.say = cfg, root, say
        self.journal = os.path.join(root, "journal")
        self.effects = os.path.join(root, "effects.txt")
        self.log = open(os.path.join(root, "processes.log"), "a", encoding="utf-8")  # noqa: SIM115
        self.env = {**os.environ, "HYBRIDQ_ALLOW": "hybridq.testing.torture_stack", "PYTHONUNBUFFERED": "1"}
        self.servers = 0
        self.master = self._server()
        self.replica: Any = None
        self.link: FaultProxy | None = None
        self.proxies = [self._proxy() for _ in range(3)]  # the forwarder's, pool A's, pool B's
        self.forwarder: subprocess.Popen[str] | None = None
        self.pools: list[subprocess.Popen[str] | None] = [None, None]
        self.stopping: dict[int, float] = {}  # pool -> when it was asked to stop warmly
        self.queue = Queue(QUEUE, self.journal)
        self.acked: dict[str, float] = {}
        self.lock = threading.Lock()
        self.tail = EffectsTail(self.effects)
        self.next_check = 0.0

    def _server(self, *extra: str, like: Any = None) -> Any:
        """A new server (``like``: on that one's port and directory, to start from its dump)."""
        from hybridq.testing.embedded import RedisServer  # noqa: PLC0415 - imports redis

        if like is None:
            self.servers += 1
            server = RedisServer(directory=os.path.join(self.root, f"redis-{self.servers}"), extra_args=extra)
        else:
            server = RedisServer(port=like.port, directory=like.directory, extra_args=extra)
        server.start()
        return server

    def _proxy(self) -> FaultProxy:
        proxy = FaultProxy("127.0.0.1", self.master.port)
        proxy.start()
        return proxy

    def start(self) -> None:
        """Start the replica, the forwarder and the pools."""
        self._new_replica()
        self.start_forwarder()
        for n in range(len(self.pools)):
            self.start_pool(n)

    def _new_replica(self) -> None:
        self.link = FaultProxy("127.0.0.1", self.master.port)
        self.link.start()
        self.link.latency(REPLICA_LAG_S)
        self.replica = self._server("--replicaof", "127.0.0.1", str(self.link.port))

    def _spawn(self, argv: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=self.env)  # noqa: S603

    def start_forwarder(self) -> None:
        """Start ``hybridq forward`` (again)."""
        argv = [sys.executable, "-m", "hybridq", "forward", "--journal", self.journal]
        argv += ["--redis", self.proxies[0].url, "--lease", str(self.cfg.lease_s)]
        self.forwarder = self._spawn(argv)

    def start_pool(self, n: int) -> None:
        """Start pool ``n`` (again); pool 0 takes ahead whatever runs (:mod:`hybridq.testing.ahead`)."""
        argv = [sys.executable, "-m", "hybridq", "worker", "--redis", self.proxies[1 + n].url]
        argv += ["--processes", "1", "--threads", str(self.cfg.threads)]
        argv += ["--name", f"pool{n}-{time.time():.0f}"]
        if n == 0:
            argv += ["--import", "hybridq.testing.ahead"]
        self.pools[n] = self._spawn([*argv, QUEUE])
        self.stopping.pop(n, None)

    def keep_alive(self) -> None:
        """Restart what exited; a pool stopping warmly is SIGKILLed after 30 s."""
        if self.forwarder is None or self.forwarder.poll() is not None:
            self.start_forwarder()
        for n, proc in enumerate(self.pools):
            if proc is None or proc.poll() is not None:
                self.start_pool(n)
            elif n in self.stopping and time.monotonic() - self.stopping[n] > 30:
                self._kill_tree(proc.pid)

    def enqueue(self, rng: random.Random, n: int = 1, *, quick: bool = False) -> None:
        """Enqueue ``n`` jobs (quick ones only, with ``quick``); acknowledged ones are noted."""
        calls = []
        for _ in range(n):
            kind = "quick" if quick else rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
            seconds = {
                "quick": 0.0,
                "io": rng.uniform(0.02, 0.2),
                "long": rng.uniform(1.0, 4.0),
                "gil": rng.uniform(1.0, 3.0) * self.cfg.lease_s,
            }[kind]
            token = f"{kind}-{rng.getrandbits(40):x}"
            calls.append(self.queue.prepare(TASK, (self.effects, token, kind, round(seconds, 3))))
        jobs = self.queue.enqueue_many(calls)
        now = time.time()
        with self.lock:
            for job in jobs:
                self.acked[job.id] = now

    # -- faults -------------------------------------------------------------------------------

    def snapshot_restart(self, rng: random.Random) -> None:
        """``SAVE``; some more work; SIGKILL the master and start it from that dump."""
        with contextlib.closing(self.master.client()) as client:
            client.save()
        time.sleep(rng.uniform(0.2, 1.5))  # work goes on: the dump is older than what is lost
        self.master.kill()
        # Started from the dump, a master (a promoted replica is no longer one).
        self.master = self._server(like=self.master)

    def promote(self) -> None:
        """SIGKILL the master; promote the replica (behind by its link's lag); move every client."""
        with contextlib.closing(self.replica.client()) as client:
            _wait_synced(client)  # a replica still loading its first sync refuses REPLICAOF NO ONE
            old, self.master = self.master, self.replica
            old.kill()
            client.execute_command("REPLICAOF", "NO", "ONE")
        for proxy in self.proxies:
            proxy.upstream = ("127.0.0.1", self.master.port)
            proxy.reset()
        if self.link is not None:
            self.link.stop()
        old.stop()
        self._new_replica()

    def stop_pool(self, n: int, *, hard: bool) -> tuple[int, ...]:
        """SIGTERM pool ``n`` (warm), or SIGKILL it and its processes (``hard``: their pids)."""
        proc = self.pools[n]
        if proc is None or proc.poll() is not None:
            return ()
        if hard:
            return self._kill_tree(proc.pid)
        proc.send_signal(signal.SIGTERM)
        self.stopping[n] = time.monotonic()
        return ()

    def _kill_tree(self, pid: int) -> tuple[int, ...]:
        from hybridq.testing.topology import children_of  # noqa: PLC0415

        pids = (pid, *children_of(pid))
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return pids

    def close(self) -> None:
        """Stop everything this run started."""
        procs = [p for p in [self.forwarder, *self.pools] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._kill_tree(proc.pid)
                proc.wait()
        for proxy in [*self.proxies, self.link]:
            if proxy is not None:
                proxy.stop()
        for server in (self.master, self.replica):
            if server is not None:
                server.stop()
        self.log.close()


def post_mortem(stack: Stack) -> None:
    """Note what Redis holds of every accepted job that never ended (``stuck.txt``)."""
    runs = read_runs(stack.effects)
    stuck = [job for job in stack.acked if not any(r.kind == "E" for r in runs.get(job, ()))]
    if not stuck:
        return
    with (
        contextlib.closing(stack.master.client()) as client,
        open(os.path.join(stack.root, "stuck.txt"), "w", encoding="utf-8") as f,
    ):
        for job in stuck:
            fields = client.hgetall(f"rq:job:{job}")
            fields.pop(b"data", None)
            queue, inter = f"rq:queue:{QUEUE}", f"rq:queue:{QUEUE}:intermediate"
            where = (client.lpos(queue, job), client.lpos(inter, job))
            f.write(f"{job} queue/intermediate={where} hash={fields}\n")


class HarnessError(RuntimeError):
    """The harness could not set up a fault (not a finding about hybridq): the run is void."""


def _wait_synced(client: Any, timeout_s: float = 30.0) -> None:
    """Wait until a replica has loaded its master's data (its link up, no load in progress).

    The long run died on a promotion of a replica started a few seconds earlier, still loading
    its first full sync (``BusyLoadingError``). A promoted replica that is behind is the fault;
    one that has nothing yet is a different one (a Redis that lost everything), covered elsewhere:
    a replica still not synced after ``timeout_s`` is the harness's failure (:class:`HarnessError`),
    not a promotion to make anyway.
    """
    deadline = time.monotonic() + timeout_s
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.exceptions.BusyLoadingError, redis.exceptions.ConnectionError):
            info = client.info()
            if info.get("master_link_status") == "up" and not info.get("loading"):
                return
        time.sleep(0.1)
    raise HarnessError(
        f"the replica did not load its master's data in {timeout_s:g} s "
        f"(master_link_status={info.get('master_link_status')}, loading={info.get('loading')}): "
        "not promoting it"
    )
