"""The wire contract between hybridq's processes, which may run on different hosts and versions.

Three messages cross Redis:

* a :class:`Delivery` (forwarder → worker): the single argument of the RQ job whose function is
  :data:`ENTRY_POINT`, as :meth:`Delivery.to_json` makes it and :meth:`Delivery.from_json` reads
  it;
* a :class:`StoredOutcome` (worker → worker): what a run stores under its idempotency key, read
  by the claim and outcome scripts (``hybridq.worker.scripts``) of every later delivery;
* a :class:`CompletionEvent` (worker → forwarder): one entry of the owner's event stream, built
  by :meth:`CompletionEvent.of` (by the workers and by the memory transport's simulated
  worker alike) and checked field by field by :meth:`CompletionEvent.from_json` before it
  reaches the forwarder's ledger. With signing keys a worker adds a MAC to the event
  (``hybridq.signing.sign_event``), which the forwarder checks before it parses the event.

The enums are ``str`` (or ``int``) enums whose values are the very strings (numbers) on the
wire, so the JSON, the Lua scripts' replies and the ledger records are what they were.

This module imports neither redis nor rq nor the journal: every process may import it.
"""

from __future__ import annotations

import enum
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from hybridq.envelope import Envelope
from hybridq.limits import is_int, opt_finite, opt_str, typed

__all__ = [
    "DEFAULT_KEY_TTL_S",
    "DEFAULT_LEASE_S",
    "DELIVERY_VERSION",
    "ENTRY_POINT",
    "RESULT_MAX_BYTES",
    "STARTED",
    "ClaimStatus",
    "CompletionEvent",
    "Delivery",
    "EntryKind",
    "FinishReply",
    "Loc",
    "Outcome",
    "Overwrite",
    "StartedEvent",
    "StoredOutcome",
    "Verdict",
    "host_pid",
]

#: The function of every RQ job the forwarder pushes. RQ imports it by this path from job
#: hashes already in Redis: it never changes.
ENTRY_POINT = "hybridq.worker.execute"
#: The version field of a delivery (``"v"``).
DELIVERY_VERSION = 1
#: How long a worker's claim on an idempotency key lasts without renewal (seconds).
DEFAULT_LEASE_S = 10.0
#: How long an outcome stays stored under its idempotency key (seconds).
DEFAULT_KEY_TTL_S = 86400.0
#: The longest error text an event carries (the last line of the stored traceback).
EVENT_ERROR_CHARS = 500
#: The longest worker name (``host/pid``) an event carries into the ledger.
WORKER_MAX_CHARS = 200
#: The largest result (its JSON, in bytes) a completion event carries, and so the ledger keeps:
#: a larger one is left out, and the event says its size instead (docs/api.md, "Looking a job up").
RESULT_MAX_BYTES = 64 * 1024
#: The largest segment index, offset or attempt number an event may name (a C ``long``).
_MAX_INT = 2**63 - 1

#: Where a job's record is in the journal: ``(writer id, segment index, offset)`` (a requeued
#: job has a new one). Spelled here, not imported, so the wire does not depend on the journal.
Loc = tuple[str, int, int]


