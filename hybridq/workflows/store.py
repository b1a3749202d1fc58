"""The workflows' own file: which workflows and dependent jobs the forwarder holds, and their steps.

``<journal>/workflows/flows.sqlite`` (WAL, ``synchronous=FULL``, 0600), written only by the
forwarder (:mod:`hybridq.forwarder.flows`) under its lock, read by ``fetch_job`` and ``status``.
It holds no outcome and no result: those are the ledger's (read back through the lookup index,
which is rebuilt from the ledger). What it holds is what the forwarder decided:

* ``flows``: one row per workflow anchor read (the graph, its state: ``running``, ``succeeded``,
  ``failed``, ``cancelled``);
* ``steps``: one row per step: ``waiting`` (not released), ``released`` (its job is in the
  journal), or its end (``succeeded``, ``failed``, ``cancelled``);
* ``waits``: jobs enqueued with ``depends_on`` still waiting for them.

Damaged, it stops the forwarder at start. Lost (or restored from an older copy), it is created
empty, and the forwarder's reconcile and refill passes record again what they find held by its
record (an anchor, a job whose dependencies have not all succeeded): never pushed because the
file is missing (docs/workflows.md).

This module must not import redis or rq.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FLOWS_DIR", "SCHEMA", "Step", "counts", "flow_steps", "path_of", "steps_of"]

FLOWS_DIR = "workflows"
_FILE = "flows.sqlite"

SCHEMA = """
CREATE TABLE IF NOT EXISTS flows (
    id TEXT PRIMARY KEY, chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL,
    queue TEXT NOT NULL, graph TEXT NOT NULL, state TEXT NOT NULL, error TEXT);
CREATE INDEX IF NOT EXISTS flows_live ON flows(state);
CREATE TABLE IF NOT EXISTS steps (
    flow TEXT NOT NULL, n INTEGER NOT NULL, state TEXT NOT NULL,
    PRIMARY KEY (flow, n)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS waits (
    chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL,
    job TEXT NOT NULL, queue TEXT NOT NULL, deps TEXT NOT NULL,
    PRIMARY KEY (chain, seg, off)) WITHOUT ROWID;
"""


def path_of(journal: str) -> str:
    """Where the workflows' file of ``journal`` is."""
    return os.path.join(journal, FLOWS_DIR, _FILE)


def _read(journal: str) -> sqlite3.Connection | None:
    path = path_of(journal)
    if not os.path.exists(path):
        return None
    try:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
    except sqlite3.Error:
        return None


def flow_steps(journal: str, flow_id: str) -> tuple[str, list[tuple[int, str, tuple[int, ...]]]] | None:
    """Workflow ``flow_id``'s state and its steps' ``(n, state, after)``; ``None`` if not held."""
    db = _read(journal)
    if db is None:
        return None
    try:
        row = db.execute("SELECT state, graph FROM flows WHERE id = ?", (flow_id,)).fetchone()
        if row is None:
            return None
        steps = db.execute("SELECT n, state FROM steps WHERE flow = ? ORDER BY n", (flow_id,)).fetchall()
        graph = json.loads(row[1]).get("steps", [])
        deps = {n: tuple(int(d) for d in step.get("deps", ())) for n, step in enumerate(graph)}
        return str(row[0]), [(int(n), str(s), deps.get(int(n), ())) for n, s in steps]
    except (sqlite3.Error, ValueError, TypeError, AttributeError):
        return None
    finally:
        db.close()


@dataclass(frozen=True)
class Step:
    """One step of a workflow, as ``fetch_job(workflow_id).steps`` lists it."""

    #: Its place in the workflow (the order the shapes were written in).
    n: int
    #: Its job's id (``fetch_job`` it for its result, error and attempts), even before release.
    id: str
    #: ``waiting`` (not released), ``released`` (a job now), ``succeeded``, ``failed``, ``cancelled``.
    state: str
    #: The steps it waits for (their ``n``): the graph's edges.
    after: tuple[int, ...] = ()


def steps_of(journal: str, flow_id: str, step_id: Callable[[str, int], str]) -> list[Step]:
    """The steps of workflow ``flow_id`` (empty if the forwarder holds no such workflow yet)."""
    found = flow_steps(journal, flow_id)
    return (
        [] if found is None else [Step(n, step_id(flow_id, n), state, after) for n, state, after in found[1]]
    )


def counts(journal: str) -> dict[str, int]:
    """Workflows per state (``running``, ``succeeded``, ...) and ``waiting_on_deps`` jobs."""
    db = _read(journal)
    if db is None:
        return {}
    try:
        out = {str(s): int(n) for s, n in db.execute("SELECT state, count(*) FROM flows GROUP BY state")}
        (waits,) = db.execute("SELECT count(*) FROM waits").fetchone()
    except sqlite3.Error:
        return {}
    else:
        out["waiting_on_deps"] = int(waits)
        return out
    finally:
        db.close()
