"""One job's history from the durable records alone: the dashboard's trace (docs/http.md).

Every step comes from a file in the journal directory, so the trace is the same after Redis
lost everything (``FLUSHALL``):

* **accepted** -- the job's journal record: its segment, offset and sequence number, and the
  time the producer gave it (``created_at``); one per acceptance (a requeue is a new record).
* **forwarded** -- the forwarder's checkpoint is past the record (``forwarder.state``): it was
  pushed, under the epoch generation the checkpoint holds now (the push time is Redis's only);
  or it is held there until its ``run_at`` (a delayed job).
* **claimed / ran** -- each attempt's ledger entry (``retry`` or ``done``) names the worker
  process (``host/pid``) and when the run started; a claim not reported yet is in the lookup
  index (the ``started`` event the forwarder harvested), which is derived data, not fsync'd.
* **redeliveries** -- ``retry`` entries (a failed attempt and its error, or a ``RetryLater``),
  ``lost`` entries (the worker vanished: its lease expired), ``cancel`` entries, ``requeued``
  entries (the failed job was accepted again, under a new record), ``duplicate`` entries.
* **outcome** -- the ``done`` entry.

This module must not import redis or rq.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hybridq.envelope import Envelope
from hybridq.errors import EnvelopeError, JournalError
from hybridq.job import fetch_job
from hybridq.journal import JournalReader, RecordType
from hybridq.journal.paths import existing_journal_dir
from hybridq.journal.reader import read_record_at
from hybridq.journal.records import Loc
from hybridq.ledger import Entry, ledger_dir
from hybridq.lookup import find
from hybridq.protocol import EntryKind
from hybridq.state import Checkpoint, load_checkpoint

__all__ = ["Acceptance", "Step", "Trace", "job_trace"]


@dataclass(frozen=True, slots=True)
class Step:
    """One thing that happened to a job.

    Attributes:
        kind: ``accepted``, ``forwarded``, ``held``, ``waiting``, ``claimed``, ``retry``,
            ``later``, ``lost``, ``cancel``, ``duplicate``, ``requeued`` or ``done``.
        at: When (Unix seconds); ``None`` where no record says.
        title: What happened, one line.
        reason: Why (a redelivery's cause, an error's last line), if any.
        details: Further facts, label -> value, in order.
        source: The record it comes from (``journal``, ``checkpoint``, ``ledger``, ``lookup index``).
    """

    kind: str
    at: float | None
    title: str
    reason: str | None = None
    details: tuple[tuple[str, str], ...] = ()
    source: str = "ledger"


@dataclass(frozen=True, slots=True)
class Acceptance:
    """One journal record of the job (its first acceptance, or a requeue)."""

    loc: Loc
    seq: int | None
    envelope: Envelope | None


@dataclass
class Trace:
    """A job's history (see the module docstring)."""

    job_id: str
    func: str | None = None
    queue: str | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: ``pending``, ``forwarded``, ``started``, ``retrying``, or the terminal outcome.
    status: str = "pending"
    attempts: int = 0
    steps: list[Step] = field(default_factory=list)
    acceptances: list[Acceptance] = field(default_factory=list)
    #: The epoch generation in the checkpoint (how many times Redis lost or rolled back state).
    generation: int = 0


