""":class:`RemoteJob`: the :class:`~hybridq.Job` a remote queue returns, read over HTTP.

Every property asks the node that holds the job (``GET /v1/jobs/{id}``: its journal, ledger and
lookup index, never Redis), so it says what :class:`~hybridq.Job` says on that node's host.
:meth:`RemoteJob.wait` polls the same (10 ms at first, backing off to 250 ms); a node that does
not answer raises :class:`~hybridq.errors.NodeUnavailable`, never "no such job".
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Generator
from typing import Any

from hybridq.client.remote import RemoteClient
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import decode
from hybridq.errors import HybridqError, JobFailed, JobWaitTimeout, ResultNotKept
from hybridq.job import Job
from hybridq.journal import RecordId

__all__ = ["RemoteJob"]

#: What stands for the record of a job held by another host's journal.
_ELSEWHERE = RecordId("", -1)
#: Statuses of a job that has not ended (:attr:`hybridq.Job.status`).
_PENDING = frozenset({"queued", "scheduled", "forwarded", "retrying", "started"})
#: :meth:`RemoteJob.wait`'s polls: the first after this long, doubling up to the most.
_POLL_FIRST_S, _POLL_MOST_S = 0.01, 0.25


class RemoteJob(Job):
    """A job an ingest node holds (see the module docstring).

    ``envelope`` is the call as this process made it, under the node's id (for a job found by
    id: its task and queue only); ``journal`` is ``""`` and ``record`` stands for nothing here.
    ``idempotency_key`` is the key sent (the node scopes it to the token: docs/http.md).
    """

    __slots__ = ("_client",)

    def __init__(self, envelope: Envelope, client: RemoteClient) -> None:
        super().__init__(envelope, _ELSEWHERE, "")
        self._client = client

    @classmethod
    def found(cls, state: dict[str, Any], client: RemoteClient) -> RemoteJob:
        """The job of a ``GET /v1/jobs/{id}`` answer."""
        job_id = state.get("id")
        if not isinstance(job_id, str):
            raise _not_a_state("id")
        env = Envelope(
            job_id,
            str(state.get("task") or ""),
            str(state.get("queue") or ""),
            job_id,
            _time(state, "enqueued_at") or 0.0,
        )
        return cls(env, client)

    def _state(self) -> dict[str, Any]:
        state = self._client.state(self.id)
        if state is None:  # the node's journal lost it (deleted, restored from an old copy)
            return {"status": "unknown"}
        return state

    def get_status(self) -> str:
        """:attr:`status`, as the node that holds the job reads it."""
        return self.status

    @property
    def status(self) -> str:
        """``queued``, ``scheduled``, ``forwarded``, ``started``, ``retrying``, ``merged``, ``finished``...

        ... or ``failed`` (:attr:`hybridq.Job.status` on the node's host).
        """
        return str(self._state().get("status", "unknown"))

    @property
    def duplicate_of(self) -> str | None:
        """Not known over HTTP: always ``None``."""
        return None

    @property
    def attempt(self) -> int:
        """The attempt of its latest run reported; 0 before."""
        attempt = self._state().get("attempt") or 0
        if not isinstance(attempt, int) or isinstance(attempt, bool):
            raise _not_a_state("attempt")
        return attempt

    @property
    def result(self) -> Any:
        """The task's return value once it finished; ``None`` before (ResultNotKept if not kept)."""
        return _result(self.id, self._state())

    @property
    def exc_info(self) -> str | None:
        """The last line of its last failed run's traceback; ``None`` if none."""
        error = self._state().get("error")
        return None if error is None else str(error)

    @property
    def started_at(self) -> float | None:
        """When its latest reported run started (the worker's clock)."""
        return _time(self._state(), "started_at")

    @property
    def ended_at(self) -> float | None:
        """When it ended (the worker's clock); ``None`` before."""
        return _time(self._state(), "ended_at")

    def cancel(self) -> str:
        """Cancel it on its node (``POST /v1/jobs/{id}/cancel``): what :func:`hybridq.cancel` said."""
        return self._client.cancel(self.id)

    def __repr__(self) -> str:
        return f"<hybridq.RemoteJob {self.id} {self.envelope.func} queue={self.queue!r}>"

    def _pauses(self, timeout: float | None) -> Generator[float, None, Any]:
        """:meth:`hybridq.Job.wait`'s polls, over HTTP: one ``GET`` a look."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = _POLL_FIRST_S
        while True:
            state = self._state()
            status = str(state.get("status", "unknown"))
            if status not in _PENDING:
                return _ended(self, status, state)
            if deadline is not None and time.monotonic() >= deadline:
                raise JobWaitTimeout(self.id, timeout or 0.0, status)
            yield delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic()))
            delay = min(_POLL_MOST_S, delay * 2)


def _not_a_state(field: str) -> HybridqError:
    """The one-line error for a node's answer whose ``field`` a job's state cannot have."""
    return HybridqError(f"the node's answer is not a job's state (its {field!r}): a node of another version?")


def _time(state: dict[str, Any], field: str) -> float | None:
    """A time of the state (Unix seconds), ``None`` if absent; HybridqError if not a finite number."""
    value = state.get(field)
    if value is None:
        return None
    number = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int past a float's range
            number = float(value)
    if number is None or not math.isfinite(number):
        raise _not_a_state(field)
    return number


def _result(job_id: str, state: dict[str, Any]) -> Any:
    if state.get("status") != "finished":
        return None
    reason = state.get("result_not_kept")
    if reason is not None:
        raise ResultNotKept(job_id, str(reason))
    return decode(state.get("result"), strict=False)  # the node answers it tagged (docs/http.md)


def _ended(job: RemoteJob, status: str, state: dict[str, Any]) -> Any:
    """:meth:`hybridq.Job._ended` on a state already read (no second request)."""
    if status == "finished":
        return _result(job.id, state)
    if status == "merged":
        raise JobFailed(job.id, "merged: another job with this id and a different call ran instead")
    error = state.get("error")
    raise JobFailed(job.id, str(error) if error is not None else status)
