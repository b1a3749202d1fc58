"""WF1: a workflow's overhead per step against plain jobs, side by side in one run.

Run on its own: ``.venv/bin/python bench/workflow.py [--quick] [--reps N]``. A private
redis-server (no persistence), one forwarder (``python -m hybridq forward``) and one
``hybridq worker --processes 2`` on it, started once; then, in an order rotated each repetition:

* **plain, sequential**: N jobs of ``workflow.step``, each enqueued once the previous one's
  ``job.wait()`` returned, with its result as argument (what code without chains does);
* **chain**: one ``hybridq.chain`` of the same N steps, enqueued, then ``job.wait()``;
* **plain, parallel**: M jobs in one ``enqueue_many``, ``wait()`` on each, then a job summing
  their results, enqueued and waited for (what code without chords does);
* **chord**: a ``hybridq.chord`` of the same M members and a callback summing them, ``wait()``.

Completion is polled every 2 ms on both sides (``job.wait()`` backs off to 100 ms, which would
be measured instead). Figures: seconds per step (chain / plain sequential) and for the whole fan-out (chord / plain
parallel), the median over the repetitions and their spread. The target (docs/benchmarks.md,
WF1) is a ratio of at most 1.5x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import hybridq
from hybridq import Queue
from hybridq.testing.embedded import RedisServer

HERE = Path(__file__).resolve().parent


def step(a: int, b: int = 1) -> int:
    """One no-op step: ``a + b``."""
    return a + b


def total(values: list[int]) -> int:
    """A chord's callback."""
    return sum(values)


def done(job: hybridq.Job) -> object:
    """``job.wait()`` polling every 2 ms (``wait`` backs off to 100 ms: that would be measured)."""
    while job.status in ("queued", "scheduled", "forwarded", "started", "retrying"):
        time.sleep(0.002)
    return job.wait(timeout=1)


def plain_sequential(queue: Queue, n: int) -> float:
    value = 0
    for _ in range(n):
        value = done(queue.enqueue("workflow.step", value, 1))
    assert value == n
    return n


def chain(queue: Queue, n: int) -> float:
    flow = hybridq.chain(
        hybridq.sig("workflow.step", 0, 1), *[hybridq.sig("workflow.step", 1) for _ in range(n - 1)]
    )
    assert done(queue.enqueue(flow)) == n
    return n


def plain_parallel(queue: Queue, m: int) -> float:
    jobs = queue.enqueue_many([queue.prepare("workflow.step", (i, i)) for i in range(m)])
    results = [done(j) for j in jobs]
    assert done(queue.enqueue("workflow.total", results)) == m * (m - 1)
    return 1


def chord(queue: Queue, m: int) -> float:
    flow = hybridq.chord(
        [hybridq.sig("workflow.step", i, i) for i in range(m)], hybridq.sig("workflow.total")
    )
    assert done(queue.enqueue(flow)) == m * (m - 1)
    return 1


def timed(fn: Callable[[Queue, int], float], queue: Queue, size: int) -> float:
    started = time.perf_counter()
    units = fn(queue, size)
    return (time.perf_counter() - started) / units


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench/workflow.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 repetitions, short shapes")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 2)")
    args = parser.parse_args()
    reps = args.reps or (2 if args.quick else 5)
    n, m = (10, 50) if args.quick else (30, 200)
    base = tempfile.mkdtemp(prefix="hybridq-bench-wf-")
    journal = os.path.join(base, "journal")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env["HYBRIDQ_ALLOW"] = "workflow"
    with RedisServer(directory=os.path.join(base, "redis")) as server:
        log = open(os.path.join(base, "procs.log"), "ab")  # noqa: SIM115 - closed below
        procs = [
            subprocess.Popen([sys.executable, "-m", "hybridq", "forward", "--journal", journal, "--redis", server.url],
                             env=env, stderr=log, stdout=log),
            subprocess.Popen([sys.executable, "-m", "hybridq", "worker", "--redis", server.url, "--processes", "2",
                              "default"], env=env, stderr=log, stdout=log, cwd=base),
        ]  # fmt: skip
        try:
            queue = Queue(journal=journal)
            plain_sequential(queue, 3)  # warm: every process up and importing the task
            chain(queue, 3)
            runs: dict[str, list[float]] = {"plain_seq": [], "chain": [], "plain_par": [], "chord": []}
            order = [("plain_seq", plain_sequential, n), ("chain", chain, n), ("plain_par", plain_parallel, m),
                     ("chord", chord, m)]  # fmt: skip
            for rep in range(reps):
                for name, fn, size in order[rep % 4 :] + order[: rep % 4]:
                    runs[name].append(timed(fn, queue, size))
        finally:
            for p in procs:
                p.terminate()
                p.wait(30)
            log.close()
    per_step = [c / p for c, p in zip(runs["chain"], runs["plain_seq"], strict=True)]
    fan = [c / p for c, p in zip(runs["chord"], runs["plain_par"], strict=True)]
    print(f"repetitions {reps}; chain of {n}, chord of {m}; {base}")
    for name, values in runs.items():
        print(
            f"  {name:>10}: median {statistics.median(values) * 1000:8.1f} ms (per step for plain_seq/chain)"
        )
    for label, ratios in (
        ("WF1 chain step / plain sequential job", per_step),
        ("WF1 chord / plain parallel", fan),
    ):
        print(
            f"  {label}: {statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}x), target <= 1.5x"
        )


if __name__ == "__main__":
    main()
