"""Jobs enqueued with an explicit idempotency key, pending in a large backlog (issue 29).

Each such job's key has an owner the forwarder must find when a later job has the key
(docs/enqueue.md, "Enqueue-if-absent"). ``--jobs`` keyed jobs (~200 B of arguments) are written
to a journal, then:

  * ``rss``: a ``hybridq forward`` process (a Redis at ``maxmemory 64mb noeviction``, no worker)
    reads them all (its window in Redis, the rest in its run table); its peak RSS (``/proc``,
    every 20 ms, until all are indexed and 2 s more) and the seconds it took to index them;
  * ``admit``: in one process, ``Admission.admit`` and ``flush`` of ``--jobs`` keyed jobs, 1,000
    per flush as a step does (seconds per job: the admission's own cost, no Redis);
  * ``start``: ``ForwarderState.load`` on the journal the ``rss`` run left (stopped cleanly:
    the saved index path), then with the saved index deleted (the full replay path),
    alternately, ``--runs`` times each.

Runs against whatever ``hybridq`` is importable (PYTHONPATH): run it on two trees to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import redis
from bench.backlog import _rss_mb, _server, indexed
from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.state import ForwarderConfig, ForwarderState

PAD = "x" * 200


def write(journal: str, n: int) -> None:
    queue = Queue("default", journal)
    for start in range(0, n, 5000):
        queue.enqueue_many(
            queue.prepare("tests.tasks.add", [PAD, i], idempotency_key=f"order:{i}")
            for i in range(start, min(n, start + 5000))
        )


def rss(run: str, n: int) -> tuple[float, float]:
    """(peak RSS in MB, seconds to index every job) of a forwarder reading ``n`` keyed jobs."""
    journal = os.path.join(run, "journal")
    server = _server(run, "redis", "64mb")
    client = redis.Redis.from_url(server.url)
    env = {**os.environ, "HYBRIDQ_ALLOW": "tests.tasks"}
    log = open(os.path.join(run, "forwarder.log"), "wb")  # noqa: SIM115
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridq", "forward", "--journal", journal, "--redis", server.url],
        env=env,
        stderr=log,
        stdout=subprocess.DEVNULL,
    )
    peak, indexed_s = 0.0, 0.0
    table = os.path.join(journal, "runs", "runs.sqlite")
    try:
        while proc.poll() is None and time.monotonic() - started < 600:
            peak = max(peak, _rss_mb(proc.pid))
            time.sleep(0.02)
            if indexed_s:
                if time.monotonic() - started > indexed_s + 2.0:
                    break
                continue
            if indexed(table, client) >= n:
                indexed_s = time.monotonic() - started
    finally:
        proc.terminate()  # a clean stop: the index saved for the start runs
        proc.wait(120)
        log.close()
        client.close()
        server.stop()
    return peak, indexed_s


def admit(tmp: str, n: int) -> float:
    """Seconds per keyed job of the forwarder's admission (1,000 per flush)."""
    journal = os.path.join(tmp, "admit")
    os.makedirs(journal)
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    admission = Admission(state)
    envs = [
        Envelope(id=f"job-{i}", func="m.f", queue="q", idempotency_key=f"key-{i}", created_at=0.0)
        for i in range(n)
    ]
    started = time.perf_counter()
    for lo in range(0, n, 1000):
        for i in range(lo, min(n, lo + 1000)):
            admission.admit(envs[i], ("w" * 16, 1, 32 + 300 * i))
        admission.flush()
    took = time.perf_counter() - started
    state.close()
    shutil.rmtree(journal)
    return took / n


def start(journal: str, *, saved: bool) -> float:
    if not saved:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(journal, "ledger-index.state"))
    state = ForwarderState(journal, ForwarderConfig())
    began = time.perf_counter()
    state.load()
    took = time.perf_counter() - began
    state.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="hq-keyed-", dir=args.dir)
    try:
        write(os.path.join(tmp, "journal"), args.jobs)
        peak, indexed = rss(tmp, args.jobs)
        print(f"rss: {args.jobs} keyed jobs indexed in {indexed:.1f} s, forwarder peak RSS {peak:.1f} MB")
        per_job = [admit(tmp, min(args.jobs, 50_000)) for _ in range(args.runs)]
        print(f"admit: {statistics.median(per_job) * 1e6:.1f} us per keyed job (median of {args.runs})")
        journal = os.path.join(tmp, "journal")
        table = os.path.join(journal, "ledger-keys.sqlite")
        if os.path.exists(table):
            size = sum(os.path.getsize(table + s) for s in ("", "-wal") if os.path.exists(table + s))
            print(f"key table: {size / 2**20:.1f} MB on disk ({size / args.jobs:.0f} bytes a key)")
        saved, full = [], []
        for _ in range(args.runs):
            saved.append(start(journal, saved=True))
            full.append(start(journal, saved=False))
        print(
            f"start: saved index {statistics.median(saved):.2f} s, full replay {statistics.median(full):.2f} s"
            f" (medians of {args.runs}; {[round(s, 2) for s in saved]} / {[round(s, 2) for s in full]})"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
