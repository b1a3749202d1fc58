"""Tagged argument and result types through real processes (issue 33).

A forwarder and a worker (the pool, sync and ``async def`` tasks; ``--simple``, RQ's loop) on a
private redis-server: the task writes the ``repr`` of what it got to an effects file (the types
it saw, read without trusting hybridq's decoder) and returns it; the test reads the result back
with ``fetch_job``, as an application does.
"""

from __future__ import annotations

import datetime as dt
import uuid
import zoneinfo
from decimal import Decimal
from pathlib import Path

import pytest
from hybridq import Queue, fetch_job
from hybridq.testing.embedded import RedisServer

from tests.integration.test_worker_redis import Stack, stack

__all__ = ["stack"]  # the fixture, used by this module's tests

PARIS = zoneinfo.ZoneInfo("Europe/Paris")
ARGS = (
    dt.datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=PARIS),  # the second 02:30 of that night
    dt.datetime(2026, 12, 5, 20, 0, 0, 123456),  # noqa: DTZ001 - naive, on purpose
    dt.datetime(2026, 12, 5, 20, 0, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
    dt.date(2026, 12, 5),
    dt.time(23, 59, 59, 999999),
    Decimal("19.90"),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    b"\x00\xff raw",
    {"b", "a"},
    frozenset({1, 2}),
    (1, (2, "x")),
    {"$t": "date", "v": "not a tag: the caller's own dict"},
)
KWARGS = {"when": dt.date(2000, 1, 1), "amounts": [Decimal("0.1"), Decimal("-0")]}


@pytest.mark.parametrize(
    ("mode", "task"),
    [
        ("pool", "tests.tasks.types_echo"),
        ("pool", "tests.tasks.types_echo_async"),
        ("simple", "tests.tasks.types_echo"),
    ],
)
def test_arguments_and_results_keep_their_types_through_a_real_worker(
    mode: str, task: str, redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.txt"
    stack.forwarder(redis_server.url)
    stack.worker(redis_server.url, simple=mode == "simple")
    job = Queue("default", journal_dir).enqueue(task, str(effects), *ARGS, **KWARGS)
    assert job.wait(timeout=60) == (ARGS, KWARGS)
    result = fetch_job(job.id, journal_dir).result
    assert result == (ARGS, KWARGS)
    assert result[0][0].tzinfo is PARIS
    assert result[0][0].fold == 1
    assert [type(value) for value in result[0]] == [type(value) for value in ARGS]
    # What the task itself saw: its repr, evaluated here with the types in scope.
    seen = effects.read_text().splitlines()
    assert len(seen) == 1
    names = {
        "datetime": dt,
        "Decimal": Decimal,
        "UUID": uuid.UUID,
        "zoneinfo": zoneinfo,
        "frozenset": frozenset,
    }
    assert eval(seen[0], names) == (ARGS, KWARGS)
    assert "fold=1" in seen[0]
    assert "ZoneInfo(key='Europe/Paris')" in seen[0]
