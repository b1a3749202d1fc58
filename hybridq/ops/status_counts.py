"""The counts of ``hybridq status``: from the forwarder's snapshot and the journal after it, or a full scan.

:func:`from_snapshot` reads the figures the forwarder saves with each step
(:mod:`hybridq.lookup.stats`) and the records after them, or answers ``None`` when they cannot be
trusted; :func:`scan_counts` scans the journal, the ledger and the checkpoint. Both give the same
answer once the forwarder has taken its step (docs/api.md, "Stats for a health endpoint"). Kept
apart from :mod:`hybridq.ops.status`, which puts the status object together, so that the counting
reads on its own. This module must not import redis or rq.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridq.cancels import pending_cancels, read_requests
from hybridq.errors import JournalCorruption
from hybridq.journal import ChainPosition, JournalReader, RecordType
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.reader import list_chains
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ledger.compacted import Compacted, load_compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import ledger_dir, load_index
from hybridq.lookup.stats import checkpoint_file, job_fields, ledger_chains, ledger_tail, load_snapshot

__all__ = ["from_snapshot", "scan_counts"]


def from_snapshot(path: str, *, running: bool = False) -> dict[str, Any] | None:
    """The counts from the forwarder's snapshot and the journal after it; ``None``: scan instead.

    ``running``: whether a forwarder holds the journal (it writes a new snapshot at its next
    step; one that stopped after writing its checkpoint or ledger but not the snapshot never will).
    """
    snap = load_snapshot(path)
    if snap is None or checkpoint_file(path) is None:
        return None
    if not running and (
        checkpoint_file(path) != snap.checkpoint_file
        or (snap.ledger_tail is not None and ledger_tail(path, snap.ledger_tail[0]) != snap.ledger_tail)
    ):
        return None
    compacted = load_compacted(path)
    if json.loads(compacted.to_bytes()) != snap.compacted:
        return None  # compacted since: its counts moved (the next step writes a new snapshot)
    if not set(ledger_chains(ledger_dir(path))) <= set(snap.ledger_chains):
        return None  # another process wrote to the ledger (a requeue): only a scan knows what
    if any(True for _ in read_requests(path)):
        return None  # a cancel the forwarder has not taken in yet (its next step does)
    chains = list_chains(path)
    try:
        tail = _scan_pending(path, compacted, LedgerIndex(), snap.positions, since=snap.positions)
    except (FileNotFoundError, JournalCorruption):
        return None  # compacted under it: the scan retries, and reports real damage
    if load_compacted(path) != compacted:
        return None
    leftover = sum(
        sealed_data_count(path, w, i) or 0
        for w, indices in chains.items()
        for i in indices
        if compacted.is_compacted((w, i))
    )
    accepted = compacted.accepted + snap.consumed + tail.records - leftover
    done = snap.outcomes
    succeeded = compacted.succeeded + done.get("succeeded", 0)
    failed = compacted.failed + done.get("failed", 0) + compacted.invalid + done.get("invalid", 0)
    cancelled = compacted.cancelled + done.get("cancelled", 0)
    failed += cancelled  # ended without success, as records that are not jobs: pending stays the rest
    queues = dict(snap.queues)
    for queue, n in tail.queues.items():
        queues[queue] = queues.get(queue, 0) + n
    oldest = min((t for t in (snap.oldest_pending, tail.oldest_pending) if t is not None), default=None)
    return {
        "accepted": accepted,
        "forwarded": snap.forwarded,
        "succeeded": succeeded,
        "failed": failed,
        "pending": accepted - succeeded - failed,
        "duplicates_suppressed": compacted.dups + done.get("dups", 0),
        "not_yet_forwarded": tail.not_forwarded,
        "delayed_held": snap.delayed_held,
        "duplicate_pushes": snap.duplicate_pushes,
        "invalid_records": snap.invalid,
        "retrying": snap.retrying,
        "failed_listed": snap.failed_listed,
        "compacted_segments": sum(i + 1 for i in compacted.through.values()),
        "queues": queues,
        "oldest_pending_age_s": _age(oldest),
        "forwarding_lag_s": _age(tail.oldest_unforwarded),
        "cancelled": cancelled,
        "cancels_pending": snap.cancels,
    }


def scan_counts(path: str, compacted: Compacted) -> dict[str, Any]:
    """Every count of the status object, from the journal, the ledger and the checkpoint."""
    segments = [(w, i) for w, indices in list_chains(path).items() for i in indices]
    live = [seg for seg in segments if not compacted.is_compacted(seg)]
    # Segments whose deletion a crash interrupted are counted in `compacted` already.
    leftover = sum(sealed_data_count(path, w, i) or 0 for w, i in segments if compacted.is_compacted((w, i)))
    checkpoint = load_checkpoint(path)
    index = load_index(path, compacted, keys=False)
    scan = _scan_pending(path, compacted, index, checkpoint.positions if checkpoint else {})
    accepted = compacted.accepted + scan.records - leftover
    waiting = scan.not_forwarded
    counts = index.counts(live)
    succeeded = compacted.succeeded + counts["succeeded"]
    # Records that are not jobs are terminal too (skipped, logged): they count as failed.
    failed = compacted.failed + counts["failed"] + compacted.invalid + counts["invalid"]
    suppressed = compacted.dups + counts["dups"]
    cancelled = compacted.cancelled + counts["cancelled"]
    failed += cancelled  # ended without success, as records that are not jobs: pending stays the rest
    return {
        "accepted": accepted,
        "forwarded": checkpoint.forwarded if checkpoint else 0,
        "succeeded": succeeded,
        "failed": failed,
        "pending": accepted - succeeded - failed,
        "duplicates_suppressed": suppressed,
        "not_yet_forwarded": waiting,
        "delayed_held": len(checkpoint.held) if checkpoint else 0,
        "duplicate_pushes": checkpoint.duplicate_pushes if checkpoint else 0,
        "invalid_records": checkpoint.invalid if checkpoint else 0,
        "retrying": len(index.retries),
        "failed_listed": len(index.failed),
        "compacted_segments": sum(i + 1 for i in compacted.through.values()),
        "queues": scan.queues,
        "oldest_pending_age_s": _age(scan.oldest_pending),
        "forwarding_lag_s": _age(scan.oldest_unforwarded),
        "cancelled": cancelled,
        "cancels_pending": pending_cancels(path, index),
    }


@dataclass
class _Scan:
    records: int = 0
    not_forwarded: int = 0
    #: Per queue: pending jobs (accepted, not terminal).
    queues: dict[str, int] = field(default_factory=dict)
    oldest_pending: float | None = None
    oldest_unforwarded: float | None = None


def _scan_pending(
    path: str,
    compacted: Compacted,
    index: LedgerIndex,
    positions: Mapping[str, ChainPosition],
    *,
    since: Mapping[str, ChainPosition] | None = None,
) -> _Scan:
    """One pass over the live journal (after ``since``): counts, what is pending where and since when.

    Only records that are not terminal are decoded, so the cost follows the backlog, not the
    journal's size.
    """
    out = _Scan()
    reader = JournalReader(path)
    for record in reader.records(since):
        if record.rtype != RecordType.DATA or compacted.is_compacted(
            (record.writer_id, record.segment_index)
        ):
            continue
        out.records += 1
        forwarded = record.consumed_by(positions)
        out.not_forwarded += not forwarded
        if index.is_terminal((record.writer_id, record.segment_index, record.offset)):
            continue
        job = job_fields(record.payload)
        if job is None:
            continue  # not a job: the forwarder records it as invalid (terminal) when it reads it
        queue, created = job
        out.queues[queue] = out.queues.get(queue, 0) + 1
        out.oldest_pending = created if out.oldest_pending is None else min(out.oldest_pending, created)
        if not forwarded and (out.oldest_unforwarded is None or created < out.oldest_unforwarded):
            out.oldest_unforwarded = created
    # Punched records were accepted and finished (docs/journal.md): counted as the others are.
    out.records += sum(n for seg, n in reader.records_punched.items() if not compacted.is_compacted(seg))
    return out


def _age(since: float | None) -> float:
    """Seconds since ``since`` (0 when there is nothing)."""
    return 0.0 if since is None else round(max(0.0, time.time() - since), 3)
