"""The enqueue side of workflows and ``depends_on`` (docs/workflows.md).

A workflow becomes one envelope, its *anchor*: ``func`` is
:data:`~hybridq.workflows.canvas.ANCHOR_FUNC` and ``meta["hybridq"]["wf"]`` the compiled graph,
each step an envelope prepared (so checked) as any enqueue would. It is journaled like any job,
so ``enqueue`` returns once the whole workflow is durable; the forwarder releases its steps.
``depends_on`` is ``meta["hybridq"]["deps"]``: the ids the job waits for (one journal).

This module must not import redis or rq.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hybridq.envelope.model import Envelope, validate_job_id
from hybridq.errors import EnvelopeError
from hybridq.workflows.canvas import ANCHOR_FUNC, Chain, Chord, Group, Signature, Workflow, compile_graph

if TYPE_CHECKING:
    from hybridq.producer.queue import Queue

__all__ = ["MAX_DEPS", "dependency_ids", "is_workflow", "workflow_envelope"]

#: Jobs one job may wait for.
MAX_DEPS = 1000
_SHAPES = (Signature, Chain, Group, Chord, Workflow)
#: What ``enqueue(workflow, ...)`` takes besides the workflow.
_FLOW_OPTIONS = frozenset({"on_error", "job_id", "idempotency_key", "meta", "description"})


def is_workflow(f: object) -> bool:
    """Whether ``enqueue``'s first argument is a workflow (a signature or a shape), not a function."""
    return isinstance(f, _SHAPES)


def dependency_ids(depends_on: object, journal: str) -> list[str]:
    """The job ids ``depends_on`` names (a job, an id, or a list of them), checked.

    Raises:
        EnvelopeError: not ids, too many, or a job of another journal (one line).
    """
    items = depends_on if isinstance(depends_on, list | tuple | set | frozenset) else [depends_on]
    ids: list[str] = []
    for item in items:
        if isinstance(item, str):
            try:
                ids.append(validate_job_id(item))
            except EnvelopeError as exc:
                raise EnvelopeError(f"depends_on: {exc}") from None
            continue
        job_id, other = getattr(item, "id", None), getattr(item, "journal", None)
        if not isinstance(job_id, str):
            raise EnvelopeError(f"depends_on takes jobs and job ids, not {item!r:.60}")
        if isinstance(other, str) and other != journal:
            raise EnvelopeError(
                f"depends_on: job {job_id} is in another journal ({other}); it works within one"
            )
        ids.append(job_id)
    if not ids:
        raise EnvelopeError("depends_on names no job")
    if len(ids) > MAX_DEPS:
        raise EnvelopeError(f"depends_on names at most {MAX_DEPS} jobs, not {len(ids)}")
    return list(dict.fromkeys(ids))


def with_deps(env: Envelope, ids: list[str]) -> Envelope:
    """``env`` waiting for ``ids`` (its ``meta["hybridq"]``, a key no caller may set)."""
    env.meta = {**env.meta, "hybridq": {"deps": ids}}
    env._encoded = None
    env.to_bytes(keys_checked=True)
    return env


def workflow_envelope(queue: Queue, flow: object, options: Mapping[str, Any]) -> Envelope:
    """The anchor envelope of ``flow`` on ``queue`` (nothing is written).

    Raises:
        EnvelopeError: an option ``enqueue(workflow)`` does not take, a step ``prepare``
            refuses, or a graph over the record's size limit.
    """
    unknown = sorted(set(options) - _FLOW_OPTIONS)
    if unknown:
        raise EnvelopeError(f"enqueue(workflow) does not take {', '.join(unknown)} (see docs/workflows.md)")
    on_error = options.get("on_error")
    if on_error is not None and not isinstance(on_error, Signature):
        raise EnvelopeError("on_error must be a signature (hybridq.sig or task.s)")
    root = flow.root if isinstance(flow, Workflow) else flow
    wf = Workflow(root, on_error if on_error is not None else getattr(flow, "on_error", None))  # type: ignore[arg-type]
    graph = compile_graph(wf, lambda s: _step(queue, s))
    env = queue.prepare(
        ANCHOR_FUNC,
        job_id=options.get("job_id"),
        idempotency_key=options.get("idempotency_key"),
        meta=options.get("meta"),
        description=options.get("description"),
    )
    env.meta = {**env.meta, "hybridq": {"wf": graph}}
    env._encoded = None
    env.to_bytes()  # too large, or too deep: refused now, nothing written
    return env


def _step(queue: Queue, s: Signature) -> dict[str, Any]:
    """Step ``s``'s envelope as JSON, prepared (checked) as ``enqueue`` would, on its own queue."""
    options = {k: v for k, v in s.options.items() if k not in ("queue", "immutable")}
    target = queue
    name = s.options.get("queue")
    if name is not None and name != queue.name:
        target = type(queue)(str(name), queue.journal)  # the same journal: one workflow, one journal
    env = target.prepare(s.func, s.args, s.kwargs, **options)
    return env.to_dict()