def job_trace(journal: str, job_id: str, entries: list[Entry] | None = None) -> Trace | None:
    """The trace of ``job_id`` from the journal, the checkpoint and the ledger; ``None``: unknown.

    ``entries``: the job's ledger entries, if the caller has them (the dashboard keeps an
    incremental view of the ledger); without them, reads the whole ledger (its records of
    other jobs are skipped before they are decoded).
    """
    path = existing_journal_dir(journal)
    if entries is None:
        entries = list(_ledger_entries(path, job_id))
    locs: list[Loc] = []
    job = fetch_job(job_id, path)
    found = [(job.record.writer_id, job.record.segment, job.record.offset)] if job is not None else []
    for loc in [e.loc for e in entries] + found:
        if loc not in locs:
            locs.append(loc)
    if not locs:
        return None
    trace = Trace(job_id)
    checkpoint = load_checkpoint(path)
    trace.generation = checkpoint.generation if checkpoint is not None else 0
    # In logical order, one acceptance after the other: its record, the checkpoint's word on it,
    # then the ledger's entries of it by time (the push has no durable time of its own).
    requeued_at: float | None = None
    for loc in sorted(locs, key=lambda loc: _acceptance_order(path, loc)):
        acc = _acceptance(path, loc)
        trace.acceptances.append(acc)
        record_steps = _record_steps(acc, checkpoint)
        if acc.envelope is not None and acc.envelope.requeue and requeued_at is not None:
            # A requeue keeps the job's creation time: it was accepted again when it was requeued.
            record_steps[0] = dataclasses.replace(record_steps[0], at=requeued_at)
        trace.steps.extend(record_steps)
        env = acc.envelope
        if env is not None:
            trace.func, trace.queue = env.func, env.queue
            trace.args, trace.kwargs = tuple(env.args), dict(env.kwargs)
        mine = [e for e in entries if e.loc == loc]
        forwarded = any(step.kind in {"forwarded", "held"} for step in record_steps)
        refills = _refills(checkpoint, record_steps[0].at, mine) if forwarded else []
        trace.steps.extend(_run_steps(mine, refills))
        trace.attempts = max(
            (e.attempt - _laters(mine, e) for e in mine if e.kind in _RUNS | {EntryKind.LOST}), default=0
        )
        requeued_at = max((e.at for e in mine if e.kind == EntryKind.REQUEUED), default=requeued_at)
    _in_flight(path, job_id, entries, trace)
    trace.status = _status(entries, trace)
    return trace


_RUNS = {EntryKind.RETRY, EntryKind.DONE}


def _laters(mine: list[Entry], entry: Entry) -> int:
    """The RetryLaters before ``entry``'s run (runs that used no attempt).

    A run's own entry carries the count; a ``lost`` entry (written by the forwarder) does not:
    it takes the count of the runs before it, as the delivery it stands for carried it.
    """
    if entry.kind != EntryKind.LOST:
        return entry.later
    return max((e.later for e in mine if e.kind == EntryKind.RETRY and e.attempt < entry.attempt), default=0)


def _run_steps(mine: list[Entry], refills: list[Step]) -> list[Step]:
    """The steps of one record's ledger entries and of the epoch changes it lived through."""
    # Runs in the order they started (a run's claim and outcome stay together), the rest by time.
    timed: list[tuple[float, float, int, list[Step]]] = [(s.at or 0.0, s.at or 0.0, 0, [s]) for s in refills]
    # The generation of the record's first delivery, as far as runs tell: a run pushed under a
    # higher one was pushed again after Redis lost its state (whatever order runs ended in).
    # Only entries of the current format (they name their worker: ``w``) tell their generation;
    # an older worker's entry has no ``g`` and reads as 0 whatever it was (a rolling upgrade).
    gens = {e.gen for e in mine if e.kind in _RUNS and e.worker is not None}
    first_gen = min(gens) if len(gens) > 1 else None
    later = 0
    for entry in sorted(mine, key=lambda e: (e.at, e.attempt)):
        start = entry.at if entry.started is None else min(entry.started, entry.at)
        timed.append((start, entry.at, entry.attempt, _entry_steps(entry, later, first_gen)))
        if entry.kind == EntryKind.RETRY:
            later = max(later, entry.later)
    return [step for *_, steps in sorted(timed, key=lambda t: t[:3]) for step in steps]


def _refills(checkpoint: Checkpoint | None, accepted: float | None, mine: list[Entry]) -> list[Step]:
    """The epoch changes while the record was unfinished: the forwarder pushed it again then."""
    if checkpoint is None or accepted is None:
        return []
    ended = min((e.at for e in mine if e.kind == EntryKind.DONE), default=None)
    return [
        Step(
            "refill",
            at,
            "Redis lost or rolled back its state: the forwarder pushed every unfinished job again",
            None,
            (("epoch generation", str(generation)),),
            "checkpoint",
        )
        for generation, at in checkpoint.epochs
        if accepted < at and (ended is None or at < ended)
    ]


