"""Redis's instructions per job of the pool's scripts, limited or not (issue 30), under callgrind.

Starts a private redis-server under ``valgrind --tool=callgrind`` (redis 6.2 of the ``embedded``
extra; ``--hz 1 --slowlog-log-slower-than -1``: the slow log would file an entry for every
script valgrind slows down, a cost the real server does not pay), pushes N no-op jobs with
:meth:`RQTransport.push` (chunks of 100), then drives the pool's scripts as a pool process sends
them: in batches of 8, TAKE, the forwarders' ``KEY_USE`` (adding the batch's jobs to their keys'
queued counts and reading the keys; since the push counts its copies, reading them only), START
and END; ``--as-forwarder``: a read of the batch's keys, then (before) an add-only call, as a
forwarder whose keys are each seen once (a key per job or two) sends them. ``limited``:
each job carries the policy ``--policy`` (default ``10,0,0``: concurrency 10, no rate) of key
``tenant:<i % keys>``; ``none``: no limit, no ``KEY_USE``. The limits' epoch is set long ago
(no quarantine). Prints redis-server's total instructions per job (the setup and push
included: compare ``limited`` with ``none`` of the same N); ``--commandstats``: also its
commands per job (``INFO commandstats``, inside scripts and out, the setup and push included).

  PYTHONPATH=. HYBRIDQ_ALLOW=tests .venv/bin/python bench/limits_redis.py limited --keys 2000

Runs of the same code differ by about 2-3k instructions per job (the jobs' ids and times).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import redis_callgrind
from hybridq.protocol import Delivery, keys
from hybridq.transport import rq_limits
from hybridq.transport.rq import RQTransport
from hybridq.worker import batch_end, scripts
from hybridq.worker.run import conclude

QUEUE, OWNER = "cg", "cg-owner"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("none", "limited"))
    p.add_argument("--keys", type=int, default=2000, help="distinct limit keys (default 2,000)")
    p.add_argument("-n", type=int, default=2000, help="jobs (default 2,000)")
    p.add_argument("--policy", default="10,0,0", help="concurrency,rate,period ms (default 10,0,0)")
    p.add_argument("--out", default=None, help="callgrind's output file")
    p.add_argument(
        "--as-forwarder",
        action="store_true",
        help="KEY_USE as a forwarder with a key per job or two sends it: a read of each batch's keys "
        "(their first sight), and (before the push counted its copies) an add-only call after it",
    )
    p.add_argument(
        "--commandstats",
        action="store_true",
        help="also print Redis's commands per job (INFO commandstats, inside scripts and out, the push included)",
    )
    args = p.parse_args(argv)
    n, limited = args.n, args.mode == "limited"
    d = tempfile.mkdtemp(prefix="limits-redis-")
    out = args.out or os.path.join(d, "callgrind.out")
    proc, c, sock = redis_callgrind.start_server(d, out)
    run_id = c.info("server")["run_id"]
    c.set(keys.LIMITS_EPOCH, f"1:{run_id}")
    c.set(keys.epoch(OWNER), f"0:{run_id}:x")
    envs = redis_callgrind.envelopes(n, QUEUE)
    if limited:  # the key a forwarder's push counts the copy on (branch i30push on)
        envs = [dataclasses.replace(env, limit_key=f"tenant:{i % args.keys}") for i, env in enumerate(envs)]
    # Since branch i30push the push adds its copies to their keys' queued counts: KEY_USE then
    # only reads (as a forwarder's first sight of a key does); before, it added the batch's jobs.
    pushes_count = getattr(RQTransport, "counts_limited_pushes", False)
    transport = RQTransport(f"unix://{sock}")
    for s in range(0, n, 100):
        transport.push(
            [
                Delivery(
                    env,
                    OWNER,
                    ("w", 0, s + i),
                    limit=f"{args.policy},tenant:{(s + i) % args.keys}" if limited else None,
                    lease_s=60.0,
                )
                for i, env in enumerate(envs[s : s + 100])
            ]
        )
    transport.close()
    key_use = c.register_script(rq_limits.KEY_USE)
    for b in range(0, n, 8):
        items = redis_callgrind.take(c, QUEUE, 8)
        if limited:
            batch = {f"tenant:{i % args.keys}" for i in range(b, b + 8)}
            if args.as_forwarder:
                rq_limits.key_use(key_use, 60.0, dict.fromkeys(batch, 0), {})
                if not pushes_count:
                    rq_limits.key_use(key_use, 60.0, {}, dict.fromkeys(batch, 1))
            else:
                rq_limits.key_use(
                    key_use, 60.0, dict.fromkeys(batch, 0), dict.fromkeys(batch, 0 if pushes_count else 1)
                )
        redis_callgrind.start(c, QUEUE, items)
        for item in items:
            conclude(item.run, 1, None)
        scripts.call(c, batch_end.END, [], batch_end.end_args("w1", items))
    if args.commandstats:
        stats = c.info("commandstats")
        calls = {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}
        calls["info"] = calls.get("info", 0) - 1  # (this one)
        print(" ".join(f"{k}={v / n:.2f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v))
        print(f"commands per job: {sum(calls.values()) / n:.2f}")
    c.shutdown(nosave=True)
    proc.wait()
    with open(out) as f:
        totals = [line for line in f if line.startswith(("summary:", "totals:"))]
    total = int(totals[-1].split()[1])
    print(f"{args.mode} keys={args.keys} n={n}: {total:,} instructions, {total / n:,.0f} per job")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