class Outcome(enum.StrEnum):
    """How a run ended, as stored under the key, sent in events and kept in the ledger."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    #: Ledger only: a journal record that is not a job (it never reaches a worker).
    INVALID = "invalid"
    #: Stored and sent only: the task raised ``hybridq.RetryLater``; it runs again after a delay,
    #: with no attempt used (the ledger makes it a ``retry`` entry).
    LATER = "later"
    #: The job was cancelled (``hybridq cancel``): it never ran, or its run was stopped.
    CANCELLED = "cancelled"


class EntryKind(enum.StrEnum):
    """The kind of a ledger entry (its ``t`` field)."""

    #: The job finished: succeeded, or failed for good.
    DONE = "done"
    #: The job failed and runs again after a delay.
    RETRY = "retry"
    #: The worker running the job vanished: the next attempt is delivered.
    LOST = "lost"
    #: A job that failed for good was queued again (``hybridq failed requeue``).
    REQUEUED = "requeued"
    #: The forwarder pushed a job with an explicit idempotency key: it owns the key (enqueue-if-absent).
    KEY = "key"
    #: A job whose idempotency key was pending or finished: never pushed, settled (a ``done``
    #: entry with ``dup_of``) with its original's outcome once that one is terminal.
    DUPLICATE = "duplicate"
    #: A cancel was asked for the job (``hybridq cancel``): never delivered again; settled by a
    #: ``done`` entry with the outcome ``cancelled`` (or the outcome its run reported).
    CANCEL = "cancel"


class Verdict(enum.StrEnum):
    """What the backend says about a forwarded job (see ``Transport.probe``)."""

    MISSING = "missing"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ORPHANED = "orphaned"
    STRANDED = "stranded"


class ClaimStatus(enum.IntEnum):
    """The first element of the claim script's reply."""

    #: The lease is this delivery's: run the task.
    CLAIMED = 0
    #: The key holds a success, or a final failure: report it, run nothing (a duplicate).
    SUPPRESSED = 1
    #: This attempt, or a later one, of this job already failed: report that, run nothing.
    STALE = 2
    #: Another delivery holds the lease: wait, then claim again.
    BUSY = 3
    #: The delivery is from before the forwarder's current epoch: run nothing, report nothing.
    FENCED = 4
    #: The job was cancelled (its RQ job hash carries ``hybridq_cancel``): run nothing, report nothing.
    CANCELLED = 5


class FinishReply(enum.IntEnum):
    """The outcome script's reply."""

    #: This run's outcome is stored.
    STORED = 0
    #: An earlier success was kept (this run had lost its lease): the task ran twice.
    KEPT = 1
    #: This run's outcome was already stored (a retry after a lost reply).
    ALREADY_STORED = 2
    #: A later attempt of this job already succeeded: this run's outcome is superseded.
    SUPERSEDED = 3


class Overwrite(enum.Enum):
    """What a push does with a job the backend already holds (the value the push script reads)."""

    #: Nothing: a push is idempotent per job id (the first run of a job).
    NEVER = "0"
    #: Replace a copy of an earlier run (a retry, a redelivery after a lost worker, a requeue);
    #: a push of the run it already holds does nothing, unless RQ ended that run without a
    #: worker ever claiming it (then it is queued again).
    EARLIER = "1"
    #: Replace whatever it holds (it holds a copy no worker will ever take).
    ALWAYS = "2"


