"""Backlog benchmark (issue 29): a backlog far larger than Redis's memory, drained through the window.

Run it through ``scripts/bench-backlog`` (see ``docs/benchmarks.md``). One run:

  * **hybridq**, for each backlog size of ``--sizes`` (default 20,000 and 1,000,000 jobs with
    ~200 bytes of arguments): the jobs are enqueued into a fresh journal, then one
    ``hybridq worker`` (defaults) and one ``hybridq forward`` (defaults) start on a private
    redis-server with ``maxmemory --maxmemory`` (64mb) and ``noeviction``. Measured: the drain
    rate (jobs/s from the forwarder's start to the last job's effect), the time from the
    forwarder's start to the first job's effect, Redis's peak ``used_memory`` (``INFO``, every
    20 ms) and the forwarder's peak RSS (``/proc``, every 20 ms). The ratio of the largest
    backlog's drain rate to the smallest's is issue 29's BK1 (target >= 0.9).
  * **RQ, Dramatiq and Celery** (``--peers``) are offered the same backlog on the same capped
    Redis: each enqueues until done or until Redis refuses (``OOM``); reported: how many jobs it
    could queue, Redis's memory then, and the error. Their queue *is* Redis, so that is what each
    does with a backlog larger than its memory; no worker runs.

``--restart``: the hybridq rows measure a restart instead of a fresh start. The forwarder runs
alone first until it has read the whole journal (the window pushed, the rest in its run table),
is stopped (SIGTERM), Redis is emptied (``FLUSHALL``), and then the worker and the forwarder
start as above: "first s" is the time from this second start to the first job's effect (the
start-up's reads, the refill of the window Redis lost).

Tasks count their runs in an effects file (``tests/backlog_tasks.py``: one ``O_APPEND`` line per
run); each job must run exactly once, or the row says how many did not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import redis
from hybridq import Queue
from hybridq.testing.embedded import RedisServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "tests.backlog_tasks.mark"
PAD = 200  # bytes of arguments per job, as the benchmark says


@dataclass
class Row:
    system: str
    jobs: int
    queued: int = 0
    ran: int = 0
    duplicates: int = 0
    seconds: float = 0.0
    rate: float = 0.0
    first_job_s: float | None = None
    redis_peak_mb: float = 0.0
    forwarder_peak_rss_mb: float | None = None
    what_happened: str = ""
    extra: dict[str, object] = field(default_factory=dict)


def _server(tmp: str, name: str, maxmemory: str) -> RedisServer:
    server = RedisServer(
        directory=os.path.join(tmp, name),
        extra_args=["--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"],
    )
    server.start()
    return server


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _count(path: str) -> tuple[int, int]:
    """(distinct tokens, duplicate runs) in the effects file."""
    if not os.path.exists(path):
        return 0, 0
    with open(path, encoding="ascii") as f:
        tokens = f.read().split()
    return len(set(tokens)), len(tokens) - len(set(tokens))


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def indexed(table: str, client: redis.Redis) -> int:
    """Jobs a forwarder has indexed: waiting in its run table plus in Redis's default queue (0: unknown yet)."""
    with contextlib.suppress(sqlite3.Error, redis.RedisError):
        db = sqlite3.connect(f"file:{table}?mode=ro", uri=True)
        try:
            waiting = int(db.execute("SELECT count(*) FROM runs").fetchone()[0])
        finally:
            db.close()
        return waiting + int(client.llen("rq:queue:default"))
    return 0


def _index_first(journal: str, url: str, env: dict[str, str], run: str, n: int) -> None:
    """``--restart``: a forwarder alone reads the whole journal, is stopped, and Redis is emptied."""
    client = redis.Redis.from_url(url)
    with open(os.path.join(run, "forwarder-first.log"), "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridq", "forward", "--journal", journal, "--redis", url],
            env=env,
            stderr=log,
            stdout=subprocess.DEVNULL,
        )
        table = os.path.join(journal, "runs", "runs.sqlite")
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                if indexed(table, client) >= n:
                    break
        finally:
            proc.terminate()
            proc.wait(60)
    client.flushall()
    client.close()


