"""What ``hybridq status`` reports, computed from the journal, the ledger and the checkpoint.

Redis is optional: every contract field comes from durable state on this host, so the answer is
the same whether Redis is up, down or freshly emptied.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridq.cancels import pending_cancels
from hybridq.forwarder import LOCK_NAME
from hybridq.journal import ChainPosition, JournalReader, RecordType
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.ownerlock import lock_owner
from hybridq.journal.paths import existing_journal_dir
from hybridq.journal.reader import list_chains, segment_usage
from hybridq.ledger import Compacted, LedgerIndex, consistent, load_index
from hybridq.outbox.backlog import read_backlog
from hybridq.outbox.schema import DEFAULT_TABLE
from hybridq.redisurl import redact_url
from hybridq.secretfile import read_password
from hybridq.state import load_checkpoint

# read_password lives in hybridq.secretfile (the worker side uses it too), redact_url in
# hybridq.redisurl; both kept importable here.
__all__ = ["CONTRACT_FIELDS", "collect_status", "read_password", "redact_url"]

#: The fields ``status --json`` promises (integers; docs/cli.md).
CONTRACT_FIELDS = ("accepted", "forwarded", "succeeded", "failed", "pending", "duplicates_suppressed")


def collect_status(
    journal: str,
    *,
    redis_url: str | None = None,
    outbox: str | None = None,
    outbox_table: str = DEFAULT_TABLE,
) -> dict[str, Any]:
    """The status object of ``hybridq status --json``.

    With ``outbox`` (a DSN), also the transactional outbox's backlog: its committed rows the
    relay has not moved into the journal yet, and the oldest one's age (``docs/outbox.md``).
    """
    path = existing_journal_dir(journal)
    out = consistent(path, lambda compacted: _counts(path, compacted))
    out["forwarder"] = _forwarder_holder(path)
    segments, size = segment_usage(path)
    out["journal"] = {"path": path, "segments": segments, "bytes": size}
    if redis_url is not None:
        out["redis"] = {"url": redact_url(redis_url), **_redis_state(redis_url)}
    if outbox is not None:
        backlog = read_backlog(outbox, outbox_table)
        out["outbox"] = {
            "dsn": redact_url(outbox),
            "table": outbox_table,
            "rows": backlog.rows,
            "oldest_age_s": backlog.oldest_age_s(),
        }
    return out


def _counts(path: str, compacted: Compacted) -> dict[str, Any]:
    """Every count of the status object, from the journal, the ledger and the checkpoint."""
    segments = [(w, i) for w, indices in list_chains(path).items() for i in indices]
    live = [seg for seg in segments if not compacted.is_compacted(seg)]
    # Segments whose deletion a crash interrupted are counted in `compacted` already.
    leftover = sum(sealed_data_count(path, w, i) or 0 for w, i in segments if compacted.is_compacted((w, i)))
    checkpoint = load_checkpoint(path)
    index = load_index(path, compacted)
    scan = _scan_pending(path, compacted, index, checkpoint.positions if checkpoint else {})
    accepted = compacted.accepted + scan.records - leftover
    waiting = scan.not_forwarded
    counts = index.counts(live)
    succeeded = compacted.succeeded + counts["succeeded"]
    # Records that are not jobs are terminal too (skipped, logged): they count as failed.
    failed = compacted.failed + counts["failed"] + compacted.invalid + counts["invalid"]
    suppressed = compacted.dups + counts["dups"]
    cancelled = compacted.cancelled + counts["cancelled"]
    return {
        "accepted": accepted,
        "forwarded": checkpoint.forwarded if checkpoint else 0,
        "succeeded": succeeded,
        "failed": failed,
        "pending": accepted - succeeded - failed - cancelled,
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
    path: str, compacted: Compacted, index: LedgerIndex, positions: Mapping[str, ChainPosition]
) -> _Scan:
    """One pass over the live journal: counts, and what is pending where and since when.

    Only records that are not terminal are decoded, so the cost follows the backlog, not the
    journal's size.
    """
    out = _Scan()
    for record in JournalReader(path).records():
        if record.rtype != RecordType.DATA or compacted.is_compacted(
            (record.writer_id, record.segment_index)
        ):
            continue
        out.records += 1
        forwarded = record.consumed_by(positions)
        out.not_forwarded += not forwarded
        if index.is_terminal((record.writer_id, record.segment_index, record.offset)):
            continue
        try:
            body = json.loads(record.payload)
            queue, created = str(body["queue"]), float(body["created_at"])
        except (ValueError, KeyError, TypeError, OverflowError):
            continue  # not a job: the forwarder records it as invalid (terminal) when it reads it
        out.queues[queue] = out.queues.get(queue, 0) + 1
        out.oldest_pending = created if out.oldest_pending is None else min(out.oldest_pending, created)
        if not forwarded and (out.oldest_unforwarded is None or created < out.oldest_unforwarded):
            out.oldest_unforwarded = created
    return out


def _age(since: float | None) -> float:
    """Seconds since ``since`` (0 when there is nothing)."""
    return 0.0 if since is None else round(max(0.0, time.time() - since), 3)


def _forwarder_holder(path: str) -> str | None:
    """Who holds the forwarder lock, or ``None`` when no forwarder runs."""
    return lock_owner(os.path.join(path, LOCK_NAME))


def _redis_state(url: str) -> dict[str, Any]:
    """Whether Redis is ``up``, and how many jobs are ``waiting_for_a_worker``.

    The jobs a worker recently left because it cannot run them (not importable there, or not
    allowed: see :mod:`hybridq.waiting`); ``None`` while Redis is down.
    """
    from redis.exceptions import RedisError  # noqa: PLC0415

    from hybridq import waiting  # noqa: PLC0415
    from hybridq.errors import TransportError  # noqa: PLC0415
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415 - only when Redis is asked for

    transport = RQTransport(url, socket_timeout_s=1.0)
    try:
        transport.ping()
        return {"up": True, "waiting_for_a_worker": waiting.current(transport.connection, limit=0).count}
    except (TransportError, RedisError):
        return {"up": False, "waiting_for_a_worker": None}
    finally:
        transport.close()


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` as its credentials' password (the user, if any, is kept)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    netloc = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
