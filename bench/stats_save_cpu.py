"""The stats snapshot's save with K limit keys' figures: instructions, not wall clock (issue 30).

The forwarder saves the snapshot (``hybridq.lookup.stats.save_snapshot``) with each checkpoint
save and at the end of a step whose figures changed; its key gate gives the same ``limit_keys``
object for up to a second (``hybridq.forwarder.keylimits``). This saves N snapshots that carry
the same K keys' figures (each key's as the gate makes them), in a temporary journal directory,
as a burn's steps within one second do. ``bench/fwd_cpu.py`` cannot show it: its clock moves
10 ms a step, so the gate's figures stay the first (empty) ones the whole run.

  PYTHONPATH=. valgrind --tool=callgrind --instr-atstart=no .venv/bin/python \
      bench/stats_save_cpu.py --callgrind [-n 200] [--keys 500]   # then: grep '^totals:' callgrind.out.*
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

from hybridq.lookup.stats import Snapshot, save_snapshot


def _figures(keys: int) -> dict[str, dict[str, object]]:
    now = time.time()
    return {
        f"tenant:{i:05d}": {
            "policy": "concurrency:1000000",
            "running": i % 7,
            "queued": i % 3,
            "started": i % 11,
            "quarantine_s": 0.0,
            "room": 999_990 + i % 10,
            "blocked_since": None,
            "at": now,
        }
        for i in range(keys)
    }


def _toggle(state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=200, help="snapshots saved (default 200)")
    p.add_argument("--keys", type=int, default=500, help="limit keys in the figures (default 500)")
    p.add_argument(
        "--callgrind", action="store_true", help="under valgrind --instr-atstart=no: count the saves"
    )
    args = p.parse_args()
    figures = _figures(args.keys)
    with tempfile.TemporaryDirectory() as journal:
        save_snapshot(journal, Snapshot(limit_keys=figures))  # (the first save, not counted)
        if args.callgrind:
            _toggle("on")
        start = time.process_time()
        for i in range(args.n):
            save_snapshot(journal, Snapshot(consumed=i, limit_keys=figures))
        took = time.process_time() - start
        if args.callgrind:
            _toggle("off")
        size = sum(os.path.getsize(os.path.join(journal, f)) for f in os.listdir(journal))
    print(f"{args.n} saves, {args.keys} keys: {took / args.n * 1e6:.1f} us a save (CPU), files {size} bytes")


if __name__ == "__main__":
    main()