def _ledger_entries(path: str, job_id: str) -> Iterator[Entry]:
    """The ledger's entries of ``job_id`` (others are skipped on a byte search, undecoded)."""
    directory = ledger_dir(path)
    if not os.path.isdir(directory):
        return
    needle = f'"id":"{job_id}"'.encode()
    for record in JournalReader(directory).records():
        if record.rtype != RecordType.DATA or needle not in record.payload:
            continue
        try:
            entry = Entry.from_bytes(record.payload)
        except (ValueError, KeyError, TypeError):
            continue
        if entry.job_id == job_id:
            yield entry


def _acceptance_order(path: str, loc: Loc) -> tuple[int, float]:
    acc = _acceptance(path, loc)
    env = acc.envelope
    return (env.requeue, env.created_at) if env is not None else (0, 0.0)


def _acceptance(path: str, loc: Loc) -> Acceptance:
    try:
        record = read_record_at(path, *loc)
    except (OSError, JournalError):
        return Acceptance(loc, None, None)  # its segment was compacted (or moved aside)
    try:
        env: Envelope | None = Envelope.from_bytes(record.payload)
    except EnvelopeError:
        env = None
    return Acceptance(loc, record.seq, env)


def _record_steps(acc: Acceptance, checkpoint: Checkpoint | None) -> list[Step]:
    """The accepted step of one record, and what the checkpoint says of it."""
    writer, segment, offset = acc.loc
    env = acc.envelope
    where = (("writer", writer), ("segment", str(segment)), ("offset", str(offset)))
    if acc.seq is None:
        return [
            Step("accepted", None, "accepted (its journal segment was compacted)", None, where, "journal")
        ]
    title = "accepted" if env is None or env.requeue == 0 else f"accepted again (requeue {env.requeue})"
    steps = [
        Step(
            "accepted",
            env.created_at if env else None,
            title,
            None,
            (*where, ("seq", str(acc.seq))),
            "journal",
        )
    ]
    if checkpoint is None:
        steps.append(
            Step("waiting", None, "not forwarded yet (no forwarder has run here)", None, (), "checkpoint")
        )
        return steps
    held = next(
        (h for h in checkpoint.held if (h.writer_id, h.segment, h.offset) == acc.loc),
        None,
    )
    position = checkpoint.positions.get(writer)
    if held is not None:
        steps.append(
            Step(
                "held",
                None,
                "read by the forwarder, held until its time",
                None,
                (("run at", _utc(held.run_at)),),
                "checkpoint",
            )
        )
    elif position is not None and (segment, offset) < (position.segment, position.offset):
        run_at = env.run_at if env is not None else None
        steps.append(
            Step(
                "forwarded",
                run_at,
                "forwarded to Redis (the checkpoint is past this record)",
                None,
                (),
                "checkpoint",
            )
        )
    else:
        steps.append(Step("waiting", None, "not forwarded yet", None, (), "checkpoint"))
    return steps


