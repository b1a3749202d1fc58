"""Sharding benchmark (issue 19): burn-down over one Redis against two, same run.

Run it through ``scripts/bench-shards`` (see ``docs/benchmarks.md``, "Queues over several Redis").
Two private redis-servers (no persistence) are started for the run. One measurement:

  * both servers FLUSHALLed; a fresh journal and one forwarder (``hybridq forward``), with
    ``--redis-for b=SECOND`` in the "two" mode (queue ``a`` stays on the first Redis, ``b`` goes
    to the second), without it in the "one" mode (both queues on the first);
  * N no-op jobs (``burn.tasks.noop``) enqueued durably, half on ``a``, half on ``b``, untimed;
    the clock waits until every one is in its RQ queue;
  * the clock starts, then two worker commands, one per queue (``hybridq worker --processes P``,
    each pointed at its queue's Redis with the same ``--redis-for``), with the forwarder still
    running (it harvests the completions, as in production);
  * done when each job has appended its byte to a file (bench-burn's signal); jobs/s is N over the
    time from the workers' start to the last mark; then every process group is killed.

Repetitions alternate the two modes (rotated each time); medians and spreads are reported, and
the ratio two/one per repetition. The exit status is 0: a report, not a test.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import redis
from benchlib import Sample
from burndown import BENCH, Failed, Procs, kill_groups, spawn, tail
from hybridq.testing.embedded import RedisServer

BIN = Path(sys.executable).parent
QUEUES = ("a", "b")
BATCH = 500
POLL_S = 0.01
READY_TIMEOUT_S = 120
MODES = ("one", "two")


def cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def env_for(done_file: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), env.get("PYTHONPATH")]))
    env["BURN_DONE_FILE"] = str(done_file)
    env["HYBRIDQ_ALLOW"] = "burn.tasks"
    return env


def measure(
    servers: tuple[RedisServer, RedisServer], mode: str, n: int, processes: int, base: str, max_s: float
) -> Sample:
    """One burn-down of ``n`` no-op jobs over queues a and b, on one Redis or two."""
    from hybridq import Queue  # noqa: PLC0415
    from hybridq.producer.queue import shared_writer  # noqa: PLC0415
    from hybridq.protocol import keys  # noqa: PLC0415

    first, second = servers
    for s in servers:
        s.flushall()
    route = ["--redis-for", f"b={second.url}"] if mode == "two" else []
    home = {"a": first, "b": second if mode == "two" else first}
    d = Path(tempfile.mkdtemp(prefix=f"shards-{mode}-", dir=base))
    done_file = d / "done"
    done_file.touch()
    env = env_for(done_file)
    journal = str(d / "journal")
    procs: Procs = []
    try:
        procs += spawn(
            [[str(BIN / "hybridq"), "forward", "--journal", journal, "--redis", first.url, *route]],
            d,
            "forwarder",
            env,
        )
        half = n // 2
        qs = [Queue(queue, journal) for queue in QUEUES]
        try:
            for start in range(0, half, BATCH):
                for q in qs:  # interleaved, as producers of both queues would
                    q.enqueue_many(
                        [q.prepare("burn.tasks.noop") for _ in range(start, min(half, start + BATCH))]
                    )
        finally:
            shared_writer(qs[0].journal, qs[0].durability).close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        for queue in QUEUES:
            with redis.Redis.from_url(home[queue].url) as conn:
                while conn.llen(keys.rq_queue(queue)) < n // 2:
                    if time.monotonic() > deadline or procs[0][0].poll() is not None:
                        raise Failed(f"the forwarder did not push the jobs in time {tail(procs)}")
                    time.sleep(POLL_S)
        busy0 = [cpu_s(s.pid) for s in servers]
        t0 = time.perf_counter()
        argvs = [
            [
                str(BIN / "hybridq"),
                "worker",
                "--processes",
                str(processes),
                "--redis",
                first.url,
                *route,
                queue,
            ]
            for queue in QUEUES
        ]
        workers = spawn(argvs, d, "worker", env)
        procs += workers
        total = 2 * (n // 2)
        while True:
            done = done_file.stat().st_size
            now = time.perf_counter()
            if done >= total:
                busy = [cpu_s(s.pid) - b for s, b in zip(servers, busy0, strict=True)]
                return Sample(
                    total,
                    now - t0,
                    extra={"redis1_cpu": busy[0] / (now - t0), "redis2_cpu": busy[1] / (now - t0)},
                )
            if now - t0 > max_s:
                return Sample(done, now - t0, extra={"capped": 1.0})
            if any(p.poll() is not None for p, _ in workers):
                raise Failed(f"{done} of {total} done when a worker exited; {tail(workers)}")
            time.sleep(POLL_S)
    finally:
        kill_groups(procs)
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    p = benchlib.arg_parser("bench-shards", __doc__ or "")
    p.add_argument(
        "-n", type=int, default=None, help="no-op jobs per measurement (default 20000; 2000 with --quick)"
    )
    p.add_argument("--processes", type=int, default=1, help="worker processes per queue (default 1)")
    p.add_argument("--max-seconds", type=float, default=300.0, help="stop a measurement after this long")
    p.add_argument("--dir", default=None, help="parent directory for the run's files")
    args = p.parse_args()
    n = benchlib.pick(args.n, args.quick, 2000, 20000)
    repeat = benchlib.pick(args.repeat, args.quick, 1, 3)
    base = benchlib.make_base("bench-shards", args.dir)
    servers = (RedisServer(directory=Path(base) / "redis-1"), RedisServer(directory=Path(base) / "redis-2"))
    try:
        for s in servers:
            s.start()
        benchlib.print_machine(
            "hybridq sharding benchmark (issue 19): burn-down over one Redis vs two",
            base,
            f"hybridq {benchlib.version('hybridq')}, rq {benchlib.version('rq')}",
            extra=[
                (
                    "run",
                    f"N={n} no-op jobs (half on queue a, half on b), {args.processes} worker process(es) per queue, {repeat} repetition(s)",
                )
            ],
        )
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(repeat):
            for mode in benchlib.rotated(MODES, rep):
                try:
                    sample = measure(servers, mode, n, args.processes, base, args.max_seconds)
                except Failed as exc:
                    print(f"  rep {rep + 1} {mode}: failed: {exc}")
                    continue
                capped = "*" if sample.extra.get("capped") else ""
                rates[mode].append(sample.rate)
                load = (
                    f"redis-server CPU: first {sample.extra.get('redis1_cpu', 0):.0%}, "
                    f"second {sample.extra.get('redis2_cpu', 0):.0%} of a core; loadavg {os.getloadavg()[0]:.1f}"
                )
                print(
                    f"  rep {rep + 1} {mode:>3} Redis: {sample.count} jobs in {sample.seconds:.2f} s "
                    f"= {sample.rate:,.0f} jobs/s{capped} ({load})"
                )
        print()
        print(f"{'Redis instances':<18}{'jobs/s (median)':>18}{'min..max':>22}")
        for mode in MODES:
            if rates[mode]:
                vals = rates[mode]
                print(
                    f"{mode:<18}{statistics.median(vals):>18,.0f}{f'{min(vals):,.0f}..{max(vals):,.0f}':>22}"
                )
        pairs = [t / o for o, t in zip(rates["one"], rates["two"], strict=False)]
        if pairs:
            print(
                f"two / one: {statistics.median(pairs):.2f}x (per repetition: {', '.join(f'{r:.2f}' for r in pairs)})"
            )
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
