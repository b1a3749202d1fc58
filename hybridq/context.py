"""``hybridq.current_job()``: what a running task knows about its own delivery.

Kept apart from :mod:`hybridq.worker` so that importing :mod:`hybridq` never imports RQ.
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass, field

from hybridq.errors import Cancelled

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
    #: Set by the worker once it sees the job cancelled (``None``: nothing can cancel this run).
    cancel_flag: threading.Event | None = field(default=None, repr=False, compare=False)

    @property
    def cancelled(self) -> bool:
        """Whether the job was cancelled (``hybridq cancel``) while it runs: stop soon.

        The worker sees a cancel within about a second (docs/worker.md, "Cancelling a running
        job"); a task that does not stop on its own is stopped after a grace period.
        """
        return self.cancel_flag is not None and self.cancel_flag.is_set()

    def check_cancelled(self) -> None:
        """Raise :class:`hybridq.Cancelled` if the job was cancelled (call it between steps).

        Let it propagate: the run then ends with the outcome ``cancelled`` (no retry).
        """
        if self.cancelled:
            raise Cancelled(f"job {self.id} was cancelled")


_current: contextvars.ContextVar[CurrentJob | None] = contextvars.ContextVar("hybridq_job", default=None)


def current_job() -> CurrentJob | None:
    """The job the calling task runs for; ``None`` outside a hybridq job (like RQ's)."""
    return _current.get()
