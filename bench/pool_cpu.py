"""A pool process's CPU per no-op job, in isolation (issue 29 B1): no forwarder, no other worker.

Starts a private redis-server (no persistence), sets the owner's epoch (START's fence reads it),
pushes N deliveries of a no-op task as the forwarder does (``RQTransport.push``, chunks of 100,
not measured), then runs one pool process's loop in this process (``Engine`` in burst mode,
``--threads`` 8 and the pool's garbage collector pace, as ``hybridq worker``'s child runs them)
until the queue is empty and every job ended. Prints the process's CPU time (``process_time``:
every thread of this process; Redis's CPU is not counted) per job, over the engine's run.
Every job must have finished (RQ's finished registry, or none when RQ's result_ttl is 0) and
written its completion event. The supervisor's part (the lease keeper, the pipe it reads) is not
there: the pool's child sends its leases to it as it starts each batch; here the channel is off.

  PYTHONPATH=. .venv/bin/python bench/pool_cpu.py -n 4000 --repeat 3
  PYTHONPATH=. .venv/bin/python bench/pool_cpu.py -n 4000 --profile   # cProfile, every thread
  PYTHONPATH=. .venv/bin/python bench/pool_cpu.py -n 2000 --keys 2000 --limit concurrency:1000000

``--keys K`` names a limit key per job (``k:<i % K>``); with ``--limit POLICY`` each delivery
carries that policy as the forwarder makes it (``Limit.wire``, the token's ``#L``) and the push
adds it to its key's queued count (issue 30: the worker's Python per limited job).

Compare trees by running this file with ``PYTHONPATH`` at each tree, alternating.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import Delivery, keys
from hybridq.protocol.keylimits import Limit, parse_limit
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from hybridq.worker import runner as runner_mod
from hybridq.worker.engine import Engine
from hybridq.worker.gcpace import pace_pool_process
from pool_inline import run_inline

QUEUE, OWNER, TASK = "pc", "pc-owner", "pool_cpu.noop"
# The worker runs only allowed functions (hybridq.security.allow): this script's task.
os.environ.setdefault("HYBRIDQ_ALLOW", "pool_cpu")


def noop() -> None:
    """The task: nothing."""


#: The limited variant (``--keys``, ``--limit``): a limit key per job, and the policy its delivery carries.
KEYS: int = 0
LIMIT: Limit | None = None


def fill(url: str, n: int) -> None:
    transport = RQTransport(url)
    try:
        now = time.time()
        envs = [
            Envelope(
                id=j,
                func=TASK,
                queue=QUEUE,
                idempotency_key=j,
                created_at=now,
                limit_key=f"k:{i % KEYS}" if KEYS else None,
            )
            for i, j in enumerate(new_job_id(now) for _ in range(n))
        ]

        def wire(e: Envelope) -> str | None:
            return LIMIT.wire(e.limit_key) if LIMIT is not None and e.limit_key is not None else None

        for s in range(0, n, 100):
            transport.push(
                [
                    Delivery(e, OWNER, ("pc", 0, s + i), lease_s=60.0, limit=wire(e))
                    for i, e in enumerate(envs[s : s + 100])
                ]
            )
    finally:
        transport.close()


def inline(engine: Engine) -> int:
    """The engine's turns without its threads or clocks (bench/pool_inline.py)."""
    run_inline(engine)
    return 0


def one(
    server: RedisServer,
    n: int,
    threads: int,
    profiles: list[cProfile.Profile] | None,
    verbose: bool = False,
    instr: bool = False,
    inline_mode: bool = False,
) -> float:
    """CPU seconds of one engine burst over ``n`` pushed no-op jobs."""
    server.flushall()
    c = server.client()
    run_id = c.info("server")["run_id"]
    c.set(keys.epoch(OWNER), f"0:{run_id}:x")
    c.set(keys.LIMITS_EPOCH, f"1:{run_id}")  # the limits' state began long ago: no quarantine
    fill(server.url, n)
    engine = Engine(server.url, [QUEUE], threads=threads, async_concurrency=100, burst=True)
    gc.collect()
    main_prof = cProfile.Profile(time.thread_time) if profiles is not None else None
    if instr:  # run under valgrind --tool=callgrind --instr-atstart=no: count the engine's run only
        subprocess.run(
            ["callgrind_control", "-i", "on", str(os.getpid())], check=True, stdout=subprocess.DEVNULL
        )
    t0, u0 = time.process_time(), os.times()
    if main_prof is not None:
        main_prof.enable()
    code = inline(engine) if inline_mode else engine.run()
    if main_prof is not None:
        main_prof.disable()
        profiles.append(main_prof)
    cpu, u1 = time.process_time() - t0, os.times()
    if instr:
        subprocess.run(
            ["callgrind_control", "-i", "off", str(os.getpid())], check=True, stdout=subprocess.DEVNULL
        )
    if verbose:
        print(
            f"  user {(u1.user - u0.user) / n * 1e6:.1f} us, system {(u1.system - u0.system) / n * 1e6:.1f} us a job"
        )
    events = c.xlen(keys.events(OWNER))
    left = c.llen(keys.rq_queue(QUEUE))
    if code != 0 or events != n or left != 0:
        sys.exit(f"pool_cpu: exit {code}, {events} completion events of {n}, {left} left queued")
    c.close()
    return cpu


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=4000, help="jobs per run (default 4,000)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--profile", action="store_true", help="cProfile every thread of one run")
    p.add_argument("--top", type=int, default=40)
    p.add_argument(
        "--callgrind",
        action="store_true",
        help="under valgrind --tool=callgrind --instr-atstart=no: count only the engine's runs",
    )
    p.add_argument(
        "--inline",
        action="store_true",
        help="run the jobs in the engine's thread, 8 a turn, no clocks (deterministic: for --callgrind)",
    )
    p.add_argument("--keys", type=int, default=0, help="a limit key per job, k:<i %% KEYS> (0: none)")
    p.add_argument("--limit", default=None, help="the policy every key's delivery carries (needs --keys)")
    p.add_argument("-v", "--verbose", action="store_true", help="also each run's user and system CPU")
    a = p.parse_args(argv)
    global KEYS, LIMIT
    KEYS, LIMIT = a.keys, parse_limit(a.limit) if a.limit else None
    if LIMIT is not None and not KEYS:
        p.error("--limit needs --keys")
    pace_pool_process()
    with tempfile.TemporaryDirectory(prefix="pool-cpu-") as d, RedisServer(directory=d) as server:
        one(server, 200, a.threads, None)  # warm: imports, scripts loaded
        if a.profile:
            profiles: list[cProfile.Profile] = []
            serve = runner_mod.Runner._serve

            def profiled(self: Any) -> None:
                prof = cProfile.Profile(time.thread_time)
                profiles.append(prof)
                prof.enable()
                try:
                    serve(self)
                finally:
                    prof.disable()

            runner_mod.Runner._serve = profiled  # type: ignore[method-assign]
            one(server, a.n, a.threads, profiles)
            stats = pstats.Stats(profiles[0], stream=sys.stdout)
            for prof in profiles[1:]:
                stats.add(prof)
            stats.strip_dirs().sort_stats("tottime").print_stats(a.top)
            stats.sort_stats("cumulative").print_stats(a.top)
            return 0
        per_job = [
            one(server, a.n, a.threads, None, a.verbose, a.callgrind, a.inline) / a.n * 1e6
            for _ in range(a.repeat)
        ]
    print(f"pool CPU per no-op job (us): median {statistics.median(per_job):.1f}", end="  ")
    print("runs " + " ".join(f"{v:.1f}" for v in per_job))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