@dataclass(frozen=True, slots=True, init=False)
class Delivery:
    """One job to deliver: the envelope plus what the worker needs to report back."""

    envelope: Envelope
    #: The forwarder that owns the job: completion events go to its stream.
    owner: str
    loc: Loc
    #: 1 for the first run; more after a failure (retry) or a lost worker (redelivery).
    attempt: int
    #: What the push does if the backend holds the job already (not sent to the worker).
    overwrite: Overwrite
    #: How long a worker's claim on the idempotency key lasts without renewal (seconds).
    lease_s: float
    #: How long the outcome stays stored under the idempotency key (seconds).
    key_ttl_s: float
    #: The forwarder's epoch generation when it made this delivery: a worker refuses a delivery
    #: older than the generation in the owner's epoch key (Redis brought it back from before
    #: its state was lost or rolled back; see ``Reconciler.check_epoch``).
    gen: int
    #: How many runs of this job vanished (their worker died, or lost its lease) before this
    #: delivery: a pool worker runs such a delivery alone in its process (it may be what kills it).
    lost: int
    #: How many runs of this job said ``RetryLater`` before this delivery. Each such run took an
    #: ``attempt`` number (a run's identity on the wire) but used no attempt: the job's own
    #: attempt is :attr:`job_attempt`.
    later: int
    #: When the first of those said it (the worker's clock): the RetryLater deadline counts from it.
    later_since: float | None
    #: The forwarder takes ``started`` events (:class:`StartedEvent`): the worker's claim adds
    #: one to the owner's stream. An older forwarder does not ask, and gets none.
    report_start: bool

    def __init__(
        self,
        envelope: Envelope,
        owner: str,
        loc: Loc,
        attempt: int = 1,
        *,
        overwrite: Overwrite = Overwrite.NEVER,
        lease_s: float = DEFAULT_LEASE_S,
        key_ttl_s: float = DEFAULT_KEY_TTL_S,
        gen: int = 0,
        lost: int = 0,
        later: int = 0,
        later_since: float | None = None,
        force: bool = False,
        replace: bool = False,
        report_start: bool = False,
    ) -> None:
        """``force`` and ``replace`` are the older spellings of ``overwrite`` EARLIER and ALWAYS."""
        if replace:
            overwrite = Overwrite.ALWAYS
        elif force and overwrite is Overwrite.NEVER:
            overwrite = Overwrite.EARLIER
        for name, value in (
            ("envelope", envelope),
            ("owner", owner),
            ("loc", loc),
            ("attempt", attempt),
            ("overwrite", overwrite),
            ("lease_s", lease_s),
            ("key_ttl_s", key_ttl_s),
            ("gen", gen),
            ("lost", lost),
            ("later", later),
            ("later_since", later_since if later else None),
            ("report_start", report_start),
        ):
            object.__setattr__(self, name, value)

    def to_json(self) -> dict[str, Any]:
        """The single argument of the worker's entry point (:data:`ENTRY_POINT`)."""
        return {
            "v": DELIVERY_VERSION,
            "job": self.envelope.to_dict(),
            "owner": self.owner,
            "loc": list(self.loc),
            "attempt": self.attempt,
            "lease": self.lease_s,
            "key_ttl": self.key_ttl_s,
            "gen": self.gen,
            **({"lost": self.lost} if self.lost else {}),
            **({"later": self.later, "later_since": self.later_since} if self.later else {}),
            **({"report_start": 1} if self.report_start else {}),
        }

    @property
    def job_attempt(self) -> int:
        """The job's attempt: runs that said ``RetryLater`` do not count (``current_job().attempt``)."""
        return max(1, self.attempt - self.later)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Delivery:
        """The delivery :meth:`to_json` made (fields an older forwarder omits take their defaults).

        Raises:
            KeyError, TypeError, ValueError: ``raw`` is not a delivery.
        """
        return cls(
            Envelope.from_dict(raw["job"]),
            str(raw["owner"]),
            cast("Loc", tuple(raw["loc"])),
            int(raw.get("attempt", 1)),
            lease_s=float(raw.get("lease", DEFAULT_LEASE_S)),
            key_ttl_s=float(raw.get("key_ttl", DEFAULT_KEY_TTL_S)),
            gen=int(raw.get("gen", 0)),
            lost=int(raw.get("lost", 0)),
            later=int(raw.get("later", 0)),
            later_since=opt_finite("later_since", raw.get("later_since")),
            report_start=bool(raw.get("report_start", False)),
        )


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
        body: dict[str, Any] = {
            "outcome": self.outcome.value,
            "result": self.result,
            "error": self.error,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "requeue": self.requeue,
            "final": self.final,
            "at": self.at,
        }
        if self.token is not None:
            body["token"] = self.token
        if self.outcome is Outcome.LATER:
            body.update(retry_delay=self.retry_delay, later=self.later, later_since=self.later_since)
        return body

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
        env = delivery.envelope
        final = bool(outcome.get("final", True))
        attempt = int(outcome.get("attempt", delivery.attempt))
        error = outcome.get("error")
        later = int(outcome.get("later", delivery.later))
        if outcome.get("outcome") == Outcome.LATER:
            retry_delay = outcome.get("retry_delay")
        else:  # the policy's delay after the job's attempt (runs that said RetryLater are not one)
            retry_delay = None if final or env.retry is None else env.retry.delay_s(attempt - delivery.later)
        return cls(
            id=env.id,
            loc=delivery.loc,
            queue=env.queue,
            outcome=outcome.get("outcome"),
            final=final,
            retry_delay=retry_delay,
            attempt=attempt,
            dup=dup,
            error=error.strip().rsplit("\n", 1)[-1][:EVENT_ERROR_CHARS] if isinstance(error, str) else None,
            at=at,
            later=later,
            later_since=outcome.get("later_since", delivery.later_since) if later else None,
            started=started,
            worker=worker,
            gen=delivery.gen,
            **_carried(outcome, result_json),
        )

    def to_json(self) -> dict[str, Any]:
        """The event's JSON object (the stream entry's ``e`` field holds it, encoded)."""
        return {
            "id": self.id,
            "loc": list(self.loc),
            "queue": self.queue,
            "outcome": self.outcome,
            "final": self.final,
            "retry_delay": self.retry_delay,
            "attempt": self.attempt,
            "dup": self.dup,
            "error": self.error,
            "at": self.at,
            **({"later": self.later, "later_since": self.later_since} if self.later else {}),
            **({"result": self.result} if self.result_kept else {}),
            **({"result_bytes": self.result_bytes} if self.result_bytes is not None else {}),
            **({"started": self.started} if self.started is not None else {}),
            **({"worker": self.worker} if self.worker is not None else {}),
            **({"gen": self.gen} if self.gen else {}),
        }

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
        if body is None:
            raise ValueError("not JSON")
        writer, segment, offset = typed("loc", body["loc"], list)
        loc: Loc = (
            typed("loc writer", writer, str),
            _count("loc segment", segment),
            _count("loc offset", offset),
        )
        # In the order the forwarder always checked them: the first bad field is the one named.
        outcome, final = str(body["outcome"]), bool(body.get("final", True))
        retry_delay = opt_finite("retry_delay", body.get("retry_delay"))
        at = opt_finite("at", body.get("at"))
        return cls(
            id=typed("id", body["id"], str),
            loc=loc,
            outcome=outcome,
            final=final,
            retry_delay=retry_delay,
            attempt=_count("attempt", body.get("attempt", 1)),
            dup=bool(body.get("dup", False)),
            error=opt_str("error", body.get("error")),
            at=at,
            queue=opt_str("queue", body.get("queue")),
            later=_count("later", body.get("later", 0)),
            later_since=opt_finite("later_since", body.get("later_since")),
            result=body.get("result"),
            result_kept="result" in body and outcome == Outcome.SUCCEEDED,
            result_bytes=_count("result_bytes", body["result_bytes"]) if "result_bytes" in body else None,
            started=opt_finite("started", body.get("started")),
            worker=_worker(body.get("worker")),
            gen=_count("gen", body.get("gen", 0)),
        )

    @property
    def terminal(self) -> bool:
        """The job is done: it succeeded, or failed for good."""
        return self.outcome == Outcome.SUCCEEDED or self.final


