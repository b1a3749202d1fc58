"""The performance regression guard: durable enqueue against ``rq.Queue.enqueue``, same process, same run.

Not a benchmark (``scripts/bench`` is) and never an absolute time: the machines are shared and
noisy, so this compares hybridq with its peer in interleaved turns and fails only when the median
ratio falls far below the P1 target of 1.5x, under 1.0x, in three measurements in a row. A durable
enqueue slower than RQ's non-durable round trip means something regressed badly (a second fsync
per call, a lock held across the fsync, a Redis call on the producer path).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import rq
from hybridq import Queue
from hybridq.producer import _close_writers
from hybridq.testing.embedded import RedisServer
from rq.serializers import JSONSerializer

FUNC = "tests.tasks.add"
FLOOR = 1.0
OPS = 200
REPS = 5
ATTEMPTS = 3


def _rate(op: Callable[[], object]) -> float:
    started = time.perf_counter()
    for _ in range(OPS):
        op()
    return OPS / (time.perf_counter() - started)


def _ratios(hybridq_op: Callable[[], object], rq_op: Callable[[], object]) -> list[float]:
    """hybridq's rate over RQ's, per repetition; the order alternates so neither always goes first."""
    out = []
    for rep in range(REPS):
        if rep % 2 == 0:
            ours, theirs = _rate(hybridq_op), _rate(rq_op)
        else:
            theirs, ours = _rate(rq_op), _rate(hybridq_op)
        out.append(ours / theirs)
    return out


def test_durable_enqueue_is_not_slower_than_rq_enqueue(
    tmp_path: Path, redis_server: RedisServer, figures: Callable[[str], None]
) -> None:
    queue = Queue("default", tmp_path / "journal")
    conn = redis.Redis.from_url(redis_server.url)
    rq_queue = rq.Queue("default", connection=conn, serializer=JSONSerializer)
    try:
        for _ in range(20):  # warm both up: imports, the first segment, the connection
            queue.enqueue(FUNC, 1, 2)
            rq_queue.enqueue(FUNC, 1, 2)
        medians = []
        for _ in range(ATTEMPTS):
            ratios = _ratios(lambda: queue.enqueue(FUNC, 1, 2), lambda: rq_queue.enqueue(FUNC, 1, 2))
            medians.append(statistics.median(ratios))
            figures(
                f"GUARD P1 enqueue hybridq/rq median={medians[-1]:.2f}x "
                f"reps={','.join(f'{r:.2f}' for r in ratios)} floor={FLOOR:.1f}x (target 1.5x: scripts/bench)"
            )
            if medians[-1] >= FLOOR:
                return
        pytest.fail(
            f"durable enqueue ran below {FLOOR}x rq.Queue.enqueue in {ATTEMPTS} measurements: {medians}"
        )
    finally:
        conn.close()
        _close_writers()
