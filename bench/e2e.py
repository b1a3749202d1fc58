"""End-to-end throughput: no-op jobs from enqueue to finished, by 1 and 2 worker processes.

Run by ``scripts/bench`` (or on its own: ``.venv/bin/python bench/e2e.py [--quick]``). A
private redis-server (no persistence) is started for the run. One measurement, for ``k`` worker
processes:

  * hybridq: a forwarder (``python -m hybridq forward``) and ``k`` x ``hybridq worker --simple``
    start and sit idle; then N jobs of ``e2e.noop`` go in through ``Queue.enqueue_many``
    (durable, batches of 500) and the clock runs until all N are in RQ's finished registry;
  * RQ (the peer): ``k`` x ``rq worker -w rq.worker.SimpleWorker -S rq.serializers.JSONSerializer``,
    and the N jobs go in through ``rq.Queue.enqueue_many`` (one pipeline per 500).

Both workers run as their commands ship (logging at INFO to a file, one line or more per job).
Start-up is not timed: the clock starts at the first enqueue, once every process has registered.
The registries are polled every 5 ms. The measurements run in an order rotated each repetition;
FLUSHALL before each. No target in docs/benchmarks.md is this figure (W1 is ``scripts/bench-worker``'s,
in-process); it shows how each side scales with worker processes on this machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import benchlib
import redis
import rq
from benchlib import Figure, Sample, per_rep
from hybridq import Queue
from hybridq.producer.queue import shared_writer
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from rq.serializers import JSONSerializer

NOOP = "e2e.noop"
QUEUE = "e2e"
BATCH = 500
POLL_S = 0.005
READY_TIMEOUT_S = 60
RUN_TIMEOUT_S = 300
BENCH = Path(__file__).resolve().parent


def noop() -> None:
    """The task: nothing, so that what is measured is the queue."""


@dataclass
class Config:
    base: str
    n: int
    url: str
    server: RedisServer


Procs = list[tuple[subprocess.Popen[bytes], Path]]


def spawn(argv: list[str], log: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return proc, log


def stop(procs: Procs) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _ in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fail(what: str, procs: Procs) -> None:
    tails = []
    for proc, log in procs:
        text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        tails.append(f"--- {' '.join(map(str, proc.args))} (exit {proc.poll()}):\n{text}")  # type: ignore[arg-type]
    stop(procs)
    sys.exit(f"bench-e2e: {what}\n" + "\n".join(tails))


def start(cfg: Config, side: str, workers: int, d: Path) -> Procs:
    """The forwarder (hybridq) and ``workers`` worker processes, each logging to a file in ``d``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), env.get("PYTHONPATH")]))
    env["HYBRIDQ_ALLOW"] = "e2e"  # hybridq's worker runs only allowed functions
    argvs: list[list[str]] = []
    if side == "hq":
        argvs.append(
            [sys.executable, "-m", "hybridq", "forward", "--journal", str(d / "journal"), "--redis", cfg.url]
        )
        argvs += [
            [sys.executable, "-m", "hybridq", "worker", "--simple", "--redis", cfg.url, QUEUE]
        ] * workers
    else:
        rq_cli = str(Path(sys.executable).parent / "rq")
        rq_worker = [rq_cli, "worker", "-w", "rq.worker.SimpleWorker", "-S", "rq.serializers.JSONSerializer"]
        argvs += [[*rq_worker, "-u", cfg.url, QUEUE]] * workers
    return [spawn(argv, d / f"{n}-{Path(argv[0]).name}.log", env) for n, argv in enumerate(argvs)]


