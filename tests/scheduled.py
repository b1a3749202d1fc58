"""A schedules module for tests: ``hybridq forward --schedules tests.scheduled``.

Its one schedule runs :func:`record_tick` every minute, catching up every missed tick; the task
appends the tick's idempotency key to the file named by ``$HYBRIDQ_TEST_TICKS`` (fsync'd), so a
test counts the runs of each tick independently of hybridq.
"""

from __future__ import annotations

import os

import hybridq
from hybridq.schedules import parse_tick_key


def record_tick(path: str) -> str:
    """Append this tick's key (``schedule:minutely:<fire time>``) to ``path``."""
    job = hybridq.current_job()
    key = job.idempotency_key if job is not None else "outside a job"
    assert parse_tick_key(key) is not None
    with open(path, "a", encoding="utf-8") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    return key


hybridq.schedule(
    cron="* * * * *",
    func=record_tick,
    key="minutely",
    args=[os.environ.get("HYBRIDQ_TEST_TICKS", os.devnull)],
    catchup="all",
    max_catchup=30,
)
