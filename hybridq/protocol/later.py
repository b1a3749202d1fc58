"""What a run that raised :class:`hybridq.RetryLater` comes to: a wait, or a failure for good.

The worker (:func:`hybridq.worker.run.conclude`) and the memory transport's simulated worker
both decide here, from the delivery (how many RetryLaters came before, since when) and the
exception: :class:`Later` (store a ``later`` outcome: the forwarder delivers the job again after
``delay`` seconds, with no attempt used), or the error the job fails with instead.

Why the deadline counts from the job's *first RetryLater*, not from its enqueue: a job may wait
in a backlog, or be delayed on purpose (``run_at``), for longer than the window its task allows
for a commit to show up; counted from enqueue, such a job would fail at its first RetryLater.
The first RetryLater is when the task first found the thing missing.

This module imports neither redis nor rq nor the journal: every process may import it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from hybridq.errors import RETRY_LATER_MAX_TIMES, RetryLater, RetryLaterExpired
from hybridq.protocol import Delivery, Outcome, StoredOutcome

__all__ = ["Later", "decide", "resolve"]

log = logging.getLogger("hybridq.worker")


@dataclass(frozen=True, slots=True)
class Later:
    """The run said RetryLater in time: run the job again after ``delay`` seconds."""

    delay: float
    #: The job's RetryLaters so far, this one included.
    count: int
    #: When its first RetryLater was said (the worker's clock).
    since: float
    #: When the job fails for good if it still says RetryLater (``since`` + ``deadline_s``).
    deadline: float
    #: What the task said is not ready (``RetryLater``'s ``reason``).
    reason: str = ""

    def stored(self, outcome: StoredOutcome) -> StoredOutcome:
        """``outcome`` (the run's, made as for a success) as the ``later`` outcome to store."""
        return dataclasses.replace(
            outcome,
            outcome=Outcome.LATER,
            result=None,
            error=f"RetryLater: {self.reason}" if self.reason else None,
            final=False,
            retry_delay=self.delay,
            later=self.count,
            later_since=self.since,
        )


def resolve(d: Delivery, error: Exception | None, now: float) -> tuple[Exception | None, Later | None]:
    """The error to record for a run of ``d`` that raised ``error``, and its wait if it has one.

    ``(None, Later)`` for a RetryLater in time (logged: one INFO line); the failure
    :func:`decide` makes of one that is not (caused by it); anything else unchanged.
    """
    if not isinstance(error, RetryLater):
        return error, None
    decided = decide(d, error, now)
    if isinstance(decided, Later):
        env = d.envelope
        log.info(
            "job %s (%s) said RetryLater%s: runs again in %.3g s, no attempt used "
            "(%d so far; deadline in %.0f s)",
            env.id,
            env.func,
            f" ({decided.reason})" if decided.reason else "",
            decided.delay,
            decided.count,
            decided.deadline - now,
        )
        return None, decided
    decided.__cause__ = error
    return decided, None


def decide(d: Delivery, exc: RetryLater, now: float) -> Later | Exception:
    """The wait before ``d``'s job runs again, or the error it fails with.

    A :class:`RetryLaterExpired` fails the job for good (its deadline passed, or it said
    RetryLater :data:`RETRY_LATER_MAX_TIMES` times); a ``ValueError`` (arguments changed out of
    range after the exception was made) fails this attempt like any error of the task's own.
    The last wait is shortened to end at the deadline, so that the job has one try there.
    """
    try:  # checked again: a subclass or a task may have changed them after __init__ checked
        checked = RetryLater(exc.seconds, exc.reason, deadline_s=exc.deadline_s)
    except (ValueError, AttributeError) as error:
        return error if isinstance(error, ValueError) else ValueError(f"RetryLater: {error}")
    env = d.envelope
    count = d.later + 1
    since = d.later_since if d.later and d.later_since is not None else now
    deadline = since + checked.deadline_s
    why = f"; last: {checked.reason}" if checked.reason else ""
    if count > RETRY_LATER_MAX_TIMES:
        return RetryLaterExpired(
            f"job {env.id} ({env.func}) said RetryLater more than {RETRY_LATER_MAX_TIMES} times"
            f"{f' (last: {checked.reason})' if checked.reason else ''}: failed for good"
        )
    if now >= deadline:
        return RetryLaterExpired(
            f"job {env.id} ({env.func}) still said RetryLater {now - since:.0f} s after its first one, "
            f"past its deadline of {checked.deadline_s:g} s ({count} RetryLaters{why}): failed for good"
        )
    return Later(min(checked.seconds, deadline - now), count, since, deadline, checked.reason)
