"""The forwarder's CPU per no-op job over a whole burn's path, in lockstep (issue 29 B1).

Starts a private redis-server, journals N no-op jobs (``Queue.enqueue_many``, not measured),
opens a ``Forwarder`` on them, then alternates: one ``Forwarder.step()`` (measured: the read of
the journal into the run table, the window's refill and its push, the pushed marks, the
harvest of outcomes into the ledger with its fsync, the index, the stats, compaction), then a
pool process's calls drain up to ``--take`` jobs of the queue (TAKE, START, the task, END, as
``bench/pool_cpu.py --inline`` runs them; not measured), until the ledger holds all N outcomes.
Nothing follows a clock but the forwarder's own timers, so ``--callgrind`` (under valgrind
``--tool=callgrind --instr-atstart=no``: only the steps counted) gives about the same count in
each run of a tree. Prints the steps' CPU (``thread_time``) per job, or with ``--profile`` a
cProfile of the steps.

  PYTHONPATH=. .venv/bin/python bench/fwd_cpu.py -n 4000 --repeat 3
  PYTHONHASHSEED=0 PYTHONPATH=. valgrind --tool=callgrind --instr-atstart=no \
      --separate-threads=yes --callgrind-out-file=cg.%p .venv/bin/python bench/fwd_cpu.py \
      -n 2000 --repeat 1 --callgrind
  grep '^totals:' cg.<pid>-01        # the main thread's: the steps alone

``--keys K`` names a limit key per job (``k:<i % K>``); ``--limit POLICY`` gives the forwarder
``k:*=POLICY`` (its key gate, the policy each delivery carries, the push's queued counts; issue
30: the forwarder's Python per limited job against the same jobs with no ``--limit``).

Compare trees by running this file with ``PYTHONPATH`` at each tree, alternating. Read the
main thread's count: valgrind's own total adds the threads that check files in the background
(the lookup index's integrity check, the ledger's), whose share varies by a percent or more
from run to run, while two runs' main threads differ by less than 0.1 % (docs/benchmarks.md,
"Fewer writes per job").
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
from collections.abc import Callable

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.producer.queue import shared_writer
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from hybridq.worker.engine import Engine
from pool_inline import run_inline

QUEUE, TASK = "fc", "fwd_cpu.noop"
#: The limited variant (``--keys``, ``--limit``): a limit key per job, and the forwarder's policy.
KEYS: int = 0
LIMIT: str | None = None
os.environ.setdefault("HYBRIDQ_ALLOW", "fwd_cpu")


def noop() -> None:
    """The task: nothing."""


def drain(url: str, budget: int) -> int:
    """Up to ``budget`` jobs of the queue run to their end as a pool process runs them (8 a turn)."""
    return run_inline(Engine(url, [QUEUE], threads=1, async_concurrency=1, burst=True), budget)


def fake_clock(fwd: Forwarder, clock: Callable[[], float]) -> None:
    """The parts that took ``time.monotonic`` as a default argument (bound at import) read ``clock``.

    The memory gate's INFO sample, the windows' drain rate and the decoded envelopes' expiry:
    patching ``time.monotonic`` does not reach them, and under callgrind they fired at every step.
    The lookup index's retention sweep (a chunk a second while it sweeps, then every ten
    minutes) reads the wall clock: it follows ``clock`` too, from now (under callgrind it swept
    a chunk of 2,000 rows at about every step, some 7k instructions a job).
    """
    fwd.backlog.gate.clock = fwd.backlog.windows.clock = fwd.state.decoded.clock = clock
    offset = time.time() - clock()
    fwd.lookup.clock = lambda: offset + clock()


def toggle(state: str) -> None:
    """Callgrind's instrumentation ``on`` or ``off`` for this process."""
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


