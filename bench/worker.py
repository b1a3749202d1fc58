"""Worker benchmark: hybridq's worker entry point next to plain RQ jobs, interleaved.

Run it through ``scripts/bench-worker`` (see ``docs/benchmarks.md``). A private redis-server (no
persistence) is started for the run.

  * W1: no-op jobs (``worker.noop``) are put into an RQ queue (not timed), then an
    in-process worker's ``work(burst=True)`` (JSONSerializer, logging at WARNING) runs them, timed
    from the call to the end of the last job (``work()`` then spends a fixed ~1 s joining its
    pubsub thread, which would only dilute the ratio). hybridq's jobs are pushed by
    ``RQTransport.push`` (the forwarder's own path: RQ jobs that run ``hybridq.worker.execute``
    with a delivery), RQ's by ``rq.Queue.enqueue_many`` of the same function. Four rows: hybridq's
    jobs under hybridq's worker class (``hybridq.rqworker.SimpleWorker``, what ``hybridq worker
    --simple`` runs) and under RQ's ``SimpleWorker`` (a plain ``rq worker``); RQ's jobs under
    RQ's ``SimpleWorker`` (the peer) and under hybridq's class. N jobs per row and repetition, in
    4 bursts the rows take turns at (order rotated each turn); FLUSHALL before each burst; every
    burst checks that all its jobs finished and none failed (and, for hybridq's jobs, that as
    many completion events were written). Each row's Redis round trips per job are counted once,
    in an untimed burst, by a connection class that counts what it sends.
  * W2: a forwarder (``python -m hybridq forward``) and one ``rq.SimpleWorker`` subprocess per
    side sit idle. One sample: pause, enqueue a job of ``worker.stamp`` (hybridq:
    ``Queue.enqueue``, durable; RQ: ``rq.Queue.enqueue``), then block in ``XREAD`` on the job's
    RQ result stream (what ``Job.latest_result(timeout=...)`` does) until the worker has recorded
    the result. The task returns CLOCK_MONOTONIC (shared by all processes), so the time until the
    task ran is measured too. The two sides alternate which goes first; nothing polls.

Reported: medians over repetitions, spreads (min..max), and the targets (a ratio or a difference
per repetition, then its median).
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import benchlib
import redis
import rq
from benchlib import Sample, latency_us, per_rep, verdict_line
from hybridq import Queue
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.producer.queue import shared_writer
from hybridq.protocol import keys
from hybridq.rqworker import SimpleWorker as HybridqSimpleWorker
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.worker import Job as HybridqJob
from redis.connection import Connection
from rq import SimpleWorker
from rq.results import Result
from rq.serializers import JSONSerializer

#: The tasks, by dotted path: ``bench/`` is on the workers' ``sys.path`` (they run this file).
NOOP = "worker.noop"
STAMP = "worker.stamp"
W1_QUEUE = "w1"
W2_HQ_QUEUE = "w2hq"
W2_RQ_QUEUE = "w2rq"
OWNER = "bench-worker"  # the owner named in W1's deliveries (their completion events go there)
PUSH_BATCH = 500
W2_WARMUP = 5
W2_TIMEOUT_MS = 30_000
CHILD_FLAG = "--child-worker"
# The worker runs only allowed functions (hybridq.security.allow): this script's tasks. The environment,
# so the W2 worker subprocesses inherit it.
os.environ.setdefault("HYBRIDQ_ALLOW", "worker")


def noop() -> None:
    """The W1 task: nothing."""


def stamp() -> int:
    """The W2 task: when it ran, on CLOCK_MONOTONIC (one clock for every process on the machine)."""
    return time.monotonic_ns()


class TimedWorker(SimpleWorker):
    """RQ's SimpleWorker, noting when each job's handling (run, result, registries) is over."""

    last_done = 0.0

    def execute_job(self, job: rq.job.Job, queue: rq.Queue) -> None:
        super().execute_job(job, queue)
        self.last_done = time.perf_counter()


class TimedHybridqWorker(HybridqSimpleWorker):
    """hybridq's SimpleWorker (``hybridq worker --simple``), timed like :class:`TimedWorker`."""

    last_done = 0.0

    def execute_job(self, job: rq.job.Job, queue: rq.Queue) -> None:
        super().execute_job(job, queue)
        self.last_done = time.perf_counter()