def hybridq_row(n: int, maxmemory: str, tmp: str, timeout_s: float, *, restart: bool = False) -> Row:
    row = Row("hybridq restart" if restart else "hybridq", n)
    run = tempfile.mkdtemp(prefix=f"hq-{n}-", dir=tmp)
    journal, effects = os.path.join(run, "journal"), os.path.join(run, "effects")
    queue = Queue("default", journal)
    pad = "x" * PAD
    for start in range(0, n, 5000):
        queue.enqueue_many(
            queue.prepare(TASK, [effects, f"t{i}", pad]) for i in range(start, min(n, start + 5000))
        )
    row.queued = n
    server = _server(run, "redis", maxmemory)
    client = redis.Redis.from_url(server.url)
    env = {**os.environ, "PYTHONPATH": ROOT, "HYBRIDQ_ALLOW": "tests.backlog_tasks"}
    if restart:
        _index_first(journal, server.url, env, run, n)
    logs = [open(os.path.join(run, name), "wb") for name in ("worker.log", "forwarder.log")]  # noqa: SIM115
    worker = subprocess.Popen(
        [sys.executable, "-m", "hybridq", "worker", "--redis", server.url, "default"],
        env=env,
        stderr=logs[0],
        stdout=subprocess.DEVNULL,
        cwd=run,
    )
    time.sleep(1.0)  # the worker is listening before the forwarder starts
    started = time.monotonic()
    forwarder = subprocess.Popen(
        [sys.executable, "-m", "hybridq", "forward", "--journal", journal, "--redis", server.url],
        env=env,
        stderr=logs[1],
        stdout=subprocess.DEVNULL,
    )
    peak_used, peak_rss = 0, 0.0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_used, peak_rss
        while not stop.is_set():
            with contextlib.suppress(redis.RedisError):
                peak_used = max(peak_used, int(client.info("memory")["used_memory"]))
            peak_rss = max(peak_rss, _rss_mb(forwarder.pid))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        while time.monotonic() - started < timeout_s:
            if row.first_job_s is None and os.path.exists(effects) and os.path.getsize(effects):
                row.first_job_s = round(time.monotonic() - started, 3)
            if _lines(effects) >= n:
                break
            if forwarder.poll() is not None or worker.poll() is not None:
                row.what_happened = "a process exited"
                break
            time.sleep(0.01 if row.first_job_s is None else 0.5)
        row.seconds = round(time.monotonic() - started, 2)
    finally:
        stop.set()
        sampler.join()
        for proc in (forwarder, worker):
            proc.terminate()
        for proc in (forwarder, worker):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
        for log in logs:
            log.close()
        server.stop()
    row.ran, row.duplicates = _count(effects)
    row.rate = round(row.ran / row.seconds, 1) if row.seconds else 0.0
    row.redis_peak_mb = round(peak_used / 2**20, 2)
    row.forwarder_peak_rss_mb = round(peak_rss, 1)
    if not row.what_happened:
        row.what_happened = "drained" if row.ran == n and not row.duplicates else f"{n - row.ran} not run"
    shutil.rmtree(run, ignore_errors=True)
    return row


def _offer(system: str, n: int, maxmemory: str, tmp: str, enqueue_one: object) -> Row:
    """Offer ``n`` jobs to a peer whose queue is Redis: enqueue until done or refused."""
    row = Row(system, n)
    server = _server(tmp, f"redis-{system}", maxmemory)
    client = redis.Redis.from_url(server.url)
    started = time.monotonic()
    try:
        send = enqueue_one(server.url)  # type: ignore[operator]
        for i in range(n):
            send(i)
            row.queued = i + 1
        row.what_happened = "queued all"
    except Exception as exc:
        row.what_happened = f"refused after {row.queued} jobs: {type(exc).__name__}: {str(exc)[:120]}"
    row.seconds = round(time.monotonic() - started, 2)
    row.redis_peak_mb = round(int(client.info("memory")["used_memory"]) / 2**20, 2)
    row.extra["used_after_mb"] = row.redis_peak_mb
    server.stop()
    return row