def one(
    server: RedisServer,
    n: int,
    take: int,
    prof: cProfile.Profile | None,
    *,
    instr: bool = False,
    step_s: float = 0.01,
) -> tuple[float, int]:
    """CPU seconds of the forwarder's steps over ``n`` jobs, and the steps."""
    server.flushall()
    c = server.client()
    c.set(keys.LIMITS_EPOCH, f"1:{c.info('server')['run_id']}")  # the limits began long ago: no quarantine
    c.close()
    with tempfile.TemporaryDirectory(prefix="fwd-cpu-") as d:
        journal = os.path.join(d, "journal")
        q = Queue(QUEUE, journal)
        try:
            for first in range(0, n, 500):
                q.enqueue_many(
                    [
                        q.prepare(TASK, limit_key=f"k:{i % KEYS}" if KEYS else None)
                        for i in range(first, min(n, first + 500))
                    ]
                )
        finally:
            shared_writer(q.journal, q.durability).close()
        transport = RQTransport(server.url)
        fwd = Forwarder(journal, transport, limits=[f"k:*={LIMIT}"] if LIMIT else None)
        c = server.client()
        cpu, steps = 0.0, 0
        # The forwarder's timers (the memory sample, the pushed list's flush, the reconcile pass,
        # compaction, stats) read time.monotonic(): under callgrind a step takes seconds and each
        # would fire at every step. A clock that moves ``step_s`` per step makes the count the
        # same in each run and the timers fire as often per step as in a burn.
        real = time.monotonic
        now = [real()]
        time.monotonic = lambda: now[0]
        try:
            fwd.open()
            fake_clock(fwd, time.monotonic)
            gc.collect()
            idle = 0
            while idle < 3:
                if instr:
                    toggle("on")
                if prof is not None:
                    prof.enable()
                gc.disable()  # the forwarder's own pace collects about once a burn (forwarder/gcpolicy.py)
                t0 = time.thread_time()
                fwd.step()
                cpu += time.thread_time() - t0
                gc.enable()
                if prof is not None:
                    prof.disable()
                if instr:
                    toggle("off")
                steps += 1
                now[0] += step_s
                ran = drain(server.url, take)
                busy = ran or c.llen(keys.rq_queue(QUEUE)) or fwd.state.terminal_total < n
                idle = 0 if busy else idle + 1
            total = fwd.state.terminal_total
        finally:
            time.monotonic = real
            fwd.close()
            transport.close()
            c.close()
    if total != n:
        sys.exit(f"fwd_cpu: {total} outcomes of {n}")
    return cpu, steps


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=4000, help="jobs per run (default 4,000)")
    p.add_argument("--take", type=int, default=200, help="jobs the pool runs between two steps (default 200)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--step-ms", type=float, default=10.0, help="the forwarder's clock moves this much per step"
    )
    p.add_argument("--profile", action="store_true", help="cProfile of the steps of one run")
    p.add_argument("--top", type=int, default=45)
    p.add_argument(
        "--callgrind", action="store_true", help="under valgrind --instr-atstart=no: count the steps only"
    )
    p.add_argument("--keys", type=int, default=0, help="a limit key per job, k:<i %% KEYS> (0: none)")
    p.add_argument("--limit", default=None, help="the forwarder's policy of every k:* key (needs --keys)")
    a = p.parse_args(argv)
    global KEYS, LIMIT
    KEYS, LIMIT = a.keys, a.limit
    if LIMIT and not KEYS:
        p.error("--limit needs --keys")
    with tempfile.TemporaryDirectory(prefix="fwd-cpu-") as d, RedisServer(directory=d) as server:
        one(server, 300, a.take, None)  # warm: imports, scripts loaded
        if a.profile:
            prof = cProfile.Profile(time.thread_time)
            one(server, a.n, a.take, prof, step_s=a.step_ms / 1000)
            stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs()
            stats.sort_stats("tottime").print_stats(a.top)
            stats.sort_stats("cumulative").print_stats(a.top)
            return 0
        runs = [
            one(server, a.n, a.take, None, instr=a.callgrind, step_s=a.step_ms / 1000)
            for _ in range(a.repeat)
        ]
    per_job = [cpu / a.n * 1e6 for cpu, _ in runs]
    print(f"forwarder CPU per no-op job (us): median {statistics.median(per_job):.1f}", end="  ")
    print("runs " + " ".join(f"{v:.1f}" for v in per_job), f" steps {[s for _, s in runs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
