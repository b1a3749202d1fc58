"""Jobs a worker's claim refused because their limit key had no room: back into the run table.

On a refusal by the claim script (``hybridq.worker.scripts``), the worker adds the refused
variant of the run's started event (its ``refused`` field set, signed by the worker) to the
owner's stream with the why (``Event.refused``, not signed), in a second call right after the
claim (``hybridq.worker.refusal``: made only when a claim is refused). With signing on, only
the signed field counts: a Redis writer adding ``r`` to a copy of a started event takes nothing
back (:func:`is_refusal`). The
harvest passes those here before it deletes them from Redis: each job still waiting for that
run (not terminal, not cancelled, not in the run table already, no later attempt delivered;
on the list of the pushed, not held back) gets its run-table row again, committed (fsync) with
its pushed row before the events go. The key gate then pushes
the same attempt again as soon as its key has room, at the forwarder's next step
(``Backlog.refill``): no attempt used, and no wait of about two leases for the reconcile pass
to find it stranded (docs/forwarder.md, "Limits per key").

If the forwarder dies before the commit, the events are harvested again; if Redis loses them,
or the worker dies between its claim and that call, the job is one the refill pass (a Redis
that lost its state) or the reconcile pass (stranded) delivers again, as before. A job in the
run table is never delivered by a pass, so it is pushed once; a reconcile pass only probes a
job put back (its run may go on after all, and its worker die: orphaned, its next attempt
delivered), leaving the refused copy (stranded) to the row.

A refusal may also come back for a run that is not waiting: replayed (a copy of a genuine signed
one), or from a claim refusing a copy the refill queued again in the same step. So the row keeps
the refused attempt (``RunTable.backs``), and the push drops it, leaving the job to its retry
and reconcile paths, if the ledger's attempt count moved since (:func:`moved_on`: the attempt
failed, said ``RetryLater``, or was lost); the canceller takes such a row for pushed (a copy may
run). A push of the same attempt meanwhile keeps a copy that is queued or claimed.

This module must not import redis or rq.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridq.envelope.model import Envelope
from hybridq.forwarder.records import envelope_at
from hybridq.forwarder.runs import Row, row_of
from hybridq.forwarder.state import ForwarderState
from hybridq.protocol import StartedEvent
from hybridq.transport.base import Event, Loc

__all__ = ["is_refusal", "moved_on", "take_back"]


def is_refusal(event: Event, *, signed: bool) -> bool:
    """Whether the started event ``event`` is a claim's refusal of its run.

    ``signed``: signing is on, so only the event's own (signed) ``refused`` field says so; the
    stream entry's ``r`` is believed only with signing off (and from a worker before the field).
    """
    body = event.body
    if body is not None and body.get("refused") is True:
        return True
    return not signed and event.refused is not None


def moved_on(state: ForwarderState, loc: Loc) -> bool:
    """Whether the row at ``loc`` was put back by a refusal the ledger has moved on from.

    Its refused attempt is no longer the next one (``RunTable.backs``): that run, or a later
    one, started and failed, said ``RetryLater`` or was lost since, so its retry (with its
    backoff) or the reconcile pass delivers the job, not this row.
    """
    back = state.runs.backs.get(loc)
    return back is not None and state.index.attempts(loc) != back - 1


def take_back(
    state: ForwarderState, refused: Sequence[StartedEvent], holds: Callable[[Loc, Envelope], bool]
) -> int:
    """Put the jobs of the refused runs ``refused`` back in the run table (committed); how many.

    Only jobs on the list of the pushed (:mod:`hybridq.forwarder.pushed`) that the forwarder does
    not hold back (``holds``: a future ``run_at``, a retry not due, a workflow's hold): a forged
    refusal (signing off) pushes no job the forwarder keeps out of Redis. Each stays on that
    list, written in the same commit: a put-back job is a pushed one (its copy may run), which a
    pass must find again if the row is dropped (:func:`moved_on`).
    """
    index, runs = state.index, state.runs
    rows: dict[Loc, Row] = {}
    backs: dict[Loc, int] = {}
    for event in refused:
        loc = event.loc
        if index.is_terminal(loc) or loc in index.cancels or loc in index.duplicates:
            continue  # settled since
        if loc in rows or runs.contains(loc):
            continue  # waiting already (an event harvested twice)
        if event.attempt <= index.attempts(loc):
            continue  # an older run's refusal: a later attempt was delivered since
        if not state.pushed.listed(loc):
            continue  # never pushed (a forged refusal): it waits where it is
        env = envelope_at(state.journal, loc)
        if env is not None and env.id == event.id and not holds(loc, env):
            rows[loc] = row_of(loc, env, env.run_at)
            backs[loc] = event.attempt
    if rows:
        runs.add(rows.values(), [backs[loc] for loc in rows])
        state.pushed.insert(rows)  # written now: the catch-up after a crash may not list it
        runs.commit()  # before the harvest deletes the events from Redis
    return len(rows)
