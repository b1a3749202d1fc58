"""Redis's instructions per no-op job in each phase of its path (issue 29 B1), under callgrind.

Starts a private redis-server under ``valgrind --tool=callgrind`` (redis 6.2 of the ``embedded``
extra; ``--hz 1 --slowlog-log-slower-than -1``, as ``bench/limits_redis.py``), the owner's epoch
set (so START's fence reads INFO), then each phase for all N jobs before the next, with a dump of
callgrind's counts after each: the push (``RQTransport.push``, chunks of 100), TAKE, START and
END in batches of 8 as a pool process sends them, and the harvest (XRANGE + XDEL of the
completion events). Prints redis-server's instructions per job in each phase. Unlike a pool
process, each phase runs for every job before the next (the intermediate list holds them all
between TAKE and START): compare trees with this script, not with ``bench/limits_redis.py``.

  PYTHONPATH=. HYBRIDQ_ALLOW=tests .venv/bin/python bench/noop_redis.py -n 2000

Runs of the same code differ by about 0.5k instructions per job per phase.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import redis_callgrind
from hybridq.protocol import Delivery, keys
from hybridq.transport.rq import RQTransport
from hybridq.worker import batch_end, scripts
from hybridq.worker.run import conclude

QUEUE, OWNER = "cg", "cg-owner"
PHASES = ("push", "take", "start", "end", "harvest")


def total(path: str) -> int:
    """The instructions a callgrind dump counted."""
    with open(path) as f:
        return int([line for line in f if line.startswith(("summary:", "totals:"))][-1].split()[1])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=2000, help="jobs (default 2,000)")
    n = p.parse_args(argv).n
    d = tempfile.mkdtemp(prefix="noop-redis-")
    out = os.path.join(d, "callgrind.out")
    proc, c, sock = redis_callgrind.start_server(d, out)
    c.set(keys.epoch(OWNER), f"0:{c.info('server')['run_id']}:x")

    def dump() -> None:
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, stdout=subprocess.DEVNULL)

    dump()  # the setup
    envs = redis_callgrind.envelopes(n, QUEUE)
    transport = RQTransport(f"unix://{sock}")
    for s in range(0, n, 100):
        transport.push(
            [Delivery(env, OWNER, ("w", 0, s + i), lease_s=60.0) for i, env in enumerate(envs[s : s + 100])]
        )
    dump()
    batches = [redis_callgrind.take(c, QUEUE, 8) for _ in range(0, n, 8)]
    dump()
    for items in batches:
        redis_callgrind.start(c, QUEUE, items)
    dump()
    for items in batches:
        for item in items:
            conclude(item.run, 1, None)
        scripts.call(c, batch_end.END, [], batch_end.end_args("w1", items))
    dump()
    while events := transport.harvest(OWNER, 1000):
        transport.ack(OWNER, [e.event_id for e in events])
    dump()
    transport.close()
    c.shutdown(nosave=True)
    proc.wait()
    for k, phase in enumerate(PHASES, start=2):  # out.1 is the setup
        print(f"{phase:8} {total(f'{out}.{k}') / n:9,.0f} instructions per job")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
