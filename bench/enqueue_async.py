"""asyncio enqueue benchmark: ``enqueue_async`` next to threads, ``asyncio.to_thread`` and a blocking call.

Run it through ``scripts/bench-async`` (see ``docs/api.md``, "asyncio"). Every mode enqueues the
same jobs (``--jobs`` per worker, ``--workers`` workers) into a fresh journal, durably (one fsync
acknowledges each job), while a heartbeat task on the event loop sleeps 1 ms at a time and records
how late it wakes: the loop's lag, i.e. the longest time something kept the loop from running.

  * ``threads``:        ``queue.enqueue`` from ``--workers`` threads (the loop runs only the heartbeat)
  * ``to_thread``:      ``await asyncio.to_thread(queue.enqueue, ...)`` from ``--workers`` coroutines
  * ``enqueue_async``:  ``await queue.enqueue_async(...)`` from ``--workers`` coroutines
  * ``blocking``:       ``queue.enqueue(...)`` called inside ``--workers`` coroutines (what not to do)

The modes take turns within each repetition, their order rotated by one each repetition, so load
from other tenants of the machine hits them alike. Reported: per mode, the median jobs/s, the
median and worst of the per-repetition max lag, the lag's p99, jobs per fsync; and the ratio
enqueue_async / threads per repetition (its median and range).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable

from hybridq import Queue
from hybridq.producer.queue import shared_writer

FUNC = "tests.tasks.add"
MODES = ("threads", "to_thread", "enqueue_async", "blocking")
BEAT_S = 0.001


async def heartbeat(lags: list[float], stop: asyncio.Event) -> None:
    """Sleep ``BEAT_S`` at a time; record how much later than asked each wake-up came."""
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(BEAT_S)
        lags.append(time.perf_counter() - started - BEAT_S)


async def run_mode(mode: str, queue: Queue, workers: int, jobs: int) -> tuple[float, list[float]]:
    """Enqueue ``workers * jobs`` jobs the way ``mode`` says; return the seconds and the loop's lags."""
    lags: list[float] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(heartbeat(lags, stop))
    await asyncio.sleep(0.01)  # the heartbeat is running
    lags.clear()

    async def coroutine(call: Callable[[int], Awaitable[object]]) -> None:
        for i in range(jobs):
            await call(i)

    async def blocking_call(i: int) -> None:
        queue.enqueue(FUNC, i, 1)
        await asyncio.sleep(0)  # a request handler returns to the loop between requests

    started = time.perf_counter()
    if mode == "threads":

        def thread() -> None:
            for i in range(jobs):
                queue.enqueue(FUNC, i, 1)

        threads = [threading.Thread(target=thread) for _ in range(workers)]
        for t in threads:
            t.start()
        await asyncio.get_running_loop().run_in_executor(None, lambda: [t.join() for t in threads])
    else:
        call: Callable[[int], Awaitable[object]] = {
            "to_thread": lambda i: asyncio.to_thread(queue.enqueue, FUNC, i, 1),
            "enqueue_async": lambda i: queue.enqueue_async(FUNC, i, 1),
            "blocking": blocking_call,
        }[mode]
        await asyncio.gather(*(coroutine(call) for _ in range(workers)))
    seconds = time.perf_counter() - started
    stop.set()
    await beat
    return seconds, lags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=20, help="threads or coroutines (default 20)")
    parser.add_argument("--jobs", type=int, default=100, help="jobs per worker (default 100)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--dir", help="where the journals go (default: a temporary directory)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="bench-async-", dir=args.dir)
    results: dict[str, dict[str, list[float]]] = {
        m: {"rate": [], "max_lag": [], "p99_lag": [], "per_fsync": []} for m in MODES
    }
    try:
        for rep in range(args.repeat):
            for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
                journal = os.path.join(base, f"{mode}-{rep}")
                queue = Queue("bench", journal)
                writer = shared_writer(queue.journal)
                queue.enqueue(FUNC, 0, 0)  # the segment exists: its creation is not measured
                fsyncs = writer.fsync_count
                seconds, lags = asyncio.run(run_mode(mode, queue, args.workers, args.jobs))
                n = args.workers * args.jobs
                lags.sort()
                r = results[mode]
                r["rate"].append(n / seconds)
                r["max_lag"].append(lags[-1] * 1000 if lags else float("nan"))
                r["p99_lag"].append(lags[int(len(lags) * 0.99)] * 1000 if lags else float("nan"))
                r["per_fsync"].append(n / max(1, writer.fsync_count - fsyncs))
                writer.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"# bench-async: {args.workers} workers x {args.jobs} jobs, {args.repeat} repetitions, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus"
    )
    print(f"{'mode':<15}{'jobs/s':>10}{'max lag ms (median, worst)':>30}{'p99 lag ms':>12}{'jobs/fsync':>12}")
    for mode in MODES:
        r = results[mode]
        print(
            f"{mode:<15}{statistics.median(r['rate']):>10.0f}"
            f"{statistics.median(r['max_lag']):>18.1f}, {max(r['max_lag']):>9.1f}"
            f"{statistics.median(r['p99_lag']):>12.2f}{statistics.median(r['per_fsync']):>12.1f}"
        )
    ratios = [
        a / t for a, t in zip(results["enqueue_async"]["rate"], results["threads"]["rate"], strict=True)
    ]
    print(
        f"enqueue_async / threads jobs/s: median {statistics.median(ratios):.2f}x "
        f"(range {min(ratios):.2f}..{max(ratios):.2f})"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {"workers": args.workers, "jobs": args.jobs, "results": results, "ratios": ratios},
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
