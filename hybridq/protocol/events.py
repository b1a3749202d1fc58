"""The events a worker adds to the owning forwarder's stream (part of :mod:`hybridq.protocol`).

* a :class:`CompletionEvent` (worker → forwarder): one delivery's outcome, built by
  :meth:`CompletionEvent.of` (by the workers and by the memory transport's simulated worker
  alike) and checked field by field by :meth:`CompletionEvent.from_json` before it reaches the
  forwarder's ledger;
* a :class:`StartedEvent`: a worker claimed a delivery's run (only when the delivery asks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridq.envelope.limits import is_int, opt_finite, opt_str, typed
from hybridq.protocol.delivery import Delivery, Loc
from hybridq.protocol.enums import Outcome
from hybridq.protocol.event_json import EVENT_ERROR_CHARS, RESULT_MAX_BYTES, body, fields_of

__all__ = [
    "EVENT_ERROR_CHARS",
    "RESULT_MAX_BYTES",
    "STARTED",
    "WORKER_MAX_CHARS",
    "CompletionEvent",
    "EventFields",
    "StartedEvent",
]

#: The longest worker name (``host/pid``) an event carries into the ledger.
WORKER_MAX_CHARS = 200
#: The largest segment index, offset or attempt number an event may name (a C ``long``).
_MAX_INT = 2**63 - 1

#: Enum members read on every job as module constants: on Python 3.11 a read from the class
#: goes through ``EnumType``'s ``__getattr__`` hook, about 900 instructions (docs/benchmarks.md,
#: "The forwarder's writes per job, again").
_SUCCEEDED = Outcome.SUCCEEDED


#: :meth:`CompletionEvent.checked`: an event's fields, in :class:`CompletionEvent`'s order.
EventFields = tuple[
    str,
    Loc,
    str | None,
    str,
    bool,
    float | None,
    int,
    bool,
    str | None,
    float | None,
    int,
    float | None,
    Any,
    bool,
    int | None,
    float | None,
    str | None,
    int,
]


@dataclass(frozen=True, slots=True)
class CompletionEvent:
    """A worker's report of one delivery's outcome, sent to the owning forwarder's stream."""

    id: str
    loc: Loc
    queue: str | None
    #: ``succeeded`` or ``failed`` (an :class:`Outcome`; kept as sent).
    outcome: str | None
    #: No further attempt follows.
    final: bool
    #: Seconds until the next attempt of a non-final failure: a delay, not a time, as the
    #: forwarder adds it to its own clock (hosts' clocks may differ).
    retry_delay: float | None
    attempt: int
    #: The key's stored outcome reported for a duplicate delivery (the task did not run).
    dup: bool
    #: The last line of the error, at most :data:`EVENT_ERROR_CHARS` characters.
    error: str | None
    #: When the worker sent it; ``None`` if the event does not say (the forwarder's clock then).
    at: float | None
    #: How many runs of the job said ``RetryLater`` so far (this one included if its outcome is
    #: ``later``), and when the first did: the next delivery carries them (see Delivery.later).
    later: int = 0
    later_since: float | None = None
    #: A success's return value (JSON), if carried (:attr:`result_kept`): a newer worker sends
    #: it when its JSON is at most :data:`RESULT_MAX_BYTES`; an older one never does.
    result: Any = None
    result_kept: bool = False
    #: The size of a result's JSON that was too large to carry (bytes); ``None`` otherwise.
    result_bytes: int | None = None
    #: When the run started (the worker's clock); ``None`` if not said (a duplicate, an older worker).
    started: float | None = None
    #: The worker process that sent it (``host/pid``); ``None`` if not said (an older worker).
    worker: str | None = None
    #: The epoch generation the delivery was pushed under (:attr:`Delivery.gen`; 0: left out).
    gen: int = 0

    @classmethod
    def of(
        cls,
        delivery: Delivery,
        outcome: Mapping[str, Any],
        *,
        dup: bool,
        at: float,
        result_json: str | None = None,
        started: float | None = None,
        worker: str | None = None,
    ) -> CompletionEvent:
        """The event reporting ``outcome`` (a stored outcome's JSON, or a refusal) for ``delivery``.

        ``result_json``: the stored result's JSON text when the caller made it already (its size
        decides whether the event carries the result); ``started``: when the task started;
        ``worker``: the reporting worker process (``host/pid``).
        """
        return cls(*fields_of(delivery, outcome, dup, at, result_json, started, worker))

    @staticmethod
    def json_of(
        delivery: Delivery,
        outcome: Mapping[str, Any],
        *,
        dup: bool,
        at: float,
        result_json: str | None = None,
        started: float | None = None,
        worker: str | None = None,
    ) -> dict[str, Any]:
        """``of(...).to_json()`` without the event: a pool worker sends only its JSON.

        Making the frozen event cost about 2 us of the 4 its JSON took per job
        (docs/benchmarks.md, "The pool's Python per job").
        """
        return body(*fields_of(delivery, outcome, dup, at, result_json, started, worker))

    def to_json(self) -> dict[str, Any]:
        """The event's JSON object (the stream entry's ``e`` field holds it, encoded)."""
        return body(
            self.id,
            self.loc,
            self.queue,
            self.outcome,
            self.final,
            self.retry_delay,
            self.attempt,
            self.dup,
            self.error,
            self.at,
            self.later,
            self.later_since,
            self.result,
            self.result_kept,
            self.result_bytes,
            self.started,
            self.worker,
            self.gen,
        )

    def kept_success_json(self) -> dict[str, Any]:
        """What the outcome script makes of this event when it keeps an earlier success.

        The script sets ``outcome`` and ``final`` and drops ``error``, ``retry_delay`` and
        ``result`` (Lua's ``nil``: the kept success is another run's, whose own event reported
        its result); with signing keys the worker sends this version, signed, with the script.
        """
        body = self.to_json()
        del body["error"], body["retry_delay"]
        body.pop("result", None)
        return {**body, "outcome": Outcome.SUCCEEDED.value, "final": True}

    @classmethod
    def from_json(cls, body: Mapping[str, Any] | None) -> CompletionEvent:
        """The event ``body`` holds, every field checked for type and range.

        Anyone who can write to Redis can add an event to a stream: a number that does not fit
        (``10**400``, ``Infinity``) or a field of the wrong type raises, so that the forwarder
        drops the event instead of stopping on it. Fields it does not know (the MAC) are ignored.

        Raises:
            ValueError, TypeError, KeyError: the event is garbled (not JSON, a field missing, of the
                wrong type or out of range).
        """
        return cls(*cls.checked(body))

    @staticmethod
    def checked(body: Mapping[str, Any] | None) -> EventFields:
        """:meth:`from_json`'s fields, checked the same way, in the class's order, without the event.

        The forwarder's harvest makes its ledger entry from them (one per harvested event:
        making a frozen event first, only to copy it, was a tenth of the harvest's CPU).

        Raises:
            ValueError, TypeError, KeyError: as :meth:`from_json`.
        """
        if body is None:
            raise ValueError("not JSON")
        # Each check's usual case (an exact str, an int in range, a finite float or None) is
        # tested here and the check called only for the others: the calls were 3.8k of this
        # method's 25.5k instructions, one call of it per harvested event (docs/benchmarks.md,
        # "The forwarder's decoding per job").
        writer, segment, offset = typed("loc", body["loc"], list)
        if type(writer) is not str:
            writer = typed("loc writer", writer, str)
        if type(segment) is not int or not 0 <= segment <= _MAX_INT:
            segment = _count("loc segment", segment)
        if type(offset) is not int or not 0 <= offset <= _MAX_INT:
            offset = _count("loc offset", offset)
        loc: Loc = (writer, segment, offset)
        # In the order the forwarder always checked them: the first bad field is the one named.
        outcome, final = str(body["outcome"]), bool(body.get("final", True))
        retry_delay = body.get("retry_delay")
        if retry_delay is not None and (type(retry_delay) is not float or retry_delay - retry_delay != 0.0):
            retry_delay = opt_finite("retry_delay", retry_delay)
        at = body.get("at")
        if at is not None and (type(at) is not float or at - at != 0.0):
            at = opt_finite("at", at)
        job_id = body["id"]
        if type(job_id) is not str:
            job_id = typed("id", job_id, str)
        attempt = body.get("attempt", 1)
        if type(attempt) is not int or not 0 <= attempt <= _MAX_INT:
            attempt = _count("attempt", attempt)
        dup = bool(body.get("dup", False))
        error = body.get("error")
        if error is not None and type(error) is not str:
            error = opt_str("error", error)
        queue = body.get("queue")
        if queue is not None and type(queue) is not str:
            queue = opt_str("queue", queue)
        later = _count("later", body.get("later", 0))
        later_since = opt_finite("later_since", body.get("later_since"))
        result_kept = "result" in body and outcome == _SUCCEEDED
        result_bytes = _count("result_bytes", body["result_bytes"]) if "result_bytes" in body else None
        started = body.get("started")
        if started is not None and (type(started) is not float or started - started != 0.0):
            started = opt_finite("started", started)
        worker = _worker(body.get("worker"))
        gen = _count("gen", body.get("gen", 0))
        return (
            job_id,
            loc,
            queue,
            outcome,
            final,
            retry_delay,
            attempt,
            dup,
            error,
            at,
            later,
            later_since,
            body.get("result"),
            result_kept,
            result_bytes,
            started,
            worker,
            gen,
        )

    @property
    def terminal(self) -> bool:
        """The job is done: it succeeded, or failed for good."""
        return self.outcome == Outcome.SUCCEEDED or self.final


