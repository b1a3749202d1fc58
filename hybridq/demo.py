"""``hybridq demo``: a private Redis, a forwarder, two RQ workers, 1,000 jobs and some faults.

Everything runs on this machine from a temporary directory: a private ``redis-server`` (from
PATH or the ``embedded`` extra), ``hybridq forward`` and two plain ``rq worker`` processes.
While the jobs are enqueued, Redis is stopped for a few seconds and the forwarder is killed with
SIGKILL and restarted. Each job appends its token to an effects file of its own, so the final
tally does not trust hybridq's counts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from hybridq.embedded import RedisServer
from hybridq.producer import Queue

__all__ = ["DemoResult", "record", "run_demo"]

QUEUE = "demo"
#: How long Redis stays stopped while jobs keep being enqueued.
OUTAGE_S = 3.0


def record(effects: str, token: str) -> str:
    """The demo's task: append ``token`` to ``effects`` (an effect the tally can count)."""
    with open(effects, "a", encoding="utf-8") as f:
        f.write(token + "\n")
    return token


@dataclass
class DemoResult:
    """The demo's tally."""

    accepted: int
    ran: int
    lost: int
    duplicate_runs: int
    seconds: float
    directory: str


def _start(argv: list[str], log: IO[str]) -> subprocess.Popen[str]:
    # argv is this interpreter or the rq script beside it, with arguments we built: no shell.
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)  # noqa: S603


def _rq_worker(url: str) -> list[str]:
    rq = shutil.which("rq", path=os.path.dirname(sys.executable)) or shutil.which("rq")
    head = [rq] if rq else [sys.executable, "-c", "from rq.cli import main; main()"]
    return [
        *head,
        "worker",
        "--serializer",
        "rq.serializers.JSONSerializer",
        "--worker-class",
        "rq.worker.SimpleWorker",
        "-u",
        url,
        QUEUE,
    ]


def run_demo(
    *,
    jobs: int = 1000,
    directory: str | None = None,
    say: Callable[[str], None] = print,
    progress: Callable[[int], None] | None = None,
    timeout_s: float = 180.0,
) -> DemoResult:
    """Run the demo and return its tally (see the module docstring)."""
    started = time.monotonic()
    root = directory or tempfile.mkdtemp(prefix="hybridq-demo-")
    os.makedirs(root, exist_ok=True)
    journal = os.path.join(root, "journal")
    effects = os.path.join(root, "effects.txt")
    log = open(os.path.join(root, "processes.log"), "a", encoding="utf-8")  # noqa: SIM115
    # Persistence on, so stopping Redis is an outage, not data loss: re-delivering jobs Redis
    # forgot needs hybridq's worker side, which this demo does not claim yet.
    server = RedisServer(directory=os.path.join(root, "redis"), extra_args=["--appendonly", "yes"])
    procs: list[subprocess.Popen[str]] = []
    forward = [sys.executable, "-m", "hybridq", "forward", "--journal", journal, "--redis", server.url]
    try:
        say(f"demo directory: {root}")
        server.start()
        say(f"redis-server {server.executable} on {server.url} (private, started for this demo)")
        queue = Queue(QUEUE, journal)
        forwarder = _start(forward, log)
        workers = [_start(_rq_worker(server.url), log) for _ in range(2)]
        procs += [forwarder, *workers]
        say(f"forwarder pid {forwarder.pid}, rq workers {', '.join(str(w.pid) for w in workers)}")
        outage_at, back_at, kill_at = jobs * 3 // 10, jobs * 5 // 10, jobs * 7 // 10
        down_since = time.monotonic()
        for i in range(jobs):
            if i == outage_at:
                down_since = time.monotonic()
                server.stop()
                say(f"[{i}] Redis stopped: enqueue keeps working (the journal is the source of truth)")
            elif i == back_at:
                time.sleep(max(0.0, down_since + OUTAGE_S - time.monotonic()))
                server.start()
                say(f"[{i}] Redis back: the forwarder catches up by itself")
            elif i == kill_at:
                forwarder.send_signal(signal.SIGKILL)
                forwarder.wait()
                forwarder = _start(forward, log)
                procs.append(forwarder)
                say(f"[{i}] forwarder killed with SIGKILL and restarted (pid {forwarder.pid})")
            queue.enqueue("hybridq.demo.record", effects, f"job-{i}")
            _keep_alive(workers, server.url, log, procs, say)
            if progress is not None:
                progress(1)
            time.sleep(0.002)
        say(f"{jobs} jobs accepted; waiting for the workers")
        deadline = started + timeout_s
        while len(set(_effects(effects))) < jobs and time.monotonic() < deadline:
            _keep_alive(workers, server.url, log, procs, say)
            time.sleep(0.2)
        ran = set(_effects(effects))
        lines = _effects(effects)
        return DemoResult(
            accepted=jobs,
            ran=len(ran),
            lost=jobs - len(ran),
            duplicate_runs=len(lines) - len(set(lines)),
            seconds=time.monotonic() - started,
            directory=root,
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.stop()
        log.close()


def _effects(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _keep_alive(
    workers: list[subprocess.Popen[str]],
    url: str,
    log: IO[str],
    procs: list[subprocess.Popen[str]],
    say: Callable[[str], None],
) -> None:
    """Restart RQ workers that exited: a plain ``rq worker`` gives up when Redis goes away."""
    for n, worker in enumerate(workers):
        if worker.poll() is not None:
            workers[n] = _start(_rq_worker(url), log)
            procs.append(workers[n])
            say(f"rq worker {worker.pid} exited (Redis was away); restarted as {workers[n].pid}")
