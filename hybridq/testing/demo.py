"""``hybridq demo``: a private Redis, a forwarder, two workers, 1,000 jobs and some faults.

Everything runs on this machine from one temporary directory: a private ``redis-server`` (from
PATH or the ``embedded`` extra) with no persistence, ``hybridq forward`` and two
``hybridq worker`` processes. While the jobs are enqueued, Redis is stopped for a few seconds,
later SIGKILLed and restarted **empty** (every queued job, result and event gone), and the
forwarder is SIGKILLed and restarted. Each job appends its token to an effects file of its own,
so the tally's "ran" and "lost" do not trust hybridq's counts; "succeeded" and "duplicates
suppressed" come from ``hybridq status`` (the journal and the ledger).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from hybridq.ops.status import collect_status
from hybridq.producer.queue import Queue
from hybridq.testing.embedded import RedisServer

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
    #: Distinct jobs whose effect is in the effects file.
    ran: int
    lost: int
    #: Runs beyond the first (a job that finished, and Redis forgot it before the ledger knew).
    duplicate_runs: int
    #: From ``hybridq status``: terminal in the ledger.
    succeeded: int
    #: From ``hybridq status``: deliveries that found their outcome stored and did not run.
    duplicates_suppressed: int
    seconds: float
    directory: str


def _start(argv: list[str], log: IO[str]) -> subprocess.Popen[str]:
    # argv is this interpreter or the rq script beside it, with arguments we built: no shell.
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)  # noqa: S603


def _worker(url: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hybridq",
        "worker",
        "--simple",
        "--allow",
        "hybridq.testing.demo",
        "--redis",
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
    # No persistence: a restart loses everything, and hybridq re-delivers from its journal.
    server = RedisServer(directory=os.path.join(root, "redis"))
    procs: list[subprocess.Popen[str]] = []
    forward = [
        *(sys.executable, "-m", "hybridq", "forward", "--journal", journal, "--redis", server.url),
        *("--lease", "3"),
    ]
    try:
        say(f"demo directory: {root}")
        server.start()
        say(f"redis-server {server.executable} on {server.url} (private, started for this demo)")
        queue = Queue(QUEUE, journal)
        forwarder = _start(forward, log)
        workers = [_start(_worker(server.url), log) for _ in range(2)]
        procs += [forwarder, *workers]
        say(f"forwarder pid {forwarder.pid}, workers {', '.join(str(w.pid) for w in workers)}")
        outage_at, back_at = jobs * 2 // 10, jobs * 3 // 10
        wipe_at, kill_at = jobs * 5 // 10, jobs * 7 // 10
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
            elif i == wipe_at:
                server.kill()
                server.start()
                say(
                    f"[{i}] Redis SIGKILLed and restarted EMPTY: queued jobs, results and events are "
                    "gone; the forwarder notices and re-delivers everything not finished in its ledger"
                )
            elif i == kill_at:
                forwarder.send_signal(signal.SIGKILL)
                forwarder.wait()
                forwarder = _start(forward, log)
                procs.append(forwarder)
                say(f"[{i}] forwarder killed with SIGKILL and restarted (pid {forwarder.pid})")
            queue.enqueue("hybridq.testing.demo.record", effects, f"job-{i}")
            _keep_alive(workers, server.url, log, procs, say)
            if progress is not None:
                progress(1)
            time.sleep(0.002)
        say(f"{jobs} jobs accepted; waiting for the workers and the ledger")
        deadline = started + timeout_s
        status = collect_status(journal)
        while time.monotonic() < deadline:
            status = collect_status(journal)
            if status["pending"] == 0 and len(set(_effects(effects))) >= jobs:
                break
            _keep_alive(workers, server.url, log, procs, say)
            time.sleep(0.2)
        ran = set(_effects(effects))
        lines = _effects(effects)
        return DemoResult(
            accepted=jobs,
            ran=len(ran),
            lost=jobs - len(ran),
            duplicate_runs=len(lines) - len(set(lines)),
            succeeded=int(status["succeeded"]),
            duplicates_suppressed=int(status["duplicates_suppressed"]),
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
    """Restart workers that exited (``hybridq worker`` rides out Redis outages; this is a guard)."""
    for n, worker in enumerate(workers):
        if worker.poll() is not None:
            workers[n] = _start(_worker(url), log)
            procs.append(workers[n])
            say(f"worker {worker.pid} exited (code {worker.returncode}); restarted as {workers[n].pid}")