def _worker(value: object) -> str | None:
    """An event's ``worker`` (``host/pid``), cut to a sane length: it is only shown, never parsed."""
    worker = opt_str("worker", value)
    return None if worker is None else worker[:WORKER_MAX_CHARS]


def _count(name: str, value: object) -> int:
    if type(value) is int and 0 <= value <= _MAX_INT:  # the usual case, without is_int's call
        return value
    if not is_int(value) or not 0 <= value <= _MAX_INT:  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer from 0 to 2**63-1, not {value!r:.60}")
    return value  # type: ignore[return-value]


#: The ``kind`` of a :class:`StartedEvent` (a completion event has no ``kind``).
STARTED = "started"


@dataclass(frozen=True, slots=True)
class StartedEvent:
    """A worker claimed a delivery's run: sent by the claim script, to the owner's stream.

    Only when the delivery asks (:attr:`Delivery.report_start`). It carries no ``outcome``: a
    forwarder that does not know it drops it as garbled (``CompletionEvent.from_json`` needs an
    outcome), so it can never reach an older ledger as an outcome. The forwarder passes it to
    its lookup index only (``job.status`` ``started``): it changes no outcome, counts as none,
    and a lost one means the job reads ``forwarded`` until it ends.
    """

    id: str
    loc: Loc
    #: The run's attempt (as a completion event's), and the RetryLater runs before it.
    attempt: int
    later: int
    #: When the worker claimed the run (its clock).
    at: float
    #: The claim refused the run (its limit key had no room): the variant the claim script adds
    #: instead, with the why in the stream entry's ``r`` field. Inside the event, so signing
    #: covers it (``r`` is not signed: the forwarder believes it only with signing off).
    refused: bool = False

    @classmethod
    def of(cls, delivery: Delivery, at: float) -> StartedEvent:
        """The event of ``delivery``'s run claimed at ``at``."""
        return cls(delivery.envelope.id, delivery.loc, delivery.attempt, delivery.later, at)

    @property
    def job_attempt(self) -> int:
        """The job's attempt (``job.attempt``): runs that said ``RetryLater`` do not count."""
        return max(1, self.attempt - self.later)

    def to_json(self) -> dict[str, Any]:
        """The event's JSON object (the stream entry's ``e`` field, as a completion event's)."""
        body: dict[str, Any] = {
            "kind": STARTED,
            "id": self.id,
            "loc": list(self.loc),
            "attempt": self.attempt,
        }
        if self.later:
            body["later"] = self.later
        body["at"] = self.at
        if self.refused:
            body["refused"] = True
        return body

    @staticmethod
    def is_one(body: Mapping[str, Any] | None) -> bool:
        """Whether a stream entry's body is a started event (not a completion event)."""
        return body is not None and body.get("kind") == STARTED

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> StartedEvent:
        """The event ``body`` holds, checked as :meth:`CompletionEvent.from_json` checks.

        Raises:
            ValueError, TypeError, KeyError: the event is garbled.
        """
        writer, segment, offset = typed("loc", body["loc"], list)
        at = opt_finite("at", body.get("at"))
        if at is None:
            raise ValueError("a started event needs its time")
        return cls(
            id=typed("id", body["id"], str),
            loc=(
                typed("loc writer", writer, str),
                _count("loc segment", segment),
                _count("loc offset", offset),
            ),
            attempt=_count("attempt", body.get("attempt", 1)),
            later=_count("later", body.get("later", 0)),
            at=at,
            refused=body.get("refused") is True,
        )
