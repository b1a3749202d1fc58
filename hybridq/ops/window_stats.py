"""The window's figures for ``stats()`` and ``status --json``: per queue, what waits where.

``queue_detail`` (per queue): ``backlog`` (jobs waiting in the journal for room in the window),
``window`` (jobs queued in Redis at the forwarder's last look), ``window_target`` (what it keeps
there now), ``oldest_waiting_age_s`` (how long the oldest job of the backlog has been
eligible to run: the signal to scale workers on), ``waiting_by_priority`` (the backlog per
priority, highest first, as ``{"9": n, ...}``) and ``top_priority`` (the highest waiting, or
``None``). ``redis_memory``: ``used``, ``maxmemory``,
``ratio``, ``policy``, ``paused`` (``"high_water"``, ``"oom"`` or ``None``) and
``last_oom_age_s``. From the forwarder's snapshot; with ``--exact`` (or without a snapshot) the
backlog is read from the run table itself, and what only the forwarder knows is ``None``
without a snapshot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from hybridq.forwarder.runs import RUNS_DIR, RUNS_FILE
from hybridq.lookup.stats import Snapshot

__all__ = ["waiting_in_journal", "window_figures"]

log = logging.getLogger("hybridq.doctor")


def _age(at: float | None, now: float) -> float | None:
    return None if at is None else round(max(0.0, now - at), 3)


def window_figures(path: str, snap: Snapshot | None, *, exact: bool = False) -> dict[str, Any]:
    """``{"queue_detail": ..., "redis_memory": ...}`` (see the module docstring).

    ``exact``: the backlog from the run table itself (the window's figures are the forwarder's
    alone: from ``snap`` either way).
    """
    now = time.time()
    raw = dict(snap.queue_detail) if snap is not None else {}
    if exact or not raw:
        table = _from_run_table(path)
        raw = {
            q: {**raw.get(q, {}), **table.get(q, {"backlog": 0, "oldest_waiting": None, "by_priority": {}})}
            for q in {*raw, *table}
        }
    detail = {
        queue: {
            "backlog": int(d.get("backlog") or 0),
            "window": d.get("window"),
            "window_target": d.get("window_target"),
            "oldest_waiting_age_s": _age(d.get("oldest_waiting"), now) or 0.0,
            "waiting_by_priority": dict(d.get("by_priority") or {}),
            "top_priority": max(map(int, d["by_priority"]), default=None) if d.get("by_priority") else None,
        }
        for queue, d in sorted(raw.items())
    }
    memory = None
    mem = snap.redis_memory if snap is not None else None
    if mem is not None:
        maxmemory = int(mem.get("maxmemory") or 0)
        memory = {
            "used": mem.get("used"),
            "maxmemory": maxmemory,
            "ratio": round(mem["used"] / maxmemory, 4) if maxmemory and mem.get("used") is not None else None,
            "policy": mem.get("policy"),
            "high_water": mem.get("high_water"),
            "paused": mem.get("paused"),
            "last_oom_age_s": _age(mem.get("last_oom"), now),
        }
    return {"queue_detail": detail, "redis_memory": memory}


#: The counts the file keeps per queue and priority (hybridq.forwarder.runs), the oldest of each
#: queue from its index (``aged``): a dozen lookups, not a reading of every row.
_KEPT = (
    "SELECT queue, prio, n, (SELECT min(ord) FROM runs WHERE runs.queue = counts.queue) "
    "FROM counts WHERE n > 0"
)
#: A file that keeps no counts (written by an older version): every row counted.
_PER_PRIORITY = "SELECT queue, prio, count(*), min(ord) FROM runs GROUP BY queue, prio"
#: A run table written before priorities has no ``prio`` column: all of it is priority 0.
_BEFORE_PRIORITIES = "SELECT queue, 0, count(*), min(ord) FROM runs GROUP BY queue"


def _per_priority(db: sqlite3.Connection) -> list[tuple[str, int, int, float]]:
    """``(queue, prio, rows, oldest ord)``: from the kept counts when the file has them."""
    has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'meta'").fetchone() is not None
    if has_meta and db.execute("SELECT 1 FROM meta WHERE name = 'counts'").fetchone() is not None:
        return db.execute(_KEPT).fetchall()
    columns = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    return db.execute(_PER_PRIORITY if "prio" in columns else _BEFORE_PRIORITIES).fetchall()


def _from_run_table(path: str) -> dict[str, dict[str, Any]]:
    """Per queue, the backlog and its oldest job, read from the run table (read-only)."""
    file = os.path.join(path, RUNS_DIR, RUNS_FILE)
    if not os.path.exists(file):
        return {}
    with contextlib.suppress(sqlite3.Error):
        db = sqlite3.connect(f"file:{file}?mode=ro", uri=True, timeout=1.0)
        try:
            rows = _per_priority(db)
        finally:
            db.close()
        out: dict[str, dict[str, Any]] = {}
        for q, prio, n, oldest in sorted(rows, key=lambda r: (r[0], -r[1])):
            d = out.setdefault(q, {"backlog": 0, "oldest_waiting": oldest, "by_priority": {}})
            d["backlog"] += n
            d["oldest_waiting"] = min(d["oldest_waiting"], oldest)
            d["by_priority"][str(prio)] = n
        return out
    return {}


def waiting_in_journal(path: str) -> Callable[[tuple[str, int, int]], bool]:
    """Whether the job at a loc waits in the run table (read, never pushed: not Redis's business).

    One indexed lookup per call, on a read-only connection (no set of the backlog in memory).
    A table it cannot read (damaged, locked) says "unknown", taken as waiting: "not waiting"
    would make ``doctor --fix`` push every job it holds into Redis (logged once).
    """
    file = os.path.join(path, RUNS_DIR, RUNS_FILE)
    if not os.path.exists(file):
        return lambda _loc: False
    db = sqlite3.connect(f"file:{file}?mode=ro", uri=True, timeout=1.0, check_same_thread=False)
    failed: list[sqlite3.Error] = []

    def waiting(loc: tuple[str, int, int]) -> bool:
        try:
            row = db.execute("SELECT 1 FROM runs WHERE chain = ? AND seg = ? AND off = ?", loc).fetchone()
        except sqlite3.Error as exc:
            if not failed:
                log.warning("cannot read the run table %s (%s): its jobs are not checked", file, exc)
                failed.append(exc)
            return True
        return row is not None

    return waiting
