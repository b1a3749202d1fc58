"""Cancellation, the producer side: ``hybridq cancel`` and ``job.cancel()`` ask, the forwarder acts.

A cancel is **durable before it returns**, and needs neither Redis nor the forwarder's lock (as
:func:`hybridq.requeue` does not): :func:`cancel` finds the job's records in the journal, then
writes one request file into ``<journal>/cancel/`` (a state file: temp file, fsync, rename, fsync
of the directory) and nudges the forwarder. The forwarder (:mod:`hybridq.forwarder.cancelling`) takes each
request into its ledger as ``cancel`` entries (one fsync), then deletes the file; a crash in
between takes the same request in again, which changes nothing. From then on:

* a job not pushed yet (not read, held until its time, a retry not due) is settled ``cancelled``
  at once and never pushed;
* a pushed job is marked in Redis (its RQ job hash gets ``hybridq_cancel``) and taken off its
  queue; a worker that took it already finds the mark at its claim and runs nothing; one
  running it is asked to stop (``current_job().check_cancelled()``, then the worker's hard stop
  after a grace period: docs/worker.md);
* a job with a cancel asked for is never delivered again (no retry, no redelivery after a lost
  worker, no refill after Redis lost its state): once no worker holds it, it is ``cancelled``.

This module must not import redis or rq.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, StateFileCorrupt
from hybridq.journal import JournalReader, RecordType
from hybridq.journal.holes import HOLES_SUFFIX, HoleMaps
from hybridq.journal.paths import default_journal, ensure_journal_dir, existing_journal_dir
from hybridq.journal.records import Loc
from hybridq.journal.statefile import STATE_SUFFIX, read_state, write_state
from hybridq.ledger.compacted import Compacted, consistent
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.punched_ids import find_punched
from hybridq.ledger.store import ledger_dir, load_index, read_ledger_of
from hybridq.protocol import EntryKind
from hybridq.protocol.nudge import nudge

__all__ = [
    "CANCEL_DIR",
    "CancelResult",
    "cancel",
    "cancel_at",
    "cancel_dir",
    "pending_cancels",
    "read_requests",
]

#: The directory of cancel requests not yet taken in by the forwarder, inside the journal.
CANCEL_DIR = "cancel"
#: What :func:`cancel` says per job id (:attr:`CancelResult.state`).
REQUESTED, SUCCEEDED, FAILED, CANCELLED, UNKNOWN = "requested", "succeeded", "failed", "cancelled", "unknown"


@dataclass(frozen=True, slots=True)
class CancelResult:
    """What :func:`cancel` did for one job id.

    ``state``: ``requested`` (the job had not ended: it will not run, or is asked to stop),
    ``cancelled`` (cancelled already), ``succeeded`` or ``failed`` (it ended before: nothing
    done), ``unknown`` (no such job in the journal: never enqueued here, or finished so long ago
    that its segment was compacted away; a finished job whose record was punched out of a segment
    still on disk answers as finished).
    """

    id: str
    state: str

    @property
    def message(self) -> str:
        """One line for a person."""
        return {
            REQUESTED: "cancel requested (a queued or held job never runs; a running one is asked to stop)",
            CANCELLED: "already cancelled",
            SUCCEEDED: "already finished: not cancelled",
            FAILED: "already failed for good: not cancelled",
            UNKNOWN: "no such job in this journal (or finished and compacted away): not cancelled",
        }[self.state]


def cancel_dir(journal: str) -> str:
    """The directory of a journal's cancel requests."""
    return os.path.join(journal, CANCEL_DIR)


def cancel(job_ids: Iterable[str], journal: str | os.PathLike[str] | None = None) -> list[CancelResult]:
    """Cancel jobs by id; one :class:`CancelResult` per distinct id, in the order given.

    Every pending record of an id is cancelled (an id enqueued twice is one job). The request is
    durable when this returns (see the module docstring); cancelling twice is harmless.
    """
    path = existing_journal_dir(journal or default_journal())
    wanted = list(dict.fromkeys(job_ids))
    # Read again if a compaction deleted a segment under either read (hybridq.ledger.store.consistent).
    index, locs = consistent(
        path, lambda c: (_Known(c, load_index(path, c, keys=False)), _records(path, set(wanted), c))
    )
    locs.update(_punched(path, {i for i in wanted if i not in locs}, index.index))
    return _ask(path, wanted, locs, index.index)


def cancel_at(
    jobs: Iterable[tuple[str, Loc]], journal: str | os.PathLike[str] | None = None
) -> list[CancelResult]:
    """Cancel jobs whose records the caller located (``(job id, loc)``), as :func:`cancel` does.

    No journal scan: the lookup index knows where a job's record is (the dashboard's bulk cancel
    of retrying jobs passes its rows'). Each location must be that job's record, as the index
    holds it (a location is never reused: segments are numbered on). Only the records given are
    cancelled; one whose segment was compacted (it ended) is not.
    """
    path = existing_journal_dir(journal or default_journal())
    given: dict[str, list[Loc]] = {}
    for job_id, loc in jobs:
        given.setdefault(job_id, []).append(loc)
    known = consistent(path, lambda c: _Known(c, load_index(path, c, keys=False)))
    live = {
        i: [loc for loc in locs if not known.compacted.is_compacted(loc[:2])] for i, locs in given.items()
    }
    return _ask(path, list(given), live, known.index)


