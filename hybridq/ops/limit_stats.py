"""The per-key limits' figures for ``stats()``, ``status --json``, ``doctor`` and the dashboard.

``limit_keys`` (per limit key the forwarder looked at recently): ``policy`` (as ``--limit``
takes it), ``running`` (runs holding a slot), ``queued`` (pushed, not yet claimed), ``waiting``
(jobs in the journal's run table, held for the key's room), ``started_in_period`` (starts in
the rate's last period), ``quarantine_s`` (what is left of the hold after Redis lost its state)
and ``waiting_on_limit_s`` (how long jobs of the key have waited with no room; 0: they have
room, or none waits). From the forwarder's snapshot (what its gate last read from Redis) and the
run table (the waiting counts); empty without limits (docs/forwarder.md, "Limits per key").

``fair_keys`` (per fair key, ``forward --fair-key``: each limit key matching one is a lane of the
refill's round robin): ``waiting`` (its jobs in the run table) and ``running`` (runs holding a
slot, when the key is also a limit key the gate read; ``null`` otherwise: an unlimited key's
runs are counted nowhere). The :data:`FAIR_MAX` keys with the most jobs waiting; read from the
run table's lanes, one pass over it (measured 0.22 s for a million rows over 1,000 keys), at most
once per :data:`FAIR_TTL_S` per process (metrics scrapes, the dashboard: a count that old is
shown meanwhile); empty, and no row read, when the forwarder has no fair keys (the run table
records the fair keys its lanes were made under) (docs/forwarder.md, "Priorities and fairness").
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from hybridq.forwarder.runs import RUNS_DIR, RUNS_FILE
from hybridq.lookup.stats import Snapshot

__all__ = ["FAIR_MAX", "FAIR_TTL_S", "LONG_WAIT_S", "fair_figures", "limit_figures", "long_waits"]

#: A limit key whose jobs have waited with no room this long is named by ``doctor``.
LONG_WAIT_S = 600.0
#: Keys per query of the run table.
_CHUNK = 500
#: The most fair keys the figures show (those with the most jobs waiting).
FAIR_MAX = 500
#: How long a process reuses its last count of the fair keys' waiting jobs (seconds).
FAIR_TTL_S = 10.0
_FAIR_QUERY = (
    "SELECT lane, count(*) AS n FROM runs WHERE lane != '' GROUP BY lane ORDER BY n DESC, lane LIMIT ?"
)
#: Per run table path: the fair keys its lanes were made under, when they were last counted
#: (monotonic), and the count.
_fair_cache: dict[str, tuple[str, float, dict[str, int]]] = {}


def limit_figures(path: str, snap: Snapshot | None) -> dict[str, Any]:
    """``{"limit_keys": {key: figures}}`` (see the module docstring)."""
    raw: dict[str, dict[str, Any]] = dict(snap.limit_keys) if snap is not None else {}
    waiting = _waiting(path, sorted(raw)) if raw else {}
    now = time.time()
    out = {}
    for key, d in sorted(raw.items()):
        n = waiting.get(key, 0)
        since = d.get("blocked_since")
        out[key] = {
            "policy": d.get("policy"),
            "running": d.get("running"),
            "queued": d.get("queued"),
            "waiting": n,
            "started_in_period": d.get("started"),
            "quarantine_s": d.get("quarantine_s"),
            "waiting_on_limit_s": round(max(0.0, now - since), 3) if n and since is not None else 0.0,
        }
    return {"limit_keys": out}


def long_waits(path: str, snap: Snapshot | None) -> list[str]:
    """``doctor``'s lines: limit keys whose jobs waited with no room for :data:`LONG_WAIT_S` or more."""
    out = []
    for key, d in limit_figures(path, snap)["limit_keys"].items():
        if d["waiting_on_limit_s"] >= LONG_WAIT_S:
            out.append(
                f"limit key {key!r} ({d['policy']}): {d['waiting']} jobs have waited "
                f"{d['waiting_on_limit_s']:.0f} s for room ({d['running']} running, {d['queued']} queued): "
                "a limit too tight for the load, or slots held by runs that do not end"
            )
    return out


def fair_figures(path: str, snap: Snapshot | None) -> dict[str, Any]:
    """``{"fair_keys": {key: {"waiting": n, "running": n or None}}}`` (see the module docstring)."""
    limited: dict[str, dict[str, Any]] = snap.limit_keys if snap is not None else {}
    waiting = _read(path, lambda db: _lanes_waiting(path, db))
    return {
        "fair_keys": {
            key: {"waiting": n, "running": limited[key].get("running") if key in limited else None}
            for key, n in waiting.items()
        }
    }


def _lanes_waiting(path: str, db: sqlite3.Connection) -> dict[str, int]:
    """Per fair key, its rows; ``{}`` without reading one when the lanes were made under none."""
    made_under = db.execute("SELECT value FROM meta WHERE name = 'lanes'").fetchone()
    if not made_under or not made_under[0]:
        return {}
    now, cached = time.monotonic(), _fair_cache.get(path)
    if cached is not None and cached[0] == made_under[0] and now - cached[1] < FAIR_TTL_S:
        return cached[2]
    waiting = {k: int(n) for k, n in db.execute(_FAIR_QUERY, (FAIR_MAX,))}
    _fair_cache[path] = (str(made_under[0]), now, waiting)
    return waiting


def _waiting(path: str, keys: list[str]) -> dict[str, int]:
    """Per limit key, its jobs in the run table (read-only; ``{}`` if it cannot be read)."""

    def count(db: sqlite3.Connection) -> dict[str, int]:
        out: dict[str, int] = {}
        for start in range(0, len(keys), _CHUNK):
            part = keys[start : start + _CHUNK]
            marks = ",".join("?" * len(part))
            query = f"SELECT lkey, count(*) FROM runs WHERE lkey IN ({marks}) GROUP BY lkey"  # noqa: S608
            rows = db.execute(query, part)  # (the query holds only "?" marks)
            out.update({k: int(n) for k, n in rows})
        return out

    return _read(path, count)


def _read(path: str, read: Callable[[sqlite3.Connection], dict[str, int]]) -> dict[str, int]:
    """``read`` on the run table, opened read-only; ``{}`` if there is none or it cannot be read.

    (A file of a version without lanes, a lock held too long: the figures are left out.)
    """
    file = os.path.join(path, RUNS_DIR, RUNS_FILE)
    if not os.path.exists(file):
        return {}
    with contextlib.suppress(sqlite3.Error):
        db = sqlite3.connect(f"file:{file}?mode=ro", uri=True, timeout=1.0)
        try:
            return read(db)
        finally:
            db.close()
    return {}