def wait_ready(conn: redis.Redis, side: str, workers: int, procs: Procs) -> None:
    """Until every worker has registered (and, for hybridq, the forwarder has written its epoch)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc, _ in procs):
            fail("a process exited during start-up", procs)
        ready = conn.scard(f"rq:workers:{QUEUE}") >= workers
        if ready and (side == "rq" or next(conn.scan_iter(match=keys.epoch("*"), count=1000), None)):
            return
        time.sleep(0.05)
    fail(f"not ready within {READY_TIMEOUT_S} s", procs)


def enqueue(cfg: Config, side: str, conn: redis.Redis, d: Path) -> None:
    if side == "hq":
        q = Queue(QUEUE, str(d / "journal"))
        try:
            for first in range(0, cfg.n, BATCH):
                q.enqueue_many([q.prepare(NOOP) for _ in range(first, min(cfg.n, first + BATCH))])
        finally:
            shared_writer(q.journal, q.durability).close()
        return
    peer = rq.Queue(QUEUE, connection=conn, serializer=JSONSerializer)
    for first in range(0, cfg.n, BATCH):
        with conn.pipeline() as pipe:
            peer.enqueue_many(
                [rq.Queue.prepare_data(NOOP) for _ in range(first, min(cfg.n, first + BATCH))], pipeline=pipe
            )
            pipe.execute()


def measure(cfg: Config, side: str, workers: int, _rep: int) -> dict[str, Sample]:
    """One measurement: start, enqueue ``cfg.n`` jobs, time until all finished; stop."""
    cfg.server.flushall()
    d = Path(tempfile.mkdtemp(prefix=f"e2e-{side}{workers}-", dir=cfg.base))
    conn = redis.Redis.from_url(cfg.url)
    procs = start(cfg, side, workers, d)
    try:
        wait_ready(conn, side, workers, procs)
        t0 = time.perf_counter()
        enqueue(cfg, side, conn, d)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            with conn.pipeline(transaction=False) as pipe:
                pipe.zcard(f"rq:finished:{QUEUE}")
                pipe.zcard(f"rq:failed:{QUEUE}")
                finished, failed = pipe.execute()
            if finished + failed >= cfg.n:
                elapsed = time.perf_counter() - t0
                break
            if time.monotonic() > deadline or any(proc.poll() is not None for proc, _ in procs):
                fail(f"{finished} of {cfg.n} jobs finished ({failed} failed) in {RUN_TIMEOUT_S} s", procs)
            time.sleep(POLL_S)
        if failed or finished != cfg.n:
            fail(f"{failed} jobs failed, {finished} finished, expected {cfg.n} finished", procs)
    finally:
        stop(procs)
        conn.close()
        shutil.rmtree(d, ignore_errors=True)
        cfg.server.flushall()
    return {key(side, workers): Sample(cfg.n, elapsed)}


def key(side: str, workers: int) -> str:
    return f"{side}{workers}"


def label(side: str, workers: int) -> str:
    what = (
        "hybridq: enqueue_many -> forward -> hybridq worker --simple"
        if side == "hq"
        else ("rq: enqueue_many -> rq worker -w SimpleWorker (peer)")
    )
    return f"{what}, {workers} worker{'s' if workers > 1 else ''}"


def print_report(results: dict[str, list[Sample]], counts: list[int]) -> list[Figure]:
    rows: list[tuple[str, ...]] = [
        ("measurement", "jobs/s (median)", "spread (min..max)", "seconds (median)")
    ]
    for workers in counts:
        for side in ("hq", "rq"):
            samples = results[key(side, workers)]
            med, rng = benchlib.spread([s.rate for s in samples], ",.0f")
            rows.append(
                (label(side, workers), med, rng, f"{statistics.median(s.seconds for s in samples):.2f}")
            )
    benchlib.print_rows(rows, {1, 2, 3})
    ratios = [
        (f"hybridq / rq, {w} worker{'s' if w > 1 else ''}", per_rep(results, key("hq", w), key("rq", w)))
        for w in counts
    ]
    if len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        ratios += [
            (f"hybridq {hi} workers / {lo}", per_rep(results, key("hq", hi), key("hq", lo))),
            (f"rq {hi} workers / {lo}", per_rep(results, key("rq", hi), key("rq", lo))),
        ]
    return benchlib.print_context(ratios, 40)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = benchlib.arg_parser("bench/e2e.py", __doc__)
    p.add_argument(
        "--n", type=int, default=None, help="jobs per measurement (default 1,500; 200 with --quick)"
    )
    p.add_argument(
        "--workers",
        default="1,2",
        help="worker process counts, comma-separated (default 1,2)",
    )
    p.add_argument("--dir", default=None, help="parent of the temporary directories (default: a new tempdir)")
    benchlib.add_json_option(p)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with stderr
    repeat = benchlib.pick(args.repeat, args.quick, 2, 5)
    n = benchlib.pick(args.n, args.quick, 200, 1500)
    counts = sorted({int(x) for x in args.workers.split(",") if x.strip()})
    if repeat < 1 or n < 1 or not counts or min(counts) < 1:
        sys.exit("bench-e2e: --repeat, --n and --workers must be >= 1")
    base = benchlib.make_base("bench-e2e", args.dir)
    try:
        with RedisServer(directory=os.path.join(base, "redis")) as server:
            cfg = Config(base, n, server.url, server)
            header = benchlib.print_redis_machine(
                "hybridq end-to-end benchmark (jobs/s vs workers)", base, server
            )
            header["run"] = (
                f"mode={'quick' if args.quick else 'default'}, {repeat} repetitions; per repetition and "
                f"measurement {n:,} jobs of {NOOP}() enqueued and run by {','.join(map(str, counts))} worker "
                "processes (order rotated); timed from the first enqueue to the last job in RQ's finished "
                "registry (polled every 5 ms); start-up not timed"
            )
            benchlib.print_field("run", header["run"])
            print()
            labels = {key(s, w): label(s, w) for w in counts for s in ("hq", "rq")}
            units = [functools.partial(measure, cfg, s, w) for w in counts for s in ("hq", "rq")]
            results = benchlib.run_repetitions(
                repeat, units, labels, 70, lambda _k, s: f"{s.rate:>8,.0f} jobs/s"
            )
            figures = print_report(results, counts)
            if args.json:
                rows = benchlib.json_rows(results, labels, "jobs/s")
                for w in counts:
                    for s in ("hq", "rq"):
                        rows[key(s, w)] |= {"system": "hybridq" if s == "hq" else "rq", "workers": w}
                benchlib.write_json(args.json, "bench-e2e", header, rows, figures)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
