"""The enqueue side: what application code calls to put a job in the journal, and nothing else.

It owns :class:`Queue` (``queue``: validate, sign, append with fsync, nudge the forwarder, return
a :class:`hybridq.Job`), the checks of a call's options (``calls``), the ``@hybridq.task``
decorator (``task``), the capacity check (``capacity``) and the group commit of
``enqueue_async`` (``aio``). It may use the journal, the envelope, the signing keys, the ledger's
checkpoint (for the capacity count) and the nudge; never Redis, RQ or a transport: enqueueing
keeps working while Redis is down (import-linter checks it).

:class:`Queue`, :func:`task` and :class:`Task` load on first use from here (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridq.lazy import lazy_names

if TYPE_CHECKING:
    from .queue import Queue
    from .task import Task, task

__all__ = ["Queue", "Task", "task"]

_LAZY = {"Queue": ".queue", "Task": ".task", "task": ".task"}

__getattr__, __dir__ = lazy_names(globals(), _LAZY)
