"""The key gate's Python per limited job (issue 30), without Redis: CPU time, not wall clock.

A :class:`~hybridq.forwarder.keylimits.KeyLimits` over a transport that answers every read at
once (no key holds anything: every job has room), driven as a forwarder's admission of N jobs
of K keys drives it: per chunk of 500 jobs, the chunk's first sights read (``prefetch``), each
job's ``room`` and ``pushed``, then the step's ``look`` and ``figures``. ``time.process_time``,
the least (and the median) of 9 runs, µs a job. Load on the machine moves the median more
than the least.

  PYTHONPATH=. .venv/bin/python bench/limits_gate_cpu.py [-n 20000] [--keys 10000]
  PYTHONPATH=. valgrind --tool=callgrind --instr-atstart=no .venv/bin/python \
      bench/limits_gate_cpu.py --callgrind        # instructions of one run (after a warm one)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping

from hybridq.forwarder.keylimits import KeyLimits
from hybridq.protocol.keylimits import parse_limits
from hybridq.transport.base import KeyUse

CHUNK = 500


class _Instant:
    """A transport whose every key holds nothing; the push counts its copies (as RQ's)."""

    counts_limited_pushes = True

    def key_use(
        self, periods: Mapping[str, int], added: Mapping[str, int], *, lease_s: float
    ) -> dict[str, KeyUse]:
        del added, lease_s  # (nothing is added or held here)
        use = KeyUse(0, 0, 0, 0.0)
        return dict.fromkeys(periods, use)


def toggle(state: str) -> None:
    """Callgrind's instrumentation ``on`` or ``off`` for this process."""
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


def once(keys: list[str], instr: bool = False) -> float:
    gate = KeyLimits(parse_limits(["k:*=concurrency:1000000"]), _Instant(), 2.0)  # type: ignore[arg-type]
    if instr:
        toggle("on")
    t0 = time.process_time()
    for s in range(0, len(keys), CHUNK):
        chunk = keys[s : s + CHUNK]
        gate.prefetch(chunk)
        for key in chunk:
            if gate.room(key) > 0:
                gate.pushed(key, 1)
        gate.look()
        gate.figures()
    took = time.process_time() - t0
    if instr:
        toggle("off")
    return took


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=20_000, help="jobs (default 20,000)")
    p.add_argument("--keys", type=int, default=10_000, help="distinct limit keys (default 10,000)")
    p.add_argument(
        "--callgrind", action="store_true", help="under valgrind --instr-atstart=no: count one run only"
    )
    args = p.parse_args(argv)
    keys = [f"k:{i % args.keys}" for i in range(args.n)]
    if args.callgrind:
        # Under callgrind a chunk takes seconds: the gate's clock (FRESH_S, TRUST_S, the figures'
        # reuse) would see every read stale. Its clock moves 1 ms a chunk, as a real step's.
        clock = [0.0]

        def fake() -> float:
            clock[0] += 0.001 / (CHUNK + 2)  # (about one read of the clock per job)
            return clock[0]

        time.monotonic = fake
        once(keys)  # warm
        once(keys, instr=True)
        print("counted one run: valgrind's total over the jobs")
        return 0
    runs = [once(keys) for _ in range(9)]
    per = 1e6 / args.n
    print(f"gate: {min(runs) * per:.2f} us a job (least of 9), median {statistics.median(runs) * per:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
