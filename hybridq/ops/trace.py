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

The steps, and what each record says, are :mod:`hybridq.ops.trace_steps` (:class:`Step`,
:class:`Acceptance`); this module reads the records and assembles the :class:`Trace`. Every name
of that module is importable from here too.

This module must not import redis or rq.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, JournalError, ResultNotKept, StateFileCorrupt
from hybridq.job import Job, fetch_job
from hybridq.journal import JournalReader, RecordType
from hybridq.journal.paths import existing_journal_dir
from hybridq.journal.reader import read_record_at
from hybridq.journal.records import Loc
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ledger.entries import Entry
from hybridq.ledger.punched_ids import find_punched
from hybridq.ledger.store import ledger_dir
from hybridq.lookup.reads import find

# The steps' helpers are re-exported too (_entry_steps, _short: this module no longer uses them).
from hybridq.ops.trace_steps import (
    _RUNS,
    Acceptance,
    Step,
    _entry_steps,  # noqa: F401
    _laters,
    _record_steps,
    _refills,
    _run_steps,
    _short,  # noqa: F401
    _utc,
)
from hybridq.protocol import EntryKind

__all__ = ["Acceptance", "Step", "Trace", "job_trace"]

#: Outcomes that have no result to show (the error is in the steps).
_ENDED_WITHOUT_RESULT = frozenset({"failed", "cancelled", "invalid"})


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
    #: Whether :attr:`args` and :attr:`kwargs` are known (a compacted job's are gone).
    args_known: bool = True
    #: A finished job's result (``result_note`` says why there is none: not kept, not finished).
    result: Any = None
    result_note: str | None = "not finished"


def job_trace(journal: str, job_id: str, entries: list[Entry] | None = None) -> Trace | None:
    """The trace of ``job_id`` from the journal, the checkpoint and the ledger; ``None``: unknown.

    ``entries``: the job's ledger entries, if the caller has them (the dashboard keeps an
    incremental view of the ledger); without them, reads the whole ledger (its records of
    other jobs are skipped before they are decoded).
    """
    path = existing_journal_dir(journal)
    if entries is None:
        entries = list(_ledger_entries(path, job_id))
    job = fetch_job(job_id, path)
    found = [(job.record.writer_id, job.record.segment, job.record.offset)] if job is not None else []
    punched = _punched(path, job_id, entries, found)
    entries = [*entries, *punched]
    locs: list[Loc] = []
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
        mine = [e for e in entries if e.loc == loc and e not in punched]
        forwarded = any(step.kind in {"forwarded", "held"} for step in record_steps)
        refills = _refills(checkpoint, record_steps[0].at, mine) if forwarded else []
        trace.steps.extend(_run_steps(mine, refills))
        trace.steps.extend(_punched_step(e) for e in punched if e.loc == loc)
        trace.attempts = max(
            (e.attempt - _laters(mine, e) for e in mine if e.kind in _RUNS | {EntryKind.LOST}), default=0
        )
        requeued_at = max((e.at for e in mine if e.kind == EntryKind.REQUEUED), default=requeued_at)
    _in_flight(path, job_id, entries, trace)
    trace.status = _status(entries, trace)
    _from_lookup(job, trace)
    return trace


def _from_lookup(job: Job | None, trace: Trace) -> None:
    """What :func:`hybridq.fetch_job` knows that the records may not say any more.

    A compacted job's task and queue (the lookup index keeps them), and a finished job's result.
    """
    env = job.envelope if job is not None else None
    if trace.func is None and env is not None:
        trace.func, trace.queue = env.func or None, env.queue or None
    trace.args_known = any(a.envelope is not None for a in trace.acceptances)
    if job is None or trace.status != "succeeded":
        trace.result_note = None if trace.status in _ENDED_WITHOUT_RESULT else "not finished"
        return
    try:
        trace.result, trace.result_note = job.result, None
    except ResultNotKept as exc:
        trace.result_note = f"not kept ({exc.reason})"


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


def _punched(path: str, job_id: str, entries: list[Entry], found: list[Loc]) -> list[Entry]:
    """The ``done`` entry of ``job_id`` punched out of the ledger, from its kept id (docs/journal.md).

    None once a ``done`` entry of the same record is still in the ledger (a crash between the
    ids file and the punch leaves both). A damaged ids file raises (its one line names the
    repair) only if it may name this job: an ids file names only jobs whose journal record was
    punched (``hybridq.ledger.punch_select.kept_by_id``), so a job whose every record is on
    disk, or already has its ``done`` entry, is in none and is traced as it is.
    """
    have = {e.loc for e in entries if e.kind == EntryKind.DONE}
    try:
        kept = [p.entry() for _, p in find_punched(ledger_dir(path), [job_id])]
    except StateFileCorrupt:
        locs = {e.loc for e in entries} | set(found)
        if locs and all(loc in have or _on_disk(path, loc) for loc in locs):
            return []
        raise
    return [e for e in kept if e.loc not in have]


def _on_disk(path: str, loc: Loc) -> bool:
    """Whether the journal record at ``loc`` reads back (neither punched nor compacted)."""
    return _acceptance(path, loc).seq is not None


def _punched_step(entry: Entry) -> Step:
    """The outcome of a job whose ``done`` entry was punched: a success, its id kept."""
    title = "succeeded (punched: its ledger entry is gone, its id kept in the ledger's ids file)"
    return Step("done", entry.at, title, None, (("outcome", "succeeded"),), "ledger ids file")


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
