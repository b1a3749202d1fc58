"""Errors a task, a worker or a job's waiter meets: refusals, RetryLater, failures, cancels.

Apart from the other roles' errors only to keep each module short; they are shown, pickled and
documented as ``hybridq.errors.<Name>`` (the package's ``__init__`` sets ``__module__``).
"""

from __future__ import annotations

import math

from ._base import HybridqError


class NotAllowed(HybridqError):
    """The job names a function this worker may not run."""


class NoSuchTask(HybridqError, AttributeError):
    """The job names a function its module (or class) does not have.

    A typo, or a task newer than this code. Raised where the module imports: a worker fails the
    job for good, a producer that imported the module refuses the name.
    """


class TaskUnavailable(HybridqError):
    """This worker cannot run the job's task (not importable, or not allowed here).

    The job is left for another worker, with no attempt used.
    """


class DuplicateOfFailedJob(HybridqError):
    """The idempotency key already failed for good: this delivery reports that failure."""


class StaleDelivery(HybridqError):
    """An old copy of an attempt that already failed: this delivery reports that failure again."""


#: How long, from a job's first RetryLater, it may keep saying RetryLater (``deadline_s``'s default).
RETRY_LATER_DEADLINE_S = 3600.0
#: The longest ``deadline_s``: a week (a signed envelope expires after a week by default, too).
RETRY_LATER_MAX_DEADLINE_S = 7 * 86400.0
#: The longest wait one RetryLater may ask for (a day).
RETRY_LATER_MAX_S = 86400.0
#: A job that says RetryLater this many times fails for good, whatever its deadline (a task that
#: says ``RetryLater(0)`` in a loop must not run forever: each one is a run and a ledger entry).
RETRY_LATER_MAX_TIMES = 10000


class RetryLater(HybridqError):
    """Raised by a task: "what I act on is not committed yet: run me again in ``seconds``".

    The job is delivered again after ``seconds`` (scheduled in the forwarder's durable ledger,
    like a retry), **without using an attempt**: ``current_job().attempt`` stays the same and
    the retry policy's budget is untouched. The worker logs one INFO line, records the run as
    finished in RQ (not failed) and counts no failure. A job that says RetryLater at or past
    ``deadline_s`` after its first RetryLater fails for good with :class:`RetryLaterExpired`
    (the last wait is shortened to end at the deadline, for one last try).

    Args:
        seconds: how long to wait: a finite number from 0 to :data:`RETRY_LATER_MAX_S`.
        reason: what is not ready yet (logged, and kept with a failure at the deadline).
        deadline_s: how long, counted from the job's first RetryLater, it may keep waiting:
            more than 0 and at most :data:`RETRY_LATER_MAX_DEADLINE_S`.

    Raises:
        ValueError: an argument out of range (raised inside the task, it fails the attempt like
            any error of the task's own).
    """

    def __init__(
        self, seconds: float, reason: str = "", *, deadline_s: float = RETRY_LATER_DEADLINE_S
    ) -> None:
        self.seconds = _in_range("seconds", seconds, 0.0, RETRY_LATER_MAX_S, "from 0 to")
        self.deadline_s = _in_range(
            "deadline_s", deadline_s, 0.0, RETRY_LATER_MAX_DEADLINE_S, "more than 0 and at most"
        )
        if self.deadline_s == 0:
            raise ValueError(f"RetryLater: deadline_s must be more than 0, not {deadline_s!r}")
        self.reason = str(reason)
        super().__init__(
            f"not yet, again in {self.seconds:g} s" + (f": {self.reason}" if self.reason else "")
        )


def _in_range(name: str, value: object, low: float, high: float, words: str) -> float:
    """``value`` as a float if it is a finite real number in ``[low, high]``, else ValueError."""
    number = math.nan if isinstance(value, bool) or not isinstance(value, int | float) else value
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"RetryLater: {name} must be a finite number {words} {high:g}, not {value!r:.60}")
    return float(number)


class RetryLaterExpired(HybridqError):
    """A job still said :class:`RetryLater` at its deadline (or too many times): it failed for good."""


class JobFailed(HybridqError):
    """``job.wait()`` on a job that failed for good.

    Attributes:
        job_id: the job's id.
        exc_info: the last line of the error its last run reported (``None`` if none was kept).
    """

    def __init__(self, job_id: str, exc_info: str | None) -> None:
        self.job_id = job_id
        self.exc_info = exc_info
        super().__init__(f"job {job_id} failed" + (f": {exc_info}" if exc_info else ""))


class JobWaitTimeout(HybridqError, TimeoutError):
    """``job.wait(timeout)`` ran out of time before the job finished (it may still run).

    Attributes:
        job_id: the job's id.
        timeout: the seconds waited.
        status: where it stood (``job.status``).
        unattended: its journal, when no forwarder held it at the timeout: the job stays where
            it is until one runs (``None`` when a forwarder held it).
    """

    def __init__(self, job_id: str, timeout: float, status: str, *, unattended: str | None = None) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.status = status
        self.unattended = unattended
        why = (
            f": it is in the journal {unattended}, which no forwarder holds (start "
            f"`hybridq forward --journal {unattended}`; docs/forwarder.md)"
            if unattended is not None
            else ""
        )
        super().__init__(f"job {job_id} still {status} after {timeout:g} s{why}")


class ResultNotKept(HybridqError):
    """The job finished, but the ledger does not hold its result.

    Attributes:
        job_id: the job's id.
        reason: ``too_large`` (its JSON was over the cap: ``size`` bytes), ``not_reported`` (the
            worker that ran it, or the event that reported it, carried no result: an older
            worker, or a success kept from another run of its key).
        size: the size of the result's JSON in bytes, for ``too_large``.
    """

    def __init__(self, job_id: str, reason: str, size: int | None = None) -> None:
        self.job_id = job_id
        self.reason = reason
        self.size = size
        why = f"its JSON is {size} bytes, over the cap" if reason == "too_large" else "no result was reported"
        super().__init__(f"job {job_id} finished, but its result was not kept ({why})")


class UnexpectedCancel(HybridqError):
    """An ``async def`` task ended with an ``asyncio.CancelledError`` no stop or timeout asked for.

    It raised one, or awaited a task or future that something else cancelled. Recorded as the
    task's failure (retried as its policy says), with the ``CancelledError`` as its cause
    (docs/worker.md).
    """


class Cancelled(HybridqError):
    """Raised in a running task whose job was cancelled (``hybridq cancel``, ``job.cancel()``).

    ``current_job().check_cancelled()`` raises it once the worker has seen the request; a task
    that does not look is stopped by the worker after its grace period, by this exception raised
    in its thread (docs/worker.md, "Cancelling a running job"). A run that ends with it records
    the outcome ``cancelled``: no retry, not listed by ``hybridq failed``.
    """
