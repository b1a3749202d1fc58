"""What the forwarder's flows read and build: step jobs, results, dependencies' outcomes.

Results and outcomes are read from the lookup index, which the forwarder fills from the ledger
after its fsync (never from Redis): :func:`step_result`, :func:`deps_verdict`.
:func:`step_envelope` builds a released step's job with its deterministic id and idempotency key
(docs/workflows.md). :func:`ledger_end` and :func:`cancel_started` are a workflow's stop:
the end the ledger holds, and the cancel of its released steps not ended.

This module must not import redis or rq.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from hybridq.cancels import cancel_at
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import read_result, tag_call
from hybridq.errors import EnvelopeError, HybridqError
from hybridq.forwarder.state import ForwarderState
from hybridq.lookup import reads
from hybridq.protocol import RESULT_MAX_BYTES
from hybridq.transport.base import Loc
from hybridq.workflows import canvas
from hybridq.workflows.canvas import PASS_LIST, PASS_NONE, PASS_ONE, step_id, step_key

__all__ = [
    "ENDED",
    "UNKNOWN_DEP_S",
    "StepFailed",
    "cancel_started",
    "deps_verdict",
    "ended_as",
    "graph_problem",
    "ledger_end",
    "step_envelope",
    "step_result",
]

log = logging.getLogger("hybridq.forwarder")

#: How long a dependency may stay unknown to the lookup index before its dependent fails.
UNKNOWN_DEP_S = 30.0
#: A step's (and a workflow's) end states.
ENDED = frozenset({"succeeded", "failed", "cancelled"})


class StepFailed(Exception):
    """A workflow cannot go on: its message says why (one line)."""


def graph_problem(graph: Mapping[str, Any]) -> str | None:
    """What is wrong with an anchor's graph (``None``: this version can run it).

    Checked once, when the anchor is read: a step that could not be built later would stop
    the forwarder at each start instead.
    """
    steps, out, err = graph.get("steps"), graph.get("out"), graph.get("err")
    if graph.get("v") != 1 or not isinstance(steps, list) or not steps or not isinstance(out, list):
        return "version, steps or out"
    if len(steps) > canvas.MAX_STEPS:  # a hand-made record: enqueue refuses more already
        return f"{len(steps)} steps, over the limit of {canvas.MAX_STEPS}"
    for n, step in enumerate([*steps, *([err] if err is not None else [])]):
        if not isinstance(step, Mapping) or step.get("pass") not in (PASS_NONE, PASS_ONE, PASS_LIST):
            return f"step {n}"
        deps = step.get("deps")
        if not isinstance(deps, list) or not all(
            type(d) is int and 0 <= d < min(n, len(steps)) for d in deps
        ):
            return f"step {n}: dependencies"
        try:
            Envelope.from_dict(step.get("env") or {})
        except EnvelopeError as exc:
            return f"step {n}: {exc}"
    if not out or not all(type(o) is int and 0 <= o < len(steps) for o in out):
        return "out"
    return None


def step_envelope(
    journal: str, fid: str, n: int, step: Mapping[str, Any], lead: tuple[Any, ...] = ()
) -> Envelope:
    """Step ``n``'s job: the prepared call, led by the results it takes (or by ``lead``).

    The arguments are decoded and tagged again with the results in front, so a result of a
    tagged type (a ``datetime``, a ``Decimal``...) reaches the step as that type.
    """
    env = Envelope.from_dict(step["env"])
    deps: list[int] = step["deps"]
    if step["pass"] == PASS_ONE and deps:
        lead = (step_result(journal, fid, deps[0]),)
    elif step["pass"] == PASS_LIST:
        lead = ([step_result(journal, fid, d) for d in deps],)
    args, kwargs = env.call_args()
    call_args, call_kwargs, tags = tag_call(env.func, (*lead, *args), dict(kwargs))
    return dataclasses.replace(
        env,
        id=step_id(fid, n),
        idempotency_key=step_key(fid, n),
        created_at=time.time(),
        args=call_args,
        kwargs=call_kwargs,
        tags=tags,
        meta={**env.meta, "hybridq": {"wf": fid, "step": n}},
        signature=None,
    )


def step_result(journal: str, fid: str, n: int, *, stored: bool = False) -> Any:
    """Step ``n``'s result from the lookup index (the ledger's), as stored or decoded.

    Raises :class:`StepFailed` if it was not kept (too large to pass, or not reported).
    """
    row = reads.find(journal, step_id(fid, n))
    if row is None or row.state != "done" or row.outcome != "succeeded":
        raise StepFailed(f"step {n}: no result recorded")
    if row.rkept:
        if row.result is None:
            return None
        return json.loads(row.result) if stored else read_result(row.result)
    if row.rbytes is not None:
        raise StepFailed(
            f"result of step {n} too large to pass ({row.rbytes} bytes > {RESULT_MAX_BYTES} bytes)"
        )
    raise StepFailed(f"step {n}: its worker reported no result")


def ended_as(outcome: str | None) -> str:
    """A terminal outcome as a step's state (one this version does not know: ``failed``)."""
    return outcome if outcome in ENDED else "failed"


def deps_verdict(
    journal: str, deps: list[str], now: float, unknown_since: dict[str, float], start: bool
) -> str | None:
    """``""``: all of ``deps`` succeeded; a reason: one failed or is unknown; ``None``: waiting.

    ``unknown_since`` (updated): when each dependency the index does not know was first looked
    for; after :data:`UNKNOWN_DEP_S` its dependent fails (a job of another journal, or none).
    A clock starts only if ``start``: in a pass after every chain was read to its end, so an
    unknown dependency is not one in a chain not read yet (a process's delayed chain,
    docs/journal.md). Once started it runs on through later passes behind the journal (paused
    clocks, not reset ones: a steady load must not keep a dependency that never comes waiting).
    """
    waiting = False
    for dep in deps:
        row = reads.find(journal, dep)
        if row is None:
            since = unknown_since.get(dep)
            if since is None and start:
                since = unknown_since[dep] = now
            if since is not None and now - since >= UNKNOWN_DEP_S:
                return f"dependency {dep} is unknown in this journal (depends_on works within one)"
            waiting = True  # looked at again at each full pass, until found or given up
            continue
        unknown_since.pop(dep, None)
        if row.state != "done":
            waiting = True
        elif row.outcome != "succeeded":
            return f"dependency {dep} {ended_as(row.outcome)}"
    return None if waiting else ""


def ledger_end(state: ForwarderState, fid: str, anchor: Loc) -> tuple[str, str]:
    """How the ledger ended workflow ``fid``'s anchor (an end cut short by a crash keeps it).

    Returns its end and error line; a cancel asked for and not ended yet: ``cancelled``.
    """
    if not state.index.is_terminal(anchor):
        return "cancelled", "cancelled"
    row = reads.find(state.journal, fid)
    if row is not None and (row.writer, row.seg, row.off) == anchor and row.outcome in ENDED:
        return row.outcome, row.error or row.outcome
    return ("failed", "failed") if anchor in state.index.failed else ("cancelled", "cancelled")


def cancel_started(journal: str, job_ids: list[str]) -> None:
    """Ask for a cancel of released steps not ended (one that runs finishes, its outcome stands)."""
    locs = []
    for job_id in job_ids:
        row = reads.find(journal, job_id)
        if row is not None and row.state != "done":
            locs.append((job_id, (row.writer, row.seg, row.off)))
    if locs:
        try:
            cancel_at(locs, journal)
        except (HybridqError, OSError) as exc:
            log.error("cannot cancel the released steps %s: %s", [j for j, _ in locs], exc)
