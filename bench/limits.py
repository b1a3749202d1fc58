"""Per-key limits (issue 30): what the forwarder's gate costs, side by side with no limits, in one run.

Two measurements, each with and without ``--limit`` (a policy that matches every job's key but
never binds: ``concurrency:1000000``), interleaved repetitions, medians:

* **admission**: a forwarder in this process (the RQ transport, a private Redis, no worker)
  forwards N jobs of 10,000 distinct limit keys from its journal into Redis, its window wide
  enough for all of them; timed from its first step to the last job in Redis. The difference per
  job is what the gate adds (a room check per job, one Redis read per chunk of jobs for the keys
  it never read, and the queued counts added at each step). The limits' epoch is set an hour back first:
  a new Redis's one-lease quarantine would dominate a short run.
* **burn-down**: N no-op jobs journaled (untimed), then a forwarder and one ``hybridq worker``
  (defaults) started together; timed from their start to the last job's mark (forwarding, the
  gate and the running, end to end: a forwarder started over a queued backlog pushes it at its
  own pace, so timing from the worker's start would compare different head starts). Run with
  10 keys and with 10,000 distinct keys; and with 10,000 distinct keys under a per-tenant
  policy, ``k:*=concurrency:10`` (two jobs a key: it never binds either), the shape a user
  meets (a policy that binds for some tenant is not special-cased for the others).

One untimed burn (``--warmup``: 10 keys, no limits) comes first: on a fresh machine every burn
of the first round ran 12 to 44 % slower than the same burn later, whatever it measured: it fell
on the interleaved pairs of the first repetition only and widened their spread.

Each measurement also notes the CPU seconds the forwarder, the worker (its whole process group)
and Redis used (``/proc`` and ``INFO cpu``), printed per job: on a machine shared with other
work the wall-clock ratios swing widely, the CPU each part used much less. A forwarder or
worker waiting for work polls, so theirs grows with a run's length too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import burndown
import redis
from burndown import Config, kill_groups, spawn
from hybridq.testing.embedded import RedisServer
from proccpu import group_cpu, redis_cpu

LIMIT = "k:*=concurrency:1000000"
#: The per-tenant policy of ``burn 10000 keys concurrency 10`` (not binding: two jobs a key).
TENANT_LIMIT = "k:*=concurrency:10"
PARTS = ("forwarder", "worker", "redis")
#: The measurements (``--only`` picks some).
WHATS = ("admission 10000 keys", "burn 10 keys", "burn 10000 keys", "burn 10000 keys concurrency 10")
#: CPU seconds per measurement and part ("forwarder", "worker", "redis"): on a machine shared
#: with other work the wall-clock ratios swing, the CPU each part used much less.
CPU: dict[str, list[dict[str, float]]] = {}


def settled(url: str) -> None:
    """The limits' epoch an hour back on this server: no quarantine in a short run."""
    with redis.Redis.from_url(url) as conn:
        run_id = conn.info("server")["run_id"]
        conn.set("hybridq:limits:epoch", f"{int(time.time() * 1000) - 3_600_000}:{run_id}")


def enqueue(queue: str, journal: str, n: int, keys: int) -> None:
    """``n`` no-op jobs of ``keys`` distinct limit keys (``k:0``, ``k:1``...) into ``journal``."""
    from hybridq import Queue  # noqa: PLC0415
    from hybridq.producer.queue import shared_writer  # noqa: PLC0415

    q = Queue(queue, journal)
    try:
        for first in range(0, n, 1000):
            batch = range(first, min(n, first + 1000))
            q.enqueue_many([q.prepare("burn.tasks.noop", limit_key=f"k:{i % keys}") for i in batch])
    finally:
        shared_writer(q.journal, q.durability).close()


def admission(server: RedisServer, base: str, n: int, keys: int, *, limited: bool) -> float:
    """Seconds to forward ``n`` jobs of ``keys`` distinct keys into Redis (no worker).

    Notes the CPU this process (the forwarder) and Redis used meanwhile in :data:`CPU`.
    """
    from hybridq.forwarder.loop import Forwarder  # noqa: PLC0415
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415

    server.flushall()
    settled(server.url)
    d = tempfile.mkdtemp(prefix="limits-adm-", dir=base)
    journal = os.path.join(d, "journal")
    enqueue("lim", journal, n, keys)
    transport = RQTransport(server.url)
    fwd = Forwarder(
        journal,
        transport,
        window_min=2 * n,
        window_max=2 * n,
        lease_s=2.0,
        limits=[LIMIT] if limited else None,
    )
    fwd.open()
    try:
        with redis.Redis.from_url(server.url) as conn:
            t0, cpu0, redis0 = time.perf_counter(), time.process_time(), redis_cpu(server.url)
            while conn.llen("rq:queue:lim") < n:
                fwd.step()
                if time.perf_counter() - t0 > 300:
                    raise RuntimeError("not all forwarded in 300 s")
            took = time.perf_counter() - t0
            cpu = {"forwarder": time.process_time() - cpu0, "redis": redis_cpu(server.url) - redis0}
            CPU.setdefault(f"admission {keys} keys {'limits' if limited else 'none'}", []).append(cpu)
            return took
    finally:
        fwd.close()
        transport.close()
        shutil.rmtree(d, ignore_errors=True)