def _rq(url: str) -> object:
    import rq  # noqa: PLC0415
    from rq.serializers import JSONSerializer  # noqa: PLC0415

    queue = rq.Queue("default", connection=redis.Redis.from_url(url), serializer=JSONSerializer)
    pad = "x" * PAD
    return lambda i: queue.enqueue(TASK, "/dev/null", f"t{i}", pad)


def _dramatiq(url: str) -> object:
    import dramatiq  # noqa: PLC0415
    from dramatiq.brokers.redis import RedisBroker  # noqa: PLC0415

    broker = RedisBroker(url=url)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="default", broker=broker)
    def mark(path: str, token: str, pad: str) -> None: ...

    pad = "x" * PAD
    return lambda i: mark.send("/dev/null", f"t{i}", pad)


def _celery(url: str) -> object:
    import celery  # noqa: PLC0415

    app = celery.Celery("bench", broker=url)
    app.conf.broker_connection_retry_on_startup = False
    app.conf.task_publish_retry = False
    pad = "x" * PAD
    return lambda i: app.send_task("bench.mark", args=["/dev/null", f"t{i}", pad], queue="default")


PEERS = {"rq": _rq, "dramatiq": _dramatiq, "celery": _celery}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="20000,1000000", help="backlog sizes (comma-separated)")
    parser.add_argument("--maxmemory", default="64mb")
    parser.add_argument("--peers", default="rq,dramatiq,celery", help="'' for none")
    parser.add_argument(
        "--peer-jobs", type=int, default=None, help="jobs offered to each peer (default: the largest size)"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per hybridq drain")
    parser.add_argument(
        "--small-repeat",
        type=int,
        default=3,
        help="drains of each size but the largest (default 3): the ratio takes their median rate; "
        "one 20,000-job drain lasts about 5 s, and its rate moved by 22%% between two idle runs",
    )
    parser.add_argument("--json", dest="json_path")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="measure a restart over an already read journal after a FLUSHALL",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    tmp = tempfile.mkdtemp(prefix="hq-backlog-")
    rows: list[Row] = []
    try:
        for n in sizes:
            for _ in range(1 if n == max(sizes) else max(1, args.small_repeat)):
                print(f"hybridq: {n} jobs under maxmemory {args.maxmemory} ...", flush=True)
                rows.append(hybridq_row(n, args.maxmemory, tmp, args.timeout, restart=args.restart))
                print(json.dumps(asdict(rows[-1])), flush=True)
        for name in [p for p in args.peers.split(",") if p]:
            n = args.peer_jobs or max(sizes)
            print(f"{name}: offered {n} jobs under maxmemory {args.maxmemory} ...", flush=True)
            rows.append(_offer(name, n, args.maxmemory, tmp, PEERS[name]))
            print(json.dumps(asdict(rows[-1])), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    hq = [r for r in rows if r.system.startswith("hybridq")]
    print(
        f"\nbacklog benchmark, maxmemory {args.maxmemory} noeviction, {platform.python_version()}, {os.cpu_count()} cores"
    )
    print(
        f"{'system':<16} {'jobs':>9} {'queued':>9} {'ran':>9} {'dups':>5} {'jobs/s':>8} {'first s':>8} {'Redis MB':>9} {'RSS MB':>7}  what happened"
    )
    for r in rows:
        first = "" if r.first_job_s is None else f"{r.first_job_s:.2f}"
        rss = "" if r.forwarder_peak_rss_mb is None else f"{r.forwarder_peak_rss_mb:.0f}"
        rate = f"{r.rate:.0f}" if r.system.startswith("hybridq") else ""
        print(
            f"{r.system:<16} {r.jobs:>9} {r.queued:>9} {r.ran:>9} {r.duplicates:>5} {rate:>8} {first:>8} {r.redis_peak_mb:>9.1f} {rss:>7}  {r.what_happened}"
        )
    small = [r.rate for r in hq if r.jobs == hq[0].jobs and r.rate]
    if len(hq) >= 2 and hq[-1].jobs != hq[0].jobs and small:
        base = statistics.median(small)
        print(
            f"\ndrain rate, {hq[-1].jobs} vs {hq[0].jobs} jobs (the median of {len(small)}): "
            f"{hq[-1].rate / base:.2f}x (target >= 0.9)"
        )
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