class CountingConnection(Connection):
    """A Redis connection that counts what it sends: one send is one round trip."""

    sends = 0

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


@dataclass
class Config:
    base: str
    repeat: int
    n: int  # W1 jobs per row and repetition
    turns: int  # W1 bursts per side and repetition (n / turns jobs each)
    samples: int  # W2 samples per side and repetition
    pause_s: float  # W2 idle time before each sample
    url: str
    server: RedisServer


# -- W1 -----------------------------------------------------------------------------------------


def fill_hybridq(url: str, n: int) -> None:
    """``n`` deliveries of the no-op task, pushed as the forwarder pushes them (not timed)."""
    transport = RQTransport(url)
    try:
        for start in range(0, n, PUSH_BATCH):
            now = time.time()
            batch = []
            for i in range(start, min(n, start + PUSH_BATCH)):
                job_id = new_job_id(now)
                env = Envelope(id=job_id, func=NOOP, queue=W1_QUEUE, idempotency_key=job_id, created_at=now)
                batch.append(Delivery(env, OWNER, ("bench", 0, i)))
            transport.push(batch)
    finally:
        transport.close()


def fill_rq(conn: redis.Redis, n: int) -> None:
    """``n`` jobs of the no-op task through ``rq.Queue.enqueue_many`` (not timed)."""
    q = rq.Queue(W1_QUEUE, connection=conn, serializer=JSONSerializer)
    for start in range(0, n, PUSH_BATCH):
        pipe = conn.pipeline()
        q.enqueue_many(
            [rq.Queue.prepare_data(NOOP) for _ in range(start, min(n, start + PUSH_BATCH))], pipeline=pipe
        )
        pipe.execute()


def check_w1(conn: redis.Redis, n: int, who: str) -> None:
    left = conn.llen(keys.rq_queue(W1_QUEUE))
    finished = conn.zcard(f"rq:finished:{W1_QUEUE}")
    failed = conn.zcard(f"rq:failed:{W1_QUEUE}")
    events = conn.xlen(keys.events(OWNER)) if who == "hybridq" else n
    if (left, finished, failed, events) != (0, n, 0, n):
        sys.exit(
            f"bench-worker: W1 {who}: {left} jobs left, {finished} finished, {failed} failed, "
            f"{events} completion events; expected 0, {n}, 0, {n}"
        )


#: W1 rows: (key, label, hybridq's jobs?, hybridq's worker class?).
W1_SETUPS = [
    ("w1hqw", "hybridq jobs, hybridq worker class (hybridq worker)", True, True),
    ("w1hq", "hybridq jobs, rq SimpleWorker (plain rq worker)", True, False),
    ("w1rq", "rq jobs, rq SimpleWorker (peer)", False, False),
    ("w1rqw", "rq jobs, hybridq worker class", False, True),
]
W1_JOBS = {key: hq for key, _, hq, _ in W1_SETUPS}
W1_CLASS = {key: hqw for key, _, _, hqw in W1_SETUPS}


def burst_once(
    cfg: Config, side: str, n: int, profile: bool = False, connection_class: type[Connection] = Connection
) -> Sample:
    """Fill the queue with ``n`` no-op jobs, then time one in-process worker burst over it."""
    cfg.server.flushall()
    conn = redis.Redis.from_url(cfg.url, connection_class=connection_class)
    try:
        if W1_JOBS[side]:
            fill_hybridq(cfg.url, n)
        else:
            fill_rq(conn, n)
        if conn.llen(keys.rq_queue(W1_QUEUE)) != n:
            sys.exit(f"bench-worker: W1 {side}: the queue does not hold {n} jobs")
        worker_class = TimedHybridqWorker if W1_CLASS[side] else TimedWorker
        # hybridq's job class on every row: what hybridq's workers use (it only checks the path).
        worker = worker_class([W1_QUEUE], connection=conn, serializer=JSONSerializer, job_class=HybridqJob)
        gc.collect()
        work = functools.partial(worker.work, burst=True, logging_level="WARNING", with_scheduler=False)
        if profile:
            benchlib.profile_call(f"{LABELS[side]}: {n:,} jobs", work, top=25)
            return Sample(n, 1.0)
        t0 = time.perf_counter()
        work()
        # Up to the end of the last job: work() then spends a fixed ~1 s joining its pubsub thread.
        elapsed = worker.last_done - t0
        check_w1(conn, n, "hybridq" if W1_JOBS[side] else "rq")
    finally:
        conn.close()
        cfg.server.flushall()
    return Sample(n, elapsed)