def _entry_steps(entry: Entry, later_before: int, gen_before: int | None) -> list[Step]:
    """The steps one ledger entry stands for: the run it reports (claimed), then what it says.

    ``later_before``: the RetryLaters of the runs before it; ``gen_before``: the epoch generation
    of the record's first delivery, where its runs were pushed under more than one (else ``None``).
    """
    steps: list[Step] = []
    # A lost entry carries no RetryLater count: the runs before it tell it (``later_before``).
    laters = later_before if entry.kind == EntryKind.LOST else entry.later
    attempt = str(max(1, entry.attempt - laters))
    run = (("attempt", attempt), ("run", str(entry.attempt)))
    worker = entry.worker or "not recorded (an older worker)"
    ran = entry.kind in {EntryKind.RETRY, EntryKind.DONE} and entry.outcome != "cancelled"
    if ran and (entry.started is not None or entry.worker is not None or entry.dup):
        why = None
        if gen_before is not None and entry.worker is not None and entry.gen > gen_before:
            why = (
                f"delivered again after Redis lost or rolled back its state (epoch generation "
                f"{gen_before} -> {entry.gen}): the forwarder pushed every unfinished job again"
            )
        title = f"delivered to {worker}" if entry.dup else f"claimed by {worker}"
        claim = (*run, ("worker", worker), ("epoch generation", str(entry.gen)))
        steps.append(Step("claimed", entry.started, title, why, claim))
    if entry.kind == EntryKind.RETRY:
        if entry.later > later_before:
            steps.append(
                Step(
                    "later",
                    entry.at,
                    "said RetryLater: runs again, no attempt used",
                    None,
                    (*run, ("next run at", _utc(entry.run_at))),
                )
            )
        else:
            steps.append(
                Step(
                    "retry",
                    entry.at,
                    f"attempt {attempt} failed: retried",
                    entry.error,
                    (*run, ("next run at", _utc(entry.run_at))),
                )
            )
    elif entry.kind == EntryKind.LOST:
        steps.append(
            Step("lost", entry.at, "worker vanished (its lease expired): delivered again", None, run)
        )
    elif entry.kind == EntryKind.CANCEL:
        steps.append(Step("cancel", entry.at, "cancel asked: never delivered again"))
    elif entry.kind == EntryKind.REQUEUED:
        steps.append(Step("requeued", entry.at, "requeued after failing for good (a new journal record)"))
    elif entry.kind == EntryKind.DUPLICATE:
        steps.append(
            Step(
                "duplicate",
                entry.at,
                "not pushed: its idempotency key belongs to another job",
                None,
                (("owner", entry.dup_of or "?"),),
            )
        )
    elif entry.kind == EntryKind.DONE:
        outcome = entry.outcome or "failed"
        details: list[tuple[str, str]] = [*run, ("outcome", outcome)]
        if entry.worker is not None:
            details.append(("worker", entry.worker))
        if entry.result_kept:
            details.append(("result", _short(repr(entry.result))))
        if entry.dup_of is not None:
            details.append(("settled as a duplicate of", entry.dup_of))
        title = f"{outcome}" + (" (outcome already stored: not run again)" if entry.dup else "")
        steps.append(Step("done", entry.at, title, entry.error, tuple(details)))
    return steps


def _in_flight(path: str, job_id: str, entries: list[Entry], trace: Trace) -> None:
    """What the lookup index knows that the ledger does not say (any more).

    A claim no ledger entry reports yet (a run in progress: the ``started`` event), and the
    outcome of a job whose journal segment, and so its ledger entries, were compacted (the index
    keeps it for ``lookup.RETENTION_S``).
    """
    row = find(path, job_id)
    if row is None:
        return
    mine = [e for e in entries if e.loc == row.loc and e.kind in _RUNS]
    if row.state == "started" and row.started is not None and not any(e.at >= row.started for e in mine):
        trace.steps.append(
            Step(
                "claimed",
                row.started,
                "claimed: running (no outcome yet)",
                None,
                (("attempt", str(row.attempt)),),
                "lookup index",
            )
        )
    elif row.state == "done" and not any(e.kind == EntryKind.DONE for e in mine):
        details = [("attempt", str(row.attempt)), ("outcome", str(row.outcome))]
        if row.started is not None:
            details.append(("started", _utc(row.started)))
        title = f"{row.outcome} (its journal segment and ledger entries were compacted)"
        trace.steps.append(Step("done", row.ended, title, row.error, tuple(details), "lookup index"))
        trace.attempts = max(trace.attempts, row.attempt)


def _status(entries: list[Entry], trace: Trace) -> str:
    done = [e for e in entries if e.kind == EntryKind.DONE and e.loc == trace.acceptances[-1].loc]
    if done:
        rank = {"cancelled": 1, "failed": 2, "succeeded": 3}
        return max((e.outcome or "failed" for e in done), key=lambda o: rank.get(o, 0))
    kinds = [s.kind for s in trace.steps]
    if kinds and kinds[-1] == "done" and trace.steps[-1].source == "lookup index":
        return dict(trace.steps[-1].details).get("outcome", "done")
    if kinds and kinds[-1] == "claimed":
        return "started"
    if any(e.kind == EntryKind.RETRY and e.loc == trace.acceptances[-1].loc for e in entries):
        return "retrying"
    return "forwarded" if "forwarded" in kinds else "pending"


def _utc(at: float | None) -> str:
    if at is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d} UTC"


def _short(text: str, most: int = 300) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"
