"""The stored outcome, worker → worker (part of :mod:`hybridq.protocol`).

A :class:`StoredOutcome` is what a run stores under its idempotency key, read by the claim and
outcome scripts (``hybridq.worker.scripts``) of every later delivery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hybridq.envelope.limits import opt_finite, opt_str, typed
from hybridq.protocol.enums import Outcome

__all__ = ["DECODE_STORED_LUA", "StoredOutcome"]

#: Enum members read on every job as module constants: on Python 3.11 a read from the class
#: goes through ``EnumType``'s ``__getattr__`` hook, about 900 instructions (docs/benchmarks.md,
#: "The forwarder's writes per job, again").
_LATER = Outcome.LATER

# The Lua function every script that reads a stored outcome (or an event, or this run's outcome)
# decodes it with: ``ok, value`` as ``pcall(cjson.decode, s)`` gives, ``ok`` false unless the
# value is a JSON object. Python's ``json.dumps`` writes a lone surrogate (``os.fsdecode`` of a
# file name that is not UTF-8 gives one) as the escape ``\udcff``: valid JSON, which Redis's
# cjson refuses. Such escapes (and, harmlessly, pairs) are read as U+FFFD, only in the copy the
# script reads: they can only be in the result or the error, which no script looks into, and the
# text stored and sent on is untouched (issue 26, item 4). A value still unreadable (not JSON at
# all: not written by hybridq) must never count as "nothing stored" in the caller.
DECODE_STORED_LUA = r"""
local function decode_stored(text)
    local ok, value = pcall(cjson.decode, text)
    if not ok then
        ok, value = pcall(cjson.decode, (string.gsub(text, "\\u[dD][89a-fA-F]%x%x", "\\ufffd")))
    end
    return ok and type(value) == "table", value
end
"""


@dataclass(frozen=True, slots=True)
class StoredOutcome:
    """What a run stores under its idempotency key (read back by the claim and outcome scripts)."""

    outcome: Outcome
    #: The task's return value (JSON), ``None`` for a failure.
    result: Any
    #: The traceback of a failure.
    error: str | None
    job_id: str
    attempt: int
    requeue: int
    #: No further attempt follows: a success, or the last attempt's failure.
    final: bool
    at: float
    #: The lease value of the run, so that a retried outcome script knows its first try got
    #: through; ``None`` (left out) where no lease was taken (the memory transport).
    token: str | None = None
    #: A ``later`` outcome's wait (seconds), its RetryLater count (this one included) and when
    #: the first was said: the event reports them (left out of other outcomes).
    retry_delay: float | None = None
    later: int = 0
    later_since: float | None = None

    def cancelled(self) -> StoredOutcome:
        """This outcome as a cancelled run's: ``cancelled``, final (no retry)."""
        return replace(self, outcome=Outcome.CANCELLED, final=True)

    def to_json(self) -> dict[str, Any]:
        """The stored JSON object."""
        body = _body(
            self.outcome,
            self.result,
            self.error,
            self.job_id,
            self.attempt,
            self.requeue,
            self.final,
            self.at,
            self.token,
        )
        if self.outcome is Outcome.LATER:
            body.update(retry_delay=self.retry_delay, later=self.later, later_since=self.later_since)
        return body

    @staticmethod
    def json_of(
        outcome: Outcome,
        result: Any,
        error: str | None,
        job_id: str,
        attempt: int,
        requeue: int,
        final: bool,
        at: float,
        token: str | None = None,
    ) -> dict[str, Any]:
        """``StoredOutcome(...).to_json()`` of a run that succeeded or failed, without the outcome.

        A pool worker needs only the JSON of most runs' outcomes; making the frozen outcome cost
        about 3 us a job (docs/benchmarks.md, "The pool's Python per job"). Not for ``later``
        (its fields are not here).
        """
        if outcome is _LATER:
            raise ValueError("a later outcome's JSON needs its wait: make the StoredOutcome")
        return _body(outcome, result, error, job_id, attempt, requeue, final, at, token)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> StoredOutcome:
        """The outcome :meth:`to_json` stored.

        Raises:
            KeyError, TypeError, ValueError: ``body`` is not a stored outcome.
        """
        return cls(
            Outcome(body["outcome"]),
            body.get("result"),
            opt_str("error", body.get("error")),
            typed("job_id", body["job_id"], str),
            int(body["attempt"]),
            int(body.get("requeue", 0)),
            bool(body["final"]),
            float(body["at"]),
            opt_str("token", body.get("token")),
            opt_finite("retry_delay", body.get("retry_delay")),
            int(body.get("later", 0)),
            opt_finite("later_since", body.get("later_since")),
        )


def _body(
    outcome: Outcome,
    result: Any,
    error: str | None,
    job_id: str,
    attempt: int,
    requeue: int,
    final: bool,
    at: float,
    token: str | None,
) -> dict[str, Any]:
    """An outcome's stored JSON object, a ``later`` one's own fields left out (``to_json``)."""
    body: dict[str, Any] = {
        "outcome": outcome.value,
        "result": result,
        "error": error,
        "job_id": job_id,
        "attempt": attempt,
        "requeue": requeue,
        "final": final,
        "at": at,
    }
    if token is not None:
        body["token"] = token
    return body