def burn(cfg: Config, n: int, keys: int, *, limited: bool, limit: str = LIMIT, name: str = "") -> float:
    """Seconds from starting a forwarder and one ``hybridq worker`` over ``n`` journaled no-op jobs
    of ``keys`` keys to the last one done: the forwarding (and the gate) and the running, end to end.

    Notes the CPU the forwarder, the worker and Redis used meanwhile in :data:`CPU` (under
    ``name``, default ``burn <keys> keys``). ``limit``: the policy when ``limited``.
    """
    cfg.server.flushall()
    settled(cfg.url)
    d = Path(tempfile.mkdtemp(prefix="limits-burn-", dir=cfg.base))
    done = d / "done"
    done.touch()
    env = burndown.child_env(cfg, done)
    enqueue(burndown.QUEUE, str(d / "journal"), n, keys)  # untimed, nothing running yet
    extra = ["--limit", limit] if limited else []
    forward = [
        sys.executable,
        "-m",
        "hybridq",
        "forward",
        "--journal",
        str(d / "journal"),
        "--redis",
        cfg.url,
    ]
    worker = [sys.executable, "-m", "hybridq", "worker", "--redis", cfg.url, burndown.QUEUE]
    t0, redis0 = time.perf_counter(), redis_cpu(cfg.url)
    procs = spawn([[*forward, "--lease", "2", *extra], worker], d, "p", env)
    try:
        while done.stat().st_size < n:
            if time.perf_counter() - t0 > 300:
                raise RuntimeError(f"{done.stat().st_size} of {n} done in 300 s")
            time.sleep(0.01)
        took = time.perf_counter() - t0
        cpu = {
            part: group_cpu(proc.pid) for part, (proc, _) in zip(("forwarder", "worker"), procs, strict=True)
        }
        cpu["redis"] = redis_cpu(cfg.url) - redis0
        CPU.setdefault(f"{name or f'burn {keys} keys'} {'limits' if limited else 'none'}", []).append(cpu)
        return took
    finally:
        kill_groups(procs)
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="bench-limits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a smoke run (small N, 1 repetition)")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed burns before the timed ones (default 1; 0 with --quick): a fresh machine's first "
        "round ran 12-44%% slower than the rest, whichever configuration it held",
    )
    p.add_argument("-n", type=int, default=None, help="jobs per measurement (default 20,000)")
    p.add_argument(
        "--only",
        action="append",
        choices=WHATS,
        help="run only this measurement (repeatable; default: all)",
    )
    args = p.parse_args(argv)
    n = args.n or (2000 if args.quick else 20_000)
    repeat = args.repeat or (1 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    if warmup < 0:
        p.error("--warmup must be 0 or more")
    base = tempfile.mkdtemp(prefix="bench-limits-")
    server = RedisServer(directory=Path(base) / "redis")
    server.start()
    try:
        cfg = Config(url=server.url, server=server, base=base, n={}, max_seconds=300.0)
        whats = [w for w in WHATS if w in (args.only or WHATS)]
        rows: dict[str, list[float]] = {}
        for _ in range(warmup):  # not counted: warms the page cache, Redis's allocator, the CPU
            burn(cfg, n, 10, limited=False, name="warmup")
            CPU.pop("warmup none", None)
        for rep in range(repeat):
            order = [False, True] if rep % 2 == 0 else [True, False]
            for limited in order:
                tag = "limits" if limited else "none"
                if "admission 10000 keys" in whats:
                    rows.setdefault(f"admission 10000 keys {tag}", []).append(
                        admission(server, base, n, 10_000, limited=limited)
                    )
                for keys in (10, 10_000):
                    if f"burn {keys} keys" in whats:
                        took = burn(cfg, n, keys, limited=limited)
                        rows.setdefault(f"burn {keys} keys {tag}", []).append(took)
                what = "burn 10000 keys concurrency 10"
                if what in whats:
                    took = burn(cfg, n, 10_000, limited=limited, limit=TENANT_LIMIT, name=what)
                    rows.setdefault(f"{what} {tag}", []).append(took)
        print(
            f"bench-limits: n={n} repeat={repeat} warmup={warmup} python {sys.version.split()[0]} cpus {os.cpu_count()}"
        )
        for name, values in rows.items():
            med = statistics.median(values)
            print(
                f"{name:32} {n / med:10,.0f} jobs/s  median {med:7.3f} s  ({', '.join(f'{v:.3f}' for v in values)})"
            )
        for what in whats:
            lims, nones = rows[f"{what} limits"], rows[f"{what} none"]
            per_rep = sorted(none / lim for lim, none in zip(lims, nones, strict=True))
            lim, none = statistics.median(lims), statistics.median(nones)
            extra = f"; +{(lim - none) / n * 1e6:.1f} us per job" if what.startswith("admission") else ""
            spread = f"per repetition {per_rep[0]:.3f}..{per_rep[-1]:.3f}x, median {statistics.median(per_rep):.3f}x"
            print(f"{what}: with limits / without = {none / lim:.3f}x throughput ({spread}){extra}")
        print("CPU per job, medians (us): forwarder, worker, Redis")
        for what in whats:
            med = {
                tag: {
                    part: statistics.median(c.get(part, 0.0) for c in CPU[f"{what} {tag}"]) / n * 1e6
                    for part in PARTS
                }
                for tag in ("none", "limits")
            }
            cells = ", ".join(
                f"{part} {med['none'][part]:.0f} -> {med['limits'][part]:.0f} ({med['limits'][part] - med['none'][part]:+.0f})"
                for part in PARTS
                if med["none"][part] or med["limits"][part]
            )
            print(f"{what}: without -> with limits: {cells}")
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
