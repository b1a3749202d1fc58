"""Jobs a worker's claim refused because their limit key had no room: back into the run table.

The claim script (``hybridq.worker.scripts``) adds the refused run's signed started event to the
owner's stream with the why (``Event.refused``), in the same atomic step as the refusal. The
harvest passes those here before it deletes them from Redis: each job still waiting for that
run (not terminal, not cancelled, not in the run table already, no later attempt delivered)
gets its run-table row again, committed (fsync) before the events go. The key gate then pushes
the same attempt again as soon as its key has room, at the forwarder's next step
(``Backlog.refill``): no attempt used, and no wait of about two leases for the reconcile pass
to find it stranded (docs/forwarder.md, "Limits per key").

If the forwarder dies before the commit, the events are harvested again; if Redis loses them,
the job is one the refill pass (a Redis that lost its state) or the reconcile pass (stranded)
delivers again, as before. A job in the run table is never delivered by a pass, so it is
pushed once.

This module must not import redis or rq.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridq.forwarder.records import envelope_at
from hybridq.forwarder.runs import Row, row_of
from hybridq.forwarder.state import ForwarderState
from hybridq.protocol import StartedEvent
from hybridq.transport.base import Loc

__all__ = ["take_back"]


def take_back(state: ForwarderState, refused: Sequence[StartedEvent]) -> int:
    """Put the jobs of the refused runs ``refused`` back in the run table (committed); how many."""
    index, runs = state.index, state.runs
    rows: dict[Loc, Row] = {}
    for event in refused:
        loc = event.loc
        if index.is_terminal(loc) or loc in index.cancels or loc in index.duplicates:
            continue  # settled since
        if loc in rows or runs.contains(loc):
            continue  # waiting already (an event harvested twice)
        if event.attempt <= index.attempts(loc):
            continue  # an older run's refusal: a later attempt was delivered since
        env = envelope_at(state.journal, loc)
        if env is not None and env.id == event.id:
            rows[loc] = row_of(loc, env, env.run_at)
    if rows:
        runs.add(rows.values())
        runs.commit()  # before the harvest deletes the events from Redis
    return len(rows)
