"""``hybridq.current_job()``: what a running task knows about its own delivery.

Kept apart from :mod:`hybridq.worker` so that importing :mod:`hybridq` never imports RQ.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

__all__ = ["CurrentJob", "current_job"]


@dataclass(frozen=True, slots=True)
class CurrentJob:
    """The job a task is running for.

    Pass :attr:`idempotency_key` to downstream APIs (a payment provider's ``Idempotency-Key``
    header, a unique column in your database): hybridq runs a finished key at most once, but a
    task that was killed half-way runs again, and only the downstream system can tell whether
    its effect already happened.
    """

    #: The job id (also its RQ job id).
    id: str
    #: The idempotency key, verbatim (the job id unless the producer gave one).
    idempotency_key: str
    #: 1 for the first run; counts every run that started, including ones a crash cut short.
    attempt: int
    #: The attempt budget from the job's retry policy (1 without one).
    max_attempts: int
    #: The queue it was delivered from.
    queue: str
    #: The dotted path of the function.
    func: str


_current: contextvars.ContextVar[CurrentJob | None] = contextvars.ContextVar("hybridq_job", default=None)


def current_job() -> CurrentJob | None:
    """The job the calling task runs for; ``None`` outside a hybridq job (like RQ's)."""
    return _current.get()