def round_trips(cfg: Config, side: str, n: int = 50) -> float:
    """Redis round trips per job of ``side``: an untimed burst of ``n + 1`` jobs less one of 1."""
    counts = []
    for jobs in (1, n + 1):
        CountingConnection.sends = 0
        burst_once(cfg, side, jobs, connection_class=CountingConnection)
        counts.append(CountingConnection.sends)
    return (counts[1] - counts[0]) / n


W1_ROWS = [(key, label) for key, label, _, _ in W1_SETUPS]


def run_w1(cfg: Config, rep: int) -> dict[str, Sample]:
    """``cfg.turns`` bursts of ``n / turns`` jobs per side, taking turns (order rotated each turn)."""
    out = {key: Sample(0, 0.0) for key, _ in W1_ROWS}
    if rep == 0:
        for key, _ in W1_ROWS:
            out[key].extra["round_trips"] = round_trips(cfg, key)
    per_turn = max(1, cfg.n // cfg.turns)
    for turn in range(cfg.turns):
        for key, _ in benchlib.rotated(W1_ROWS, turn + rep):
            part = burst_once(cfg, key, per_turn)
            out[key].count += part.count
            out[key].seconds += part.seconds
    return out


# -- W2 -----------------------------------------------------------------------------------------


def child_worker(queue: str, url: str) -> int:
    """A plain RQ SimpleWorker on ``queue`` until SIGTERM (the W2 worker of either side)."""
    logging.basicConfig(level=logging.WARNING)
    conn = redis.Redis.from_url(url)
    SimpleWorker([queue], connection=conn, serializer=JSONSerializer).work(
        logging_level="WARNING", with_scheduler=False
    )
    return 0


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stop(procs: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _ in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fail_w2(what: str, procs: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    tails = []
    for proc, log in procs:
        text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        tails.append(f"--- {' '.join(map(str, proc.args))} (exit {proc.poll()}):\n{text}")  # type: ignore[arg-type]
    sys.exit(f"bench-worker: W2: {what}\n" + "\n".join(tails))


def wait_ready(conn: redis.Redis, procs: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    """Until both workers are registered and the forwarder has written its epoch."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc, _ in procs):
            fail_w2("a child process exited during start-up", procs)
        workers = all(conn.scard(f"rq:workers:{q}") >= 1 for q in (W2_HQ_QUEUE, W2_RQ_QUEUE))
        if workers and next(conn.scan_iter(match=keys.epoch("*"), count=1000), None) is not None:
            return
        time.sleep(0.05)
    fail_w2("the forwarder and workers were not ready within 60 s", procs)


def await_result(
    conn: redis.Redis, job_id: str, procs: list[tuple[subprocess.Popen[bytes], Path]]
) -> tuple[int, int]:
    """Block until the job's RQ result is written; (time then, the task's own timestamp)."""
    got = conn.xread({Result.get_key(job_id): "0-0"}, block=W2_TIMEOUT_MS)
    done = time.monotonic_ns()
    if not got:
        fail_w2(f"no result for job {job_id} within {W2_TIMEOUT_MS / 1000:g} s", procs)
    result_id, payload = got[0][1][-1]
    result = Result.restore(job_id, result_id.decode(), payload, connection=conn, serializer=JSONSerializer)
    if result.type != Result.Type.SUCCESSFUL or not isinstance(result.return_value, int):
        fail_w2(f"job {job_id} did not succeed: {result.type} {result.exc_string}", procs)
    return done, result.return_value


def run_w2(cfg: Config, rep: int) -> dict[str, Sample]:
    """Latency samples: enqueue -> result recorded, hybridq (forwarder + worker) and rq (worker)."""
    cfg.server.flushall()
    d = Path(tempfile.mkdtemp(prefix="w2-", dir=cfg.base))
    journal = str(d / "journal")
    script = str(Path(__file__).resolve())
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    conn = redis.Redis.from_url(cfg.url, socket_timeout=None)  # XREAD BLOCK bounds each wait
    q: Queue | None = None
    lat: dict[str, list[int]] = {key: [] for key, _ in W2_ROWS}
    clock = time.monotonic_ns
    try:
        for name, argv in (
            (
                "forwarder",
                [sys.executable, "-m", "hybridq", "forward", "--journal", journal, "--redis", cfg.url],
            ),
            ("worker-hq", [sys.executable, script, CHILD_FLAG, W2_HQ_QUEUE, cfg.url]),
            ("worker-rq", [sys.executable, script, CHILD_FLAG, W2_RQ_QUEUE, cfg.url]),
        ):
            log = d / f"{name}.log"
            procs.append((spawn(argv, log), log))
        wait_ready(conn, procs)
        q = Queue(W2_HQ_QUEUE, journal)
        peer = rq.Queue(W2_RQ_QUEUE, connection=conn, serializer=JSONSerializer)
        for i in range(cfg.samples + W2_WARMUP):
            for side in ("hq", "rq") if (i + rep) % 2 == 0 else ("rq", "hq"):
                time.sleep(cfg.pause_s)
                t0 = clock()
                job_id = q.enqueue(STAMP).id if side == "hq" else peer.enqueue(STAMP).id
                t1 = clock()
                done, ran = await_result(conn, job_id, procs)
                if i >= W2_WARMUP:
                    lat[f"w2{side}"].append(done - t0)
                    lat[f"w2{side}_ran"].append(ran - t0)
                    lat[f"w2{side}_call"].append(t1 - t0)
    finally:
        stop(procs)
        if q is not None:
            shared_writer(q.journal, q.durability).close()
        conn.close()
        shutil.rmtree(d, ignore_errors=True)
        cfg.server.flushall()
    seconds = cfg.samples * cfg.pause_s
    return {key: Sample(len(values), seconds, values) for key, values in lat.items()}


W2_ROWS = [
    ("w2hq", "hybridq Queue.enqueue -> result recorded (forwarder + worker)"),
    ("w2hq_ran", "  of which: enqueue -> task ran"),
    ("w2hq_call", "  of which: the enqueue call (durable)"),
    ("w2rq", "rq Queue.enqueue -> result recorded (worker, peer)"),
    ("w2rq_ran", "  of which: enqueue -> task ran"),
    ("w2rq_call", "  of which: the enqueue call"),
]
LABELS = dict(W1_ROWS + W2_ROWS)


# -- report -------------------------------------------------------------------------------------


def print_tables(results: dict[str, list[Sample]]) -> None:
    rows: list[tuple[str, ...]] = [
        (
            "W1 measurement",
            "jobs/s (median)",
            "spread (min..max)",
            "us/job (median)",
            "seconds (median)",
            "round trips/job",
        )
    ]
    for key, label in W1_ROWS:
        samples = results[key]
        med, rng = benchlib.spread([s.rate for s in samples], ",.0f")
        us = statistics.median(s.seconds / s.count * 1e6 for s in samples)
        trips = samples[0].extra.get("round_trips", float("nan"))
        rows.append(
            (
                label,
                med,
                rng,
                f"{us:.0f}",
                f"{statistics.median(s.seconds for s in samples):.2f}",
                f"{trips:.1f}",
            )
        )
    benchlib.print_rows(rows, {1, 2, 3, 4, 5})
    rows = [("W2 latency (per repetition, then median)", "p50 ms", "p95 ms", "p99 ms", "max ms")]
    for key, label in W2_ROWS:
        samples = results[key]
        cells = [
            benchlib.med_range([latency_us(s, q) / 1000 for s in samples], ".2f") for q in (50, 95, 99, 100)
        ]
        rows.append((label, *cells))
    benchlib.print_rows(rows, {1, 2, 3, 4})


def diff_ms(results: dict[str, list[Sample]], a: str, b: str, q: float) -> list[float]:
    """Percentile ``q`` of ``a`` minus that of ``b``, in ms, per repetition."""
    return [(latency_us(x, q) - latency_us(y, q)) / 1000 for x, y in zip(results[a], results[b], strict=True)]


def print_ratios(results: dict[str, list[Sample]]) -> None:
    w1 = per_rep(results, "w1hqw", "w1rq")
    w2 = diff_ms(results, "w2hq", "w2rq", 50)
    print("targets (per repetition, median of the per-repetition values):")
    ok = [
        verdict_line(
            "W1 hybridq worker / rq SimpleWorker, jobs/s", w1, statistics.median(w1) >= 0.9, ">= 0.9x"
        ),
        verdict_line(
            "W2 p50 hybridq - p50 rq (enqueue -> result)", w2, statistics.median(w2) <= 5, "<= +5 ms", " ms"
        ),
    ]
    print()
    benchlib.print_context(
        [
            ("W1 hybridq jobs under a plain rq SimpleWorker / rq", per_rep(results, "w1hq", "w1rq")),
            ("W1 hybridq worker / plain rq SimpleWorker, hybridq jobs", per_rep(results, "w1hqw", "w1hq")),
            ("W1 rq jobs: hybridq worker class / rq SimpleWorker", per_rep(results, "w1rqw", "w1rq")),
        ],
        56,
    )

    def overhead(a: str, b: str) -> list[float]:
        return [
            (x.seconds / x.count - y.seconds / y.count) * 1e6
            for x, y in zip(results[a], results[b], strict=True)
        ]

    print("context (no target; same-run figures):")
    for name, values, fmt in (
        ("W1 hybridq worker - rq, per job", overhead("w1hqw", "w1rq"), " us"),
        ("W1 plain rq worker on hybridq jobs - rq, per job", overhead("w1hq", "w1rq"), " us"),
        ("W2 p99 hybridq - p99 rq (enqueue -> result)", diff_ms(results, "w2hq", "w2rq", 99), " ms"),
        (
            "W2 p50 hybridq - p50 rq (enqueue -> task ran)",
            diff_ms(results, "w2hq_ran", "w2rq_ran", 50),
            " ms",
        ),
    ):
        print(
            f"        {name:<48} {statistics.median(values):7.2f}{fmt}  (spread {min(values):.2f}..{max(values):.2f})"
        )
    print()
    benchlib.print_result(ok)


def shown(key: str, sample: Sample) -> str:
    """A sample on the progress line (stderr)."""
    if key.startswith("w2"):
        return f"p50 {latency_us(sample, 50) / 1000:8.2f} ms  p99 {latency_us(sample, 99) / 1000:8.2f} ms"
    return f"{sample.rate:>10,.0f} jobs/s"


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = benchlib.arg_parser("scripts/bench-worker", __doc__)
    p.add_argument(
        "--n",
        type=int,
        default=None,
        help="W1 jobs per row and repetition (default 2,000 in 4 bursts; 300 in 2 quick)",
    )
    p.add_argument(
        "--samples", type=int, default=None, help="W2 samples per side and repetition (default 200; 30 quick)"
    )
    p.add_argument(
        "--dir", default=None, help="parent of the temporary journal directories (default: a new tempdir)"
    )
    p.add_argument("--profile", action="store_true", help="also print a cProfile of one W1 burst of each row")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    if argv[:1] == [CHILD_FLAG]:
        return child_worker(argv[1], argv[2])
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with stderr
    repeat = benchlib.pick(args.repeat, args.quick, 2, 5)
    n = benchlib.pick(args.n, args.quick, 300, 2000)
    samples = benchlib.pick(args.samples, args.quick, 30, 200)
    if repeat < 1 or n < 1 or samples < 1:
        sys.exit("bench-worker: --repeat, --n and --samples must be >= 1")
    logging.getLogger("rq").setLevel(logging.WARNING)
    base = benchlib.make_base("bench-worker", args.dir)
    try:
        with RedisServer(directory=os.path.join(base, "redis")) as server:
            cfg = Config(base, repeat, n, 2 if args.quick else 4, samples, 0.01, server.url, server)
            benchlib.print_redis_machine("hybridq worker benchmark", base, server)
            benchlib.print_field(
                "run",
                f"mode={'quick' if args.quick else 'default'}, {repeat} repetitions; W1 runs {n:,} jobs of "
                f"{NOOP}() per row and repetition in {cfg.turns} in-process worker bursts taking "
                "turns (order rotated); "
                f"W2 takes {samples} samples per side and repetition of {STAMP}(), "
                f"{cfg.pause_s * 1000:g} ms pause before each, one SimpleWorker subprocess per side, "
                "blocking XREAD on the result stream (no polling)",
            )
            print()
            units: list[Callable[[int], dict[str, Sample]]] = [
                functools.partial(run_w1, cfg),
                functools.partial(run_w2, cfg),
            ]
            results = benchlib.run_repetitions(repeat, units, LABELS, 62, shown)
            print_tables(results)
            print_ratios(results)
            if args.profile:
                for key, _ in W1_ROWS:
                    print()
                    burst_once(cfg, key, n // cfg.turns, profile=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