def _ask(path: str, wanted: list[str], locs: dict[str, list[Loc]], index: LedgerIndex) -> list[CancelResult]:
    """Per job id, what a cancel does (the ledger ``index`` says which of its records ``locs`` ended)."""
    results: list[CancelResult] = []
    request: list[tuple[str, Loc]] = []
    failed: set[str] | None = None  # the listed failures' ids, read once if an id needs them
    for job_id in wanted:
        mine = locs.get(job_id, [])
        pending = [loc for loc in mine if not index.is_terminal(loc)]
        if pending:
            request += [(job_id, loc) for loc in pending]
            results.append(CancelResult(job_id, REQUESTED))
        elif mine:
            results.append(CancelResult(job_id, _ended(index, mine)))
        else:
            if failed is None:
                failed = index.failed.job_ids()
            results.append(CancelResult(job_id, FAILED if job_id in failed else UNKNOWN))
    if request:
        _write_request(path, request)
        nudge(path)
    return results


@dataclass(frozen=True, slots=True)
class _Known:
    compacted: Compacted
    index: LedgerIndex


def _ended(index: LedgerIndex, locs: list[Loc]) -> str:
    """The state of a job whose records are all terminal: its newest record's outcome."""
    loc = locs[-1]
    outcome = index.outcome(loc)
    if outcome == "cancelled":
        return CANCELLED
    return SUCCEEDED if outcome == "succeeded" else FAILED


def _records(path: str, ids: set[str], compacted: Compacted) -> dict[str, list[Loc]]:
    """Where each of ``ids`` is recorded in the live journal (one pass, JSON decoded only on a hit)."""
    needles = [(f'"id":"{job_id}"'.encode(), job_id) for job_id in ids]
    out: dict[str, list[Loc]] = {}
    for rec in JournalReader(path).records():
        if rec.rtype != RecordType.DATA or compacted.is_compacted((rec.writer_id, rec.segment_index)):
            continue
        hits = [job_id for needle, job_id in needles if needle in rec.payload]
        if not hits:
            continue
        try:
            env = Envelope.from_bytes(rec.payload)
        except EnvelopeError:
            continue
        if env.id in hits:
            out.setdefault(env.id, []).append((rec.writer_id, rec.segment_index, rec.offset))
    return out


def _punched(path: str, ids: set[str], index: LedgerIndex) -> dict[str, list[Loc]]:
    """Where each of ``ids`` finished in a punched run (its record is gone: the scan skips it).

    A punched segment is still on disk (docs/journal-format.md, hole maps): its jobs answer as
    finished, not unknown. Their ``done`` entries say where. The ledger is read only if a
    segment has a map, and only the entries naming an id are decoded: which mapped segment an
    id could be in is known from its record (punched) or its ledger entries only (the ledger
    index keeps locations, not ids; the lookup index is a cache that may be behind).
    A requeued job's records are never punched: one found in the journal is not looked up here.
    """
    if not ids or not any(HOLES_SUFFIX in name for name in os.listdir(path)):
        return {}
    maps = HoleMaps(path)
    out: dict[str, list[Loc]] = {}
    # Their entries, or, once those were punched too, the ids kept for them (ledger/punched_ids.py).
    kept = (p.entry() for _, p in find_punched(ledger_dir(path), ids))
    for entry in itertools.chain(read_ledger_of(path, ids), kept):
        if entry.kind != EntryKind.DONE or not index.is_terminal(entry.loc):
            continue
        if maps.hole_at(*entry.loc) is not None:
            locs = out.setdefault(entry.job_id, [])
            if entry.loc not in locs:
                locs.append(entry.loc)
    return out


def _write_request(path: str, jobs: list[tuple[str, Loc]]) -> None:
    """Durably write one request file (a state file: whole or absent after a crash)."""
    directory = ensure_journal_dir(cancel_dir(path))
    body = {"v": 1, "at": time.time(), "jobs": [{"id": job_id, "loc": list(loc)} for job_id, loc in jobs]}
    name = f"req-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"
    write_state(directory, name, json.dumps(body, separators=(",", ":")).encode())


def read_requests(journal: str) -> Iterator[tuple[str, list[tuple[str, Loc]]]]:
    """Every request file not taken in yet, oldest first: ``(file path, [(job id, loc)])``.

    A damaged or garbled file yields an empty list (the caller deletes it, logged): a request
    is whole once :func:`cancel` returned, so damage means it never was acknowledged.
    """
    directory = cancel_dir(journal)
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("req-") and n.endswith(STATE_SUFFIX))
    except FileNotFoundError:
        return
    for name in names:
        full = os.path.join(directory, name)
        try:
            raw = read_state(directory, name[: -len(STATE_SUFFIX)])
            if raw is None:
                continue
            body = json.loads(raw)
            jobs = [(str(j["id"]), _loc(j["loc"])) for j in body["jobs"]]
        except (StateFileCorrupt, ValueError, KeyError, TypeError):
            jobs = []
        yield full, jobs


def _loc(value: object) -> Loc:
    if not isinstance(value, list) or len(value) != 3:
        raise ValueError(f"not a loc: {value!r:.60}")
    writer, segment, offset = value
    return (str(writer), int(segment), int(offset))


def pending_cancels(journal: str, index: LedgerIndex) -> int:
    """Jobs a cancel was asked for that are not terminal yet: in the ledger, or still in a request file."""
    locs = set(index.cancels)
    for _path, jobs in read_requests(journal):
        locs.update(loc for _id, loc in jobs if not index.is_terminal(loc))
    return len(locs)