def _carried(outcome: Mapping[str, Any], result_json: str | None) -> dict[str, Any]:
    """The result fields of an event reporting ``outcome``: the result if it is small enough."""
    if outcome.get("outcome") != Outcome.SUCCEEDED or "result" not in outcome:
        return {}
    value = outcome["result"]
    if result_json is None:
        try:
            result_json = json.dumps(value)
        except (TypeError, ValueError):
            return {}
    size = len(result_json.encode()) if not result_json.isascii() else len(result_json)
    if size > RESULT_MAX_BYTES:
        return {"result_bytes": size}
    return {"result": value, "result_kept": True}


def _worker(value: object) -> str | None:
    """An event's ``worker`` (``host/pid``), cut to a sane length: it is only shown, never parsed."""
    worker = opt_str("worker", value)
    return None if worker is None else worker[:WORKER_MAX_CHARS]


def _count(name: str, value: object) -> int:
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
        )


_HOST_PID: list[str] = []


def host_pid() -> str:
    """``host/pid`` of this process: how lease tokens and completion events name a worker.

    Looked up once per process (again after a fork: ``os.getpid()`` is a system call, and this
    is asked a few times per job).
    """
    if not _HOST_PID:
        _HOST_PID.append(f"{socket.gethostname()}/{os.getpid()}")
    return _HOST_PID[0]


def _forget_host_pid() -> None:
    _HOST_PID.clear()


os.register_at_fork(after_in_child=_forget_host_pid)
