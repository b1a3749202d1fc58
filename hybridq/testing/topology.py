"""The processes of one chaos run and the faults that act on them.

Redis, the fault proxy, the forwarder, workers and producers; :mod:`hybridq.testing.chaos`
drives them and computes the verdict.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from hybridq.crashpoints import NAMES as CRASH_POINTS
from hybridq.testing.faultproxy import FaultProxy
from hybridq.testing.rq_cli import RQ

if TYPE_CHECKING:
    from hybridq.testing.chaos import ChaosConfig

__all__ = ["QUEUE", "Fault", "Topology", "children_of"]

#: The queue every chaos job goes through.
QUEUE = "chaos"


def children_of(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc/<pid>/stat: Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


@dataclass
class Fault:
    """One injected fault: when it started and ended, and what it killed."""

    name: str
    at: float
    end: float
    #: Processes the fault killed (their runs never stored an outcome).
    pids: tuple[int, ...] = ()


class Topology:
    """The processes of one run, and the faults that act on them."""

    def __init__(self, cfg: ChaosConfig, root: str, say: Callable[[str], None]) -> None:
        from hybridq.testing.embedded import RedisServer  # noqa: PLC0415 - imports redis

        self.cfg = cfg
        self.root = root
        self.say = say
        self.journal = os.path.join(root, "journal")
        self.effects = os.path.join(root, "effects.txt")
        self.acks_dir = os.path.join(root, "acks")
        os.makedirs(self.acks_dir, exist_ok=True)
        self.log: IO[str] = open(os.path.join(root, "processes.log"), "a", encoding="utf-8")  # noqa: SIM115
        self.server = RedisServer(directory=os.path.join(root, "redis"))
        self.proxy: FaultProxy | None = None
        self.env = {**os.environ, "HYBRIDQ_ALLOW": "hybridq.testing.chaos", "PYTHONUNBUFFERED": "1"}
        self.forwarder: subprocess.Popen[str] | None = None
        self.workers: list[subprocess.Popen[str] | None] = [None] * cfg.workers
        self.producers: list[subprocess.Popen[str] | None] = [None] * cfg.producers
        self.generation = 0
        self.all: list[subprocess.Popen[str]] = []
        self.restart_at: dict[tuple[str, int], float] = {}

    # processes

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        # argv is this interpreter, with arguments we built: no shell.
        proc = subprocess.Popen(  # noqa: S603
            argv, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env or self.env
        )
        self.all.append(proc)
        return proc

    def start_forwarder(self) -> None:
        """Start ``hybridq forward`` (again)."""
        argv = [sys.executable, "-m", "hybridq", "forward", "--journal", self.journal]
        self.forwarder = self._spawn([*argv, "--redis", self.url, "--lease", str(self.cfg.lease_s)])

    def start_worker(self, n: int) -> None:
        """Start worker ``n``: even ones ``hybridq worker``, odd ones a plain ``rq worker``."""
        if n % 2 == 0:
            argv = [sys.executable, "-m", "hybridq", "worker", "--redis", self.url, QUEUE]
        else:
            # RQ's own CLI and worker class, its exit made prompt (hybridq.testing.rq_cli): about
            # one in 5 waited a minute after a SIGTERM, and the close waited its 10 s and killed it.
            argv = [*RQ, "worker", "--url", self.url]
            argv += ["--serializer", "rq.serializers.JSONSerializer", "--job-class", "hybridq.worker.Job"]
            argv += ["--logging_level", "WARNING", QUEUE]
        self.workers[n] = self._spawn(argv)

    def start_producer(self, n: int, crash_point: str | None = None) -> None:
        """Start producer ``n``, armed to crash at ``crash_point`` if given."""
        self.generation += 1
        name = f"p{n}g{self.generation}"
        env = dict(self.env)
        if crash_point is not None:
            env["HYBRIDQ_CRASH_POINT"] = crash_point
        code = "import sys; from hybridq.testing.chaos import produce_main; produce_main(sys.argv[1:])"
        acks = os.path.join(self.acks_dir, f"{name}.txt")
        seed = f"{self.cfg.seed}/{name}"
        argv = [sys.executable, "-c", code, self.journal, acks, self.effects, name, str(self.cfg.rate), seed]
        self.producers[n] = self._spawn(argv, env)

    def start(self) -> None:
        """Start Redis, the proxy and every process of the run."""
        self.server.start()
        self.say(f"redis-server {self.server.executable} on {self.server.url} (private to this run)")
        if any(name.startswith("net-") for name in self.cfg.faults):
            assert self.server.port is not None
            self.proxy = FaultProxy("127.0.0.1", self.server.port)
            self.proxy.start()
            self.say(f"the forwarder and the workers reach it through a fault proxy at {self.proxy.url}")
        for n in range(self.cfg.producers):
            self.start_producer(n)
        self.start_forwarder()
        for n in range(self.cfg.workers):
            self.start_worker(n)

    def keep_alive(self, *, producers: bool = True) -> None:
        """Restart what exited, like a supervisor would (after a short, seeded pause)."""
        now = time.monotonic()
        groups: list[tuple[str, list[subprocess.Popen[str] | None], Callable[[int], None]]] = [
            ("worker", self.workers, self.start_worker),
            ("forwarder", [self.forwarder], lambda _n: self.start_forwarder()),
        ]
        if producers:
            groups.append(("producer", self.producers, self.start_producer))
        for kind, procs, start in groups:
            for n, proc in enumerate(procs):
                if proc is not None and proc.poll() is None:
                    continue
                due = self.restart_at.setdefault((kind, n), now + 0.5)
                if now >= due:
                    del self.restart_at[(kind, n)]
                    start(n)
        if not self.server.running:
            self.server.start()

    def stop_producers(self) -> None:
        """Stop the producers (the drain begins)."""
        for proc in self.producers:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # a producer has no clean stop: it is only killed
                proc.wait()
        self.producers = [None] * len(self.producers)

    @property
    def url(self) -> str:
        """The Redis URL the forwarder and the workers use (the proxy's, if there is one)."""
        return self.proxy.url if self.proxy is not None else self.server.url

    def close(self) -> None:
        """Stop every process and Redis."""
        for proc in self.all:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.all:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(Exception):
            self.server.resume()
        self.server.stop()
        if self.proxy is not None:
            self.proxy.stop()
        self.log.close()

    # faults

    def inject(self, name: str, rng: random.Random) -> Fault:
        """Inject fault ``name`` (blocking for its duration); what it did."""
        at = time.time()
        pids: tuple[int, ...] = ()
        if name == "producer-kill":
            pids = self._kill_one(self.producers, rng, children=False)
        elif name == "producer-crash":
            n = rng.randrange(len(self.producers))
            proc = self.producers[n]
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            self.start_producer(n, f"{rng.choice(CRASH_POINTS)}:{rng.randint(1, 40)}")
        elif name == "forwarder-kill":
            pids = self._kill_one([self.forwarder], rng, children=False)
        elif name == "worker-kill":
            pids = self._kill_one(self.workers, rng, children=True)
        elif name == "horse-kill":
            pids = self._kill_horse(rng)
        elif name == "redis-restart":
            self.server.restart()
        elif name == "flushall":
            self.server.flushall()
        elif name == "evict":
            self._evict(rng.uniform(1.0, 4.0))
        elif name == "redis-outage":
            self.server.stop()
            time.sleep(rng.uniform(1.0, 5.0))
            self.server.start()
        elif name == "redis-sigstop":
            self.server.pause()
            time.sleep(rng.uniform(1.0, 5.0))
            self.server.resume()
        elif name == "client-pause":
            seconds = rng.uniform(1.0, 4.0)
            self.server.client_pause(seconds)
            time.sleep(seconds)
        elif name.startswith("net-"):
            self._net(name, rng)
        else:
            raise ValueError(f"unknown fault {name!r}")
        return Fault(name, at, time.time(), pids)

    def _kill_one(
        self, procs: Sequence[subprocess.Popen[str] | None], rng: random.Random, *, children: bool
    ) -> tuple[int, ...]:
        alive = [p for p in procs if p is not None and p.poll() is None]
        if not alive:
            return ()
        proc = rng.choice(alive)
        pids = [*children_of(proc.pid), proc.pid] if children else [proc.pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return tuple(pids)

    def _kill_horse(self, rng: random.Random) -> tuple[int, ...]:
        # Wait up to a second for a worker that is running a job right now.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            horses = [
                pid for w in self.workers if w is not None and w.poll() is None for pid in children_of(w.pid)
            ]
            if horses:
                pid = rng.choice(horses)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                return (pid,)
            time.sleep(0.01)
        return ()

    def _net(self, name: str, rng: random.Random) -> None:
        proxy = self.proxy
        assert proxy is not None  # started whenever a net-* fault is selected
        try:
            if name == "net-latency":
                proxy.latency(rng.uniform(0.02, 0.2))
                time.sleep(rng.uniform(1.0, 5.0))
            elif name == "net-reset":
                proxy.reset()
            elif name == "net-blackhole":
                proxy.blackhole()
                time.sleep(rng.uniform(1.0, 6.0))
            else:  # net-cut: any command's reply (pushes, claims, outcomes, RQ's transactions)
                proxy.cut_replies(rng.randint(1, 4), None, every=rng.randint(2, 20))
                deadline = time.monotonic() + 5.0
                while proxy.cuts_left and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            proxy.clear()

    def _evict(self, seconds: float) -> None:
        client = self.server.client()
        try:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory-policy", "allkeys-lru")
            client.config_set("maxmemory", str(max(used * 3 // 4, 1 << 20)))
            time.sleep(seconds)
        finally:
            with contextlib.suppress(Exception):
                client.config_set("maxmemory", "0")
                client.config_set("maxmemory-policy", "noeviction")
            client.close()
