"""Signatures and the shapes built from them: chain, group, chord (docs/workflows.md).

A workflow is described here and compiled, by :func:`compile_graph`, into a flat graph: a list of
steps, each the envelope of a job (prepared, so checked, like any enqueue) with the steps it
waits for and how it takes their results. The producer journals that graph in one record (the
*anchor*); the forwarder releases each step as an ordinary job once the ledger holds what it
waits for (:mod:`hybridq.forwarder.flows`). Nothing here writes anything.

This module must not import redis or rq.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridq.errors import EnvelopeError

__all__ = [
    "ANCHOR_FUNC",
    "SIGNATURE_OPTIONS",
    "STEP_SEP",
    "Chain",
    "Chord",
    "Group",
    "Node",
    "Signature",
    "Workflow",
    "chain",
    "chord",
    "compile_graph",
    "group",
    "refuse_step_id",
    "sig",
    "step_id",
    "step_key",
    "step_prefix",
]

#: The function an anchor record names. No worker runs it: the forwarder keeps anchors to itself.
ANCHOR_FUNC = "hybridq.workflows.canvas.anchor"
#: Steps in one workflow (the anchor holds them all in one journal record of at most 1 MiB).
MAX_STEPS = 2000
#: How a step takes the results of the steps it waits for.
PASS_NONE, PASS_ONE, PASS_LIST = "none", "one", "list"

#: The options a signature may carry (what ``enqueue`` takes per job).
SIGNATURE_OPTIONS = _OPTIONS = frozenset(
    {
        "queue",
        "retry",
        "job_timeout",
        "result_ttl",
        "description",
        "meta",
        "immutable",
        "priority",
        "limit_key",
    }
)


def anchor(*_: object, **__: object) -> None:
    """What a worker would run if an older forwarder pushed an anchor: refuse, loudly."""
    msg = "a workflow's anchor record was run as a job: upgrade the forwarder before the producers"
    raise RuntimeError(msg)


@dataclass(frozen=True)
class Signature:
    """One call to make later: the function, its arguments and its per-step options."""

    func: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def immutable(self) -> bool:
        """Whether it ignores the result of what ran before it (``immutable=True``)."""
        return bool(self.options.get("immutable", False))

    def set(self, **options: Any) -> Signature:
        """A copy with more options (``queue``, ``retry``, ``job_timeout``, ``immutable``, ...)."""
        return Signature(self.func, self.args, self.kwargs, _checked({**self.options, **options}))


@dataclass(frozen=True)
class Chain:
    """Its members one after the other, each given the previous one's result as first argument."""

    members: tuple[Node, ...]


@dataclass(frozen=True)
class Group:
    """Its members in parallel; its result is the list of their results, in order."""

    members: tuple[Node, ...]


@dataclass(frozen=True)
class Chord:
    """A group, then ``callback`` with the list of the group's results."""

    header: Group
    callback: Node


Node = Signature | Chain | Group | Chord


@dataclass(frozen=True)
class Workflow:
    """What ``queue.enqueue(workflow, ...)`` takes: a shape, and what runs if it fails."""

    root: Node
    on_error: Signature | None = None


