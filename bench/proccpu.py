"""CPU seconds per part of a measurement: process groups from Linux's ``/proc``, Redis from ``INFO cpu``.

On a machine shared with other work the wall-clock ratios of a benchmark swing widely; the CPU
each part (forwarder, worker, Redis) spent per job much less, and it says where the time went.
``scripts/bench-burn`` and ``scripts/bench-limits`` print it per job.
"""

from __future__ import annotations

import os
from pathlib import Path

import redis


def redis_cpu(url: str) -> float:
    """CPU seconds the Redis server used so far (``INFO cpu``)."""
    with redis.Redis.from_url(url) as conn:
        info = conn.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def group_cpu(pgid: int) -> float:
    """CPU seconds used so far by the live processes of group ``pgid`` and the children they reaped.

    Linux's ``/proc`` (0.0 elsewhere): a worker's pool processes are in its group.
    """
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp, ...; utime..cstime at 11-14
            total += sum(int(f) for f in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


class Meter:
    """The CPU each part used between :meth:`start` and :meth:`stop`.

    Args:
        url: the Redis server's URL (its CPU is the part ``"redis"``).
        groups: per part, the process groups (leaders' pids) it is made of; a part may gain
            groups after :meth:`start` (a worker started then: its groups count from zero).
    """

    def __init__(self, url: str, groups: dict[str, list[int]]) -> None:
        self.url = url
        self.groups = groups
        self._start: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {part: sum(group_cpu(g) for g in pgids) for part, pgids in self.groups.items()}
        now["redis"] = redis_cpu(self.url)
        return now

    def start(self) -> None:
        """Note what each part used so far."""
        self._start = self._now()

    def stop(self) -> dict[str, float]:
        """CPU seconds per part since :meth:`start` (read before the processes are stopped)."""
        return {part: used - self._start.get(part, 0.0) for part, used in self._now().items()}
