"""The steps of a job's trace (:mod:`hybridq.ops.trace`): what each durable record says happened.

:class:`Step` is one thing that happened to a job; this module turns one journal record (an
:class:`Acceptance`, with the checkpoint's word on it), one record's ledger entries and the epoch
changes it lived through into steps, in order. Reading the records is :mod:`hybridq.ops.trace`'s part;
every name here is importable from there too.

This module must not import redis or rq.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hybridq.envelope.model import Envelope
from hybridq.journal.records import Loc
from hybridq.ledger.checkpoint import Checkpoint
from hybridq.ledger.entries import Entry
from hybridq.protocol import EntryKind

__all__ = ["Acceptance", "Step"]


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


def _utc(at: float | None) -> str:
    if at is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d} UTC"


def _short(text: str, most: int = 300) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"