def sig(func: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Signature:
    """A signature of ``func(*args, **kwargs)``.

    As with ``enqueue``, the keywords ``queue``, ``retry``, ``job_timeout``, ``result_ttl``,
    ``description``, ``meta`` and ``immutable`` are the step's options, not the function's (a
    function that takes one of those names: ``Signature(func, args, kwargs, options)``).
    """
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    return Signature(func, args, kwargs, _checked(options))


def chain(*members: Node) -> Chain:
    """Run ``members`` in order, each with the previous one's result first (Celery's ``chain``)."""
    return Chain(_nodes("chain", members))


def group(*members: Node | Iterable[Node]) -> Group:
    """Run ``members`` in parallel (a list, or the members themselves): Celery's ``group``."""
    flat: list[Any] = []
    for m in members:
        flat.extend(m if isinstance(m, list | tuple) else [m])
    return Group(_nodes("group", flat))


def chord(header: Group | Iterable[Node], callback: Node) -> Chord:
    """Run ``header`` in parallel, then ``callback`` with the list of its results (Celery's ``chord``)."""
    members = header if isinstance(header, Group) else group(*header)
    _nodes("chord", [callback])
    return Chord(members, callback)


def _nodes(shape: str, members: Iterable[Any]) -> tuple[Node, ...]:
    out = tuple(members)
    if not out:
        raise EnvelopeError(f"{shape}() needs at least one member")
    for m in out:
        if not isinstance(m, Signature | Chain | Group | Chord):
            raise EnvelopeError(f"{shape}() takes signatures (hybridq.sig, task.s) and shapes, not {m!r:.60}")
    return out


def _checked(options: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise EnvelopeError(f"signature options not supported: {', '.join(unknown)} (see docs/workflows.md)")
    return dict(options)


#: Between a workflow's id and a step's number in the step's job id; a producer's ``job_id``
#: may not end like a step's (:func:`refuse_step_id`), so a step never shares another job's id.
STEP_SEP = "__"
_STEP_TAIL = re.compile(r"__(?:\d+|err)\Z")
#: The longest step suffix (``__`` and up to 4 digits): longer workflow ids are hashed.
_PREFIX_MAX = 128 - len(STEP_SEP) - 4


def step_prefix(workflow_id: str) -> str:
    """What its steps' ids start with: the workflow's id, or a hash of a long one."""
    if len(workflow_id) <= _PREFIX_MAX:
        return workflow_id
    return hashlib.blake2b(workflow_id.encode(), digest_size=20).hexdigest()


def step_id(workflow_id: str, n: int) -> str:
    """The job id of step ``n`` (deterministic: a release repeated after a crash has the same)."""
    return f"{step_prefix(workflow_id)}{STEP_SEP}{n if n >= 0 else 'err'}"


def refuse_step_id(job_id: str) -> str:
    """``job_id`` if it cannot be a workflow step's id, else :class:`EnvelopeError` (one line)."""
    if _STEP_TAIL.search(job_id):
        raise EnvelopeError(
            f"invalid job id {job_id!r}: ids ending in __<number> or __err are workflow steps' own"
        )
    return job_id


def step_key(workflow_id: str, n: int) -> str:
    """The idempotency key of step ``n``: a second release is a duplicate, never a second run."""
    return f"wf:{workflow_id}:{'err' if n < 0 else n}"


Prepare = Callable[[Signature], dict[str, Any]]


def compile_graph(flow: Workflow, prepare: Prepare) -> dict[str, Any]:
    """The flat graph of ``flow``: its steps, each ``prepare``'d into an envelope's JSON object.

    ``{"v": 1, "steps": [{"env", "deps", "pass"}], "out": [...], "list": bool, "err": step|None}``:
    ``out`` are the steps whose results make the workflow's (a list when ``list``).
    """
    steps: list[dict[str, Any]] = []
    out, as_list = _add(flow.root, [], as_list=False, steps=steps, prepare=prepare)
    if len(steps) > MAX_STEPS:
        raise EnvelopeError(f"a workflow holds at most {MAX_STEPS} steps, not {len(steps)}")
    err: dict[str, Any] | None = None
    if flow.on_error is not None:
        # Unless immutable, it takes the workflow's id and the error line as its first arguments.
        mode = PASS_NONE if flow.on_error.immutable else PASS_ONE
        err = {"env": prepare(flow.on_error), "deps": [], "pass": mode}
    return {"v": 1, "steps": steps, "out": out, "list": as_list, "err": err}


def _add(
    node: Node, before: Sequence[int], *, as_list: bool, steps: list[dict[str, Any]], prepare: Prepare
) -> tuple[list[int], bool]:
    """Append ``node``'s steps after ``before``; return its last steps and whether they make a list."""
    if isinstance(node, Signature):
        mode = PASS_NONE if node.immutable or not before else (PASS_LIST if as_list else PASS_ONE)
        steps.append({"env": prepare(node), "deps": list(before), "pass": mode})
        return [len(steps) - 1], False
    if isinstance(node, Chain):
        last, listed = list(before), as_list
        for member in node.members:
            last, listed = _add(member, last, as_list=listed, steps=steps, prepare=prepare)
        return last, listed
    if isinstance(node, Group):
        ends: list[int] = []
        for member in node.members:
            member_ends, _ = _add(member, before, as_list=as_list, steps=steps, prepare=prepare)
            ends.extend(member_ends)
        return ends, True
    header_ends, _ = _add(node.header, before, as_list=as_list, steps=steps, prepare=prepare)
    return _add(node.callback, header_ends, as_list=True, steps=steps, prepare=prepare)
