"""The pool's path through a private redis-server under callgrind, shared by the Redis benches.

``bench/noop_redis.py`` (per phase) and ``bench/limits_redis.py`` (per job, with limits) start
the same server and send the same TAKE and START as a pool process: made here once, so the
scripts' layouts are built and decoded by the pool's own helpers (``batch_scripts.take``,
``claim_part``) and nowhere else.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import redis
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import keys
from hybridq.testing.embedded import find_redis_server
from hybridq.worker import batch_scripts, scripts
from hybridq.worker.intake import Resolver, prepare
from hybridq.worker.runner import Taken


def start_server(d: str, out: str) -> tuple[subprocess.Popen[bytes], redis.Redis, str]:
    """redis-server (``--hz 1``, no slowlog, no persistence) under callgrind in ``d``: process, client, socket."""
    sock = os.path.join(d, "r.sock")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", find_redis_server(), "--port", "0"]
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
    return proc, c, sock


def envelopes(n: int, queue: str) -> list[Envelope]:
    """``n`` no-op jobs (``tests.tasks.add``) of ``queue``."""
    now = time.time()
    ids = [new_job_id(now) for _ in range(n)]
    return [
        Envelope(id=j, func="tests.tasks.add", args=(i, 1), queue=queue, idempotency_key=j, created_at=now)
        for i, j in enumerate(ids)
    ]


def take(c: redis.Redis, queue: str, n: int) -> list[Taken]:
    """Up to ``n`` jobs of ``queue`` taken and prepared as a pool process does (TAKE)."""
    taken = batch_scripts.take(c, [keys.rq_queue(queue)], n)
    items = [x for x in (prepare(j.decode(), queue, f, Resolver()) for j, _, f in taken) if x is not None]
    if len(items) != len(taken):
        raise SystemExit("a job could not be prepared: run with HYBRIDQ_ALLOW=tests and PYTHONPATH=.")
    return items


def start(c: redis.Redis, queue: str, items: list[Taken]) -> None:
    """START for ``items`` (their execution ids ``e<i>``); exits if a claim was not admitted."""
    args: list[Any] = [keys.RQ_PREFIX, "w1", "2026-01-01T00:00:00.000000Z"]
    for i, item in enumerate(items):
        item.exec_id, item.started = f"e{i}", time.time()
        args += [item.job_id, queue, item.exec_id, *batch_scripts.claim_part(item)]
    replies = scripts.call(c, batch_scripts.START, [], args)
    if any(int(r[0]) != 0 for r in replies):
        raise SystemExit(f"a claim was not admitted: {replies}")
