"""Jobs enqueued with ``depends_on``: released or cancelled once their dependencies ended.

:class:`hybridq.forwarder.flows.Flows` records such a job in the ``waits`` table of the
workflows' file when it reads it; :func:`release_waiters` (at each of its passes) moves the ones
whose dependencies ended: into the run table (docs/forwarder.md) when all succeeded, ``cancelled``
in the ledger with the reason otherwise (docs/workflows.md).

This module must not import redis or rq.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable

from hybridq.envelope.model import Envelope
from hybridq.forwarder.flow_steps import deps_verdict
from hybridq.forwarder.runs import RunTable
from hybridq.forwarder.state import ForwarderState
from hybridq.ledger.entries import Entry
from hybridq.transport.base import Loc

__all__ = ["release_waiters"]

log = logging.getLogger("hybridq.forwarder")


def release_waiters(
    state: ForwarderState,
    db: sqlite3.Connection,
    runs: Callable[[], RunTable],
    held: set[Loc],
    unknown_since: dict[str, float],
    start_clocks: bool,
    news: set[str] | None,
    envelope_of: Callable[[Loc], Envelope | None],
) -> tuple[int, int]:
    """Release (or cancel) the waiting jobs whose dependencies ended (``news``: of these ids).

    Returns how many were released (to the run table) and how many stopped waiting; the ones
    that did leave ``waits`` and ``held``.
    """
    released = ended = 0
    now = time.monotonic()
    for chain, seg, off, job, queue, deps in db.execute("SELECT * FROM waits").fetchall():
        if news is not None and job not in news and news.isdisjoint(json.loads(deps)):
            continue
        loc: Loc = (chain, int(seg), int(off))
        gone = state.index.is_terminal(loc) or loc in state.index.cancels  # cancelled while it waited
        verdict = (
            ""
            if gone
            else deps_verdict(state.journal, json.loads(deps), now, unknown_since, start=start_clocks)
        )
        if verdict is None:
            continue
        if verdict == "" and not gone:
            env = envelope_of(loc)  # its priority and limit key: the waits keep neither
            prio, key = (env.priority, env.limit_key or "") if env is not None else (0, "")
            runs().add([(loc, queue, time.time(), prio, key)])
            runs().commit()  # durable before its wait goes: a crash re-adds (one row)
            released += 1
        elif not gone:
            entry = Entry("done", job, loc, outcome="cancelled", error=verdict, at=time.time(), queue=queue)
            state.append([entry])
            log.warning("job %s cancelled: %s", job, verdict)
        db.execute("DELETE FROM waits WHERE chain = ? AND seg = ? AND off = ?", loc)
        held.discard(loc)
        ended += 1
    return released, ended
