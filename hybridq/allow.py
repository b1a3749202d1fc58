"""Which functions a worker may run: Redis write access must not mean code execution.

RQ imports whatever dotted path a job hash names. hybridq's worker runs a job's function only if
it was registered with :func:`hybridq.task` in the worker's process, or its dotted path lies under
a module prefix the operator allows (``hybridq worker --allow app.tasks``, or the environment
variable ``HYBRIDQ_ALLOW=app.tasks,billing`` for any worker, a plain ``rq worker`` included). A
job naming anything else fails for good, with an error that says how to allow it, and nothing
is imported. ``HYBRIDQ_ALLOW=*`` allows everything (RQ's behaviour; not recommended).

This module must not import redis, rq or the journal (producers and workers both use it).
"""

from __future__ import annotations

import os

__all__ = ["ENV_VAR", "allowed", "allowed_prefixes", "refusal", "register"]

#: The environment variable holding the allowed module prefixes, comma-separated.
ENV_VAR = "HYBRIDQ_ALLOW"

_registered: set[str] = set()


def register(path: str) -> None:
    """Allow ``path`` in this process (``hybridq.task`` calls this for every task it makes)."""
    _registered.add(path)


def allowed_prefixes() -> tuple[str, ...]:
    """The prefixes in ``HYBRIDQ_ALLOW`` (read on each call: ``hybridq worker --allow`` sets it)."""
    raw = os.environ.get(ENV_VAR, "")
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def allowed(path: str) -> bool:
    """Whether a worker may import and run the function at ``path``."""
    if path in _registered:
        return True
    return any(prefix in ("*", path) or path.startswith(prefix + ".") for prefix in allowed_prefixes())


def refusal(path: str) -> str:
    """The error for a refused function: what it is, and how to allow it."""
    module = path.rpartition(".")[0]
    return (
        f"{path} is not allowed to run on this worker: decorate it with @hybridq.task and have the "
        f"worker import its module, or allow its module (hybridq worker --allow {module}, or "
        f"{ENV_VAR}={module}); see docs/security.md"
    )
