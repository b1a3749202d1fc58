"""A delivery's policy lookup and text (issue 30), without Redis: CPU time, not wall clock.

What the forwarder does per delivery (``ForwarderState.delivery``): ``Limits.of(key)``, then
``Limit.wire(key)`` if the key is limited; with one rule (``k:*=concurrency:2``), for 10,000
keys in turn, a key per job, and a key per job without ``--limit``; then the cost of a key never
seen once the memo holds nearly its bound. ``time.process_time``, the least of the runs, µs a
delivery (docs/benchmarks.md, "One call fewer per claim").

  PYTHONPATH=. .venv/bin/python bench/limits_policy_cpu.py [-n 200000]
"""

from __future__ import annotations

import argparse
import time

from hybridq.protocol import keylimits
from hybridq.protocol.keylimits import Limits, parse_limits


def per_delivery(limits: Limits, keys: list[str]) -> float:
    """µs a delivery: the policy of each key, and its wire text if limited."""
    started = time.process_time()
    for key in keys:
        limit = limits.of(key)
        if limit is not None:
            limit.wire(key)
    return (time.process_time() - started) / len(keys) * 1e6


def new_keys(runs: int = 7, n: int = 10_000) -> tuple[float, float]:
    """µs a key never seen, ``Limits.of`` and ``Limit.wire`` apart, the memo nearly full first."""
    limits = parse_limits(["k:*=concurrency:2"])
    limit = limits.rules[0][1]
    bound = getattr(keylimits, "_OF_MAX", 16_384)
    for i in range(bound - 1):
        limits.of(f"k:{i}")
    best_of = best_wire = float("inf")
    for run in range(runs):
        keys = [f"k:new{run}:{i}" for i in range(n)]
        started = time.process_time()
        for key in keys:
            limits.of(key)
        best_of = min(best_of, (time.process_time() - started) / n * 1e6)
        started = time.process_time()
        for key in keys:
            limit.wire(key)
        best_wire = min(best_wire, (time.process_time() - started) / n * 1e6)
    return best_of, best_wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200_000, help="deliveries a run")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cases = [
        ("10,000 keys in turn", ["k:*=concurrency:2"], 10_000),
        ("a key per job", ["k:*=concurrency:2"], args.n),
        ("a key per job, no --limit", [], args.n),
    ]
    for name, rules, nkeys in cases:
        keys = [f"k:{i % nkeys}" for i in range(args.n)]
        best = min(per_delivery(parse_limits(rules), keys) for _ in range(args.runs))
        print(f"{name}: {best:.2f} us a delivery")
    of, wire = new_keys()
    print(f"a key never seen: Limits.of {of:.3f} us, Limit.wire {wire:.3f} us")


if __name__ == "__main__":
    main()
