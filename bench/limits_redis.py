"""Redis's instructions per job of the pool's scripts, limited or not (issue 30), under callgrind.

Starts a private redis-server under ``valgrind --tool=callgrind`` (redis 6.2 of the ``embedded``
extra; ``--hz 1 --slowlog-log-slower-than -1``: the slow log would file an entry for every
script valgrind slows down, a cost the real server does not pay), pushes N no-op jobs with
:meth:`RQTransport.push` (chunks of 100), then drives the pool's scripts as a pool process sends
them: in batches of 8, TAKE, the forwarders' ``KEY_USE`` (adding the batch's jobs to their keys'
queued counts and reading the keys, as a forwarder's step does), START and END. ``limited``:
each job carries the policy ``--policy`` (default ``10,0,0``: concurrency 10, no rate) of key
``tenant:<i % keys>``; ``none``: no limit, no ``KEY_USE``. The limits' epoch is set long ago
(no quarantine). Prints redis-server's total instructions per job (the setup and push
included: compare ``limited`` with ``none`` of the same N).

  PYTHONPATH=. HYBRIDQ_ALLOW=tests .venv/bin/python bench/limits_redis.py limited --keys 2000

Runs of the same code differ by about 2-3k instructions per job (the jobs' ids and times).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import redis
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import Delivery, keys
from hybridq.testing.embedded import find_redis_server
from hybridq.transport import rq_limits
from hybridq.transport.rq import RQTransport
from hybridq.worker import batch_end, batch_scripts, scripts
from hybridq.worker.intake import Resolver, prepare
from hybridq.worker.run import conclude

QUEUE, OWNER = "cg", "cg-owner"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("none", "limited"))
    p.add_argument("--keys", type=int, default=2000, help="distinct limit keys (default 2,000)")
    p.add_argument("-n", type=int, default=2000, help="jobs (default 2,000)")
    p.add_argument("--policy", default="10,0,0", help="concurrency,rate,period ms (default 10,0,0)")
    p.add_argument("--out", default=None, help="callgrind's output file")
    args = p.parse_args(argv)
    n, limited = args.n, args.mode == "limited"
    d = tempfile.mkdtemp(prefix="limits-redis-")
    sock, out = os.path.join(d, "r.sock"), args.out or os.path.join(d, "callgrind.out")
    server = find_redis_server()
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", server, "--port", "0"]
    cmd += ["--unixsocket", sock, "--save", "", "--appendonly", "no", "--hz", "1", "--dir", d]
    cmd += ["--slowlog-log-slower-than", "-1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = redis.Redis(unix_socket_path=sock)
    for _ in range(600):
        try:
            c.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.1)
    run_id = c.info("server")["run_id"]
    c.set(keys.LIMITS_EPOCH, f"1:{run_id}")
    c.set(keys.epoch(OWNER), f"0:{run_id}:x")
    now = time.time()
    ids = [new_job_id(now) for _ in range(n)]
    envs = [
        Envelope(id=j, func="tests.tasks.add", args=(i, 1), queue=QUEUE, idempotency_key=j, created_at=now)
        for i, j in enumerate(ids)
    ]
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
        taken = scripts.call(
            c, batch_scripts.TAKE, [keys.rq_queue(QUEUE)], [8, keys.RQ_PREFIX, *batch_scripts.TAKE_FIELDS]
        )
        taken = batch_scripts.taken(taken)
        items = [x for x in (prepare(j.decode(), QUEUE, f, Resolver()) for j, _, f in taken) if x is not None]
        if len(items) != len(taken):
            raise SystemExit("a job could not be prepared: run with HYBRIDQ_ALLOW=tests and PYTHONPATH=.")
        if limited:
            batch = {f"tenant:{i % args.keys}" for i in range(b, b + 8)}
            rq_limits.key_use(key_use, 60.0, dict.fromkeys(batch, 0), dict.fromkeys(batch, 1))
        start: list[object] = [keys.RQ_PREFIX, "w1", "2026-01-01T00:00:00.000000Z"]
        for i, item in enumerate(items):
            item.exec_id, item.started = f"e{i}", time.time()
            start += [item.job_id, QUEUE, item.exec_id, *batch_scripts.claim_part(item)]
        replies = scripts.call(c, batch_scripts.START, [], start)
        if any(int(r[0]) != 0 for r in replies):
            raise SystemExit(f"a claim was not admitted: {replies}")
        for item in items:
            conclude(item.run, 1, None)
        scripts.call(c, batch_end.END, [], batch_end.end_args("w1", items))
    c.shutdown(nosave=True)
    proc.wait()
    with open(out) as f:
        totals = [line for line in f if line.startswith(("summary:", "totals:"))]
    total = int(totals[-1].split()[1])
    print(f"{args.mode} keys={args.keys} n={n}: {total:,} instructions, {total / n:,.0f} per job")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
