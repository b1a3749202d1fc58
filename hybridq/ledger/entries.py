"""The ledger's entry format: one :class:`Entry` per record, its JSON encoding, and events as entries.

The ledger (:mod:`hybridq.ledger.store`) is a second journal; its records are JSON objects with a kind
``t``:

* ``done`` -- the job at ``loc`` reached a terminal outcome (``succeeded``, ``failed`` out of
  attempts, or ``invalid``: a record that is not a job); ``dup`` marks a delivery that found the
  outcome already stored under its idempotency key and did not run the task.
* ``retry`` -- attempt ``attempt`` failed; the forwarder delivers attempt + 1 at ``run_at``. With
  ``lt`` (the job's RetryLaters so far) and ``ls`` (when the first was said), the run said
  ``RetryLater`` instead, or came after one: ``attempt`` numbers runs, and the job's own attempt
  is ``attempt - lt`` (a RetryLater uses none). ``done`` and ``retry`` entries name the worker
  process that ran the attempt (``w``, ``host/pid``), when it started (``st``) and the epoch
  generation its delivery was pushed under (``g``, left out while 0), where the event said
  (older records lack them).
* ``lost`` -- the worker running attempt ``attempt`` vanished (lease expired); delivered again.
* ``requeued`` -- a failed job was accepted again (under a new loc); it leaves the failed list.
* ``key`` -- the forwarder pushed (or held) the job at ``loc``, which has an explicit idempotency
  key ``k`` (its hash): the job owns the key, so a later job with the key is not pushed
  (docs/enqueue.md, "Enqueue-if-absent"). When the ledger segment holding it goes, the entry
  moves, with its outcome and the end of its window (``until``), to the **key store**
  (``<journal>/keys/``, the same format), which only the forwarder reads, when it starts.
* ``duplicate`` -- the job at ``loc`` has a key that a pending or finished job owns: never pushed.
  ``ol`` is that owner's position (entries written before it was added lack it). Once the owner
  is terminal, a ``done`` entry with ``dup_of`` (the owner's job id) settles it with the owner's
  outcome.
* ``cancel`` -- a cancel was asked for the job at ``loc`` (:mod:`hybridq.cancels`): it is never
  delivered again; a ``done`` entry with the outcome ``cancelled`` settles it (or the outcome its
  run reported, if it was running). Outcomes of one job rank ``succeeded`` > ``failed`` >
  ``cancelled``, whatever order they are read in: what a run really did beats the cancel.

A ``done`` entry that ``succeeded`` carries ``over`` (``"over":"failed"``) when the forwarder
wrote it for a job it had recorded ``failed`` (a lost worker given up on, that reported after
all): once the job's journal segment is compacted, that success is a mark that keeps the
failure off the list in any replay order (docs/reliability.md, "A success outranks a failure").

This module must not import redis or rq.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _str
from math import isfinite
from typing import Any

from hybridq.envelope.limits import finite
from hybridq.journal.records import Loc
from hybridq.protocol import CompletionEvent, EntryKind, Outcome

#: A journal segment, as an entry's ``loc`` names it: (writer id, segment index).
Seg = tuple[str, int]
_encode = json.JSONEncoder(separators=(",", ":")).encode
#: Members read per harvested event, as module constants (Python 3.11 reads one from its class
#: through ``EnumType``'s ``__getattr__`` hook, about 900 instructions; docs/benchmarks.md, "The
#: forwarder's writes per job, again").
_SUCCEEDED = Outcome.SUCCEEDED
_DONE, _RETRY = EntryKind.DONE, EntryKind.RETRY


@dataclass(slots=True, unsafe_hash=True)
class Entry:
    """One ledger record. Treat it as immutable (use ``dataclasses.replace``); hashed as a frozen one.

    Not ``frozen``: a frozen dataclass's ``__init__`` sets each of its 26 fields through
    ``object.__setattr__``, about 45,000 instructions an entry against 12,000 (the harvest makes
    one per completion event: docs/benchmarks.md, "The forwarder's JSON per job").
    """

    kind: str  # an EntryKind: "done" | "retry" | "lost" | "requeued" | "key" | "duplicate" | "cancel"
    job_id: str
    loc: Loc
    outcome: str | None = None
    attempt: int = 1
    dup: bool = False
    error: str | None = None
    run_at: float | None = None
    at: float = 0.0
    queue: str | None = None
    #: The harvested event's id (a re-harvest after a crash is not counted twice).
    event_id: str | None = None
    #: The envelope of a job that failed for good, so it can be requeued after compaction.
    job: Mapping[str, Any] | None = None
    #: The job's RetryLaters so far (its runs that used no attempt), and when the first was said.
    later: int = 0
    later_since: float | None = None
    #: ``key`` and ``duplicate`` entries: the hash of the job's idempotency key (Envelope.key_id).
    key: str | None = None
    #: ``duplicate`` entries, and ``done`` entries settling one: the job id of the key's owner.
    dup_of: str | None = None
    #: ``duplicate`` entries: the position of the key's owner when the duplicate was admitted
    #: (``ol``), the job it follows (docs/enqueue.md); entries before issue 29's fix lack it.
    owner_loc: Loc | None = None
    #: ``key`` entries of a job whose segment is compacted: when the key may be forgotten.
    until: float | None = None
    #: ``done`` entries of a success: its return value, if the event carried it (``result_kept``),
    #: or the size of a result too large to carry (``result_bytes``); when the run started.
    result: Any = None
    result_kept: bool = False
    result_bytes: int | None = None
    started: float | None = None
    #: ``done`` and ``retry`` entries: the worker process that ran (or reported) the attempt
    #: (``host/pid``), if its event said (``w``; older records have none).
    worker: str | None = None
    #: ``done`` and ``retry`` entries: the epoch generation the run's delivery was pushed under
    #: (``g``, left out while 0): a higher one than an earlier run's means Redis lost its state.
    gen: int = 0
    #: ``done`` entries that succeeded: the outcome recorded before that this one outranks
    #: (``over``, only ``failed`` today; entries before it was added lack it).
    over: str | None = None
    #: ``done`` entries that failed: the outcome recorded before that outranks this one
    #: (``under``, only ``succeeded``): a failure reported after the job's success, never listed.
    under: str | None = None

    def to_bytes(self) -> bytes:
        """Compact JSON, ``None`` fields left out (an outcome's entry written out: :meth:`_outcome_text`)."""
        text = self._outcome_text()
        return (_encode(self._body()) if text is None else text).encode()

    def _outcome_text(self) -> str | None:
        """``_encode(self._body())`` of a ``done`` or ``retry`` entry as a harvest makes it, written out.

        The forwarder encodes one entry per completion event: the dict and the encoder's walk of
        it cost about 57,000 instructions, this about 39,000 (docs/benchmarks.md, "The
        forwarder's JSON per job"), 15,000 of it the two times' ``repr``. The same text
        (``tests/unit/test_ledger_entry_text.py``); ``None`` for an entry with any other field,
        or a field of a type the encoder writes otherwise (a float that is not finite, an int
        subclass), which then takes the encoder.
        """
        if (
            self.job is not None
            or self.key is not None
            or self.dup_of is not None
            or self.owner_loc is not None
            or self.until is not None
            or self.later
            or self.over is not None
            or self.under is not None
        ):
            return None
        kind, job_id, (chain, seg, off), attempt, at = self.kind, self.job_id, self.loc, self.attempt, self.at
        if not (
            isinstance(kind, str)
            and isinstance(job_id, str)
            and isinstance(chain, str)
            and type(seg) is int
            and type(off) is int
            and type(attempt) is int
            and type(at) is float
            and isfinite(at)
        ):
            return None
        outcome, error, run_at, queue, event_id = (
            self.outcome,
            self.error,
            self.run_at,
            self.queue,
            self.event_id,
        )
        started, worker, result_bytes, gen = self.started, self.worker, self.result_bytes, self.gen
        if (
            (outcome is not None and not isinstance(outcome, str))
            or (error is not None and not isinstance(error, str))
            or (run_at is not None and (type(run_at) is not float or not isfinite(run_at)))
            or (queue is not None and not isinstance(queue, str))
            or (event_id is not None and not isinstance(event_id, str))
            or (result_bytes is not None and type(result_bytes) is not int)
            or (started is not None and (type(started) is not float or not isfinite(started)))
            or (worker is not None and not isinstance(worker, str))
            or type(gen) is not int
        ):
            return None
        parts = [f'{{"t":{_str(kind)},"id":{_str(job_id)},"loc":[{_str(chain)},{seg},{off}],"n":{attempt}']
        if outcome is not None:
            parts += (',"o":', _str(outcome))
        if error is not None:
            parts += (',"err":', _str(error))
        if run_at is not None:
            parts += (',"run_at":', repr(run_at))
        if queue is not None:
            parts += (',"q":', _str(queue))
        if event_id is not None:
            parts += (',"ev":', _str(event_id))
        if self.dup:
            parts.append(',"dup":true')
        if self.result_kept:
            parts += (',"r":', "null" if self.result is None else _encode(self.result))
        if result_bytes is not None:
            parts += (',"rb":', repr(result_bytes))
        if started is not None:
            parts += (',"st":', repr(started))
        if worker is not None:
            parts += (',"w":', _str(worker))
        if gen:
            parts += (',"g":', repr(gen))
        parts += (',"at":', repr(at), "}")
        return "".join(parts)

    def _body(self) -> dict[str, Any]:
        """The entry as the JSON object it is written as, ``None`` fields left out."""
        # Field by field, with one encoder built once (``json.dumps`` with options builds a new
        # encoder per call).
        body: dict[str, Any] = {"t": self.kind, "id": self.job_id, "loc": list(self.loc), "n": self.attempt}
        if self.outcome is not None:
            body["o"] = self.outcome
        if self.error is not None:
            body["err"] = self.error
        if self.run_at is not None:
            body["run_at"] = self.run_at
        if self.queue is not None:
            body["q"] = self.queue
        if self.event_id is not None:
            body["ev"] = self.event_id
        if self.job is not None:
            body["job"] = self.job
        if self.key is not None:
            body["k"] = self.key
        if self.dup_of is not None:
            body["of"] = self.dup_of
        if self.owner_loc is not None:
            body["ol"] = list(self.owner_loc)
        if self.until is not None:
            body["until"] = self.until
        if self.dup:
            body["dup"] = True
        if self.later:
            body["lt"] = self.later
            body["ls"] = self.later_since
        if self.result_kept:
            body["r"] = self.result
        if self.result_bytes is not None:
            body["rb"] = self.result_bytes
        if self.started is not None:
            body["st"] = self.started
        if self.worker is not None:
            body["w"] = self.worker
        if self.gen:
            body["g"] = self.gen
        if self.over is not None:
            body["over"] = self.over
        if self.under is not None:
            body["under"] = self.under
        body["at"] = self.at
        return body

    @classmethod
    def from_bytes(cls, raw: bytes) -> Entry:
        """Decode; raises ``ValueError`` (or ``KeyError``/``TypeError``) if it is not an entry."""
        return cls.from_body(json.loads(raw))

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Entry:
        """:meth:`from_bytes` of JSON already parsed (same errors)."""
        try:
            return cls._from_body(body)
        except OverflowError as exc:  # a number like 1e400 (infinity) where an integer goes
            raise ValueError(f"not an entry: {exc}") from exc

    @classmethod
    def _from_body(cls, body: dict[str, Any]) -> Entry:
        writer, segment, offset = body["loc"]
        owner = body.get("ol")
        return cls(
            kind=str(body["t"]),
            job_id=str(body["id"]),
            loc=(str(writer), int(segment), int(offset)),
            outcome=body.get("o"),
            attempt=int(body.get("n", 1)),
            dup=bool(body.get("dup", False)),
            error=body.get("err"),
            run_at=body.get("run_at"),
            at=float(body.get("at", 0.0)),
            queue=body.get("q"),
            event_id=body.get("ev"),
            job=body.get("job"),
            later=int(body.get("lt", 0)),
            later_since=body.get("ls"),
            key=body.get("k"),
            dup_of=body.get("of"),
            owner_loc=None if owner is None else parse_loc(owner),
            until=body.get("until"),
            result=body.get("r"),
            result_kept="r" in body,
            result_bytes=body.get("rb"),
            started=body.get("st"),
            worker=body.get("w"),
            gen=int(body.get("g", 0)),
            over=body.get("over"),
            under=body.get("under"),
        )

    def is_mark(self) -> bool:
        """Whether this entry keeps a failure off the list: a requeue, or a success that outranked it.

        Compaction keeps a mark while another segment holds the failure it cancels, and the
        ledger punch never takes one (docs/reliability.md, "A success outranks a failure"). The
        scan of a sealed segment tests the same on an entry's bytes (``segment_scan``'s ``_OVER``).
        """
        return self.kind == "requeued" or (self.kind == "done" and self.over is not None)

    def as_mark(self) -> Entry:
        """This entry as a mark only: a success's result is no part of it (compaction, late harvests)."""
        if not (self.result_kept or self.result_bytes is not None):
            return self
        return dataclasses.replace(self, result=None, result_kept=False, result_bytes=None)


def parse_event(event_id: str, body: Mapping[str, Any] | None, clock: Callable[[], float]) -> Entry:
    """The ledger entry a completion event stands for (``done`` or ``retry``).

    Raises:
        ValueError, TypeError, KeyError: the event is garbled (see :meth:`CompletionEvent.from_json`).
    """
    # The event's checked fields, not the event itself: one per harvested event.
    (job_id, loc, queue, outcome, final, retry_delay, attempt, dup, error, at, later, later_since,
     result, result_kept, result_bytes, started, worker, gen) = CompletionEvent.checked(body)  # fmt: skip
    terminal = outcome == _SUCCEEDED or final  # CompletionEvent.terminal
    return Entry(
        _DONE if terminal else _RETRY,
        job_id,
        loc,
        outcome=outcome if terminal else None,
        attempt=attempt,
        dup=dup,
        error=error,
        run_at=None if terminal else clock() + finite("retry_delay", retry_delay or 0.0),
        at=clock() if at is None else at,
        queue=queue,
        event_id=event_id,
        later=later,
        later_since=later_since,
        result=result if terminal else None,
        result_kept=result_kept and terminal,
        result_bytes=result_bytes if terminal else None,
        started=started,
        worker=worker,
        gen=gen,
    )


def parse_loc(raw: Any) -> Loc:
    """A position as written (``[chain, seg, off]``).

    A malformed one raises ``ValueError`` or ``TypeError`` like the entry's other fields, not
    ``IndexError``, which no reader catches.
    """
    chain, seg, off = raw
    return (str(chain), int(seg), int(off))
