"""What ``hybridq status`` reports (:func:`stats`), from the journal, the ledger and the checkpoint.

:func:`stats` reads the figures the forwarder saves with each step (:mod:`hybridq.lookup.stats`)
and the journal after them; :func:`collect_status` (``stats(exact=True)``) scans everything.

Redis is optional: every contract field comes from durable state on this host, so the answer is
the same whether Redis is up, down or freshly emptied.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from hybridq.cancels import pending_cancels, read_requests
from hybridq.errors import ConfigError, JournalCorruption
from hybridq.journal import ChainPosition, JournalReader, RecordType
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.paths import default_journal, existing_journal_dir
from hybridq.journal.reader import journal_usage, list_chains
from hybridq.ledger.checkpoint import forwarder_holder, load_checkpoint
from hybridq.ledger.compacted import Compacted, consistent, load_compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import ledger_dir, load_index
from hybridq.lookup.stats import checkpoint_file, job_fields, ledger_chains, ledger_tail, load_snapshot
from hybridq.ops.fleet import fleet
from hybridq.ops.limit_stats import fair_figures, limit_figures
from hybridq.ops.window_stats import window_figures
from hybridq.outbox.backlog import read_backlog
from hybridq.outbox.schema import DEFAULT_TABLE
from hybridq.security.secretfile import read_password
from hybridq.transport.redisurl import redact_url, with_password
from hybridq.transport.routes import ENV_VAR as REDIS_FOR_VAR
from hybridq.transport.routes import Routes, parse_redis_for, split_env
from hybridq.workflows.store import counts as workflow_counts

# read_password lives in hybridq.security.secretfile (the worker side uses it too), redact_url and
# with_password in hybridq.transport.redisurl; all kept importable here.
__all__ = [
    "CONTRACT_FIELDS",
    "FROM_ENV",
    "collect_status",
    "read_password",
    "redact_url",
    "stats",
    "with_password",
]

#: The fields ``status --json`` promises (integers; docs/cli.md).
CONTRACT_FIELDS = ("accepted", "forwarded", "succeeded", "failed", "pending", "duplicates_suppressed")


class _Env(enum.Enum):
    """The default of an argument :func:`stats` takes from the environment when it is left out."""

    FROM_ENV = "as hybridq status: from the environment"


#: :func:`stats`'s default for ``redis_url``, ``outbox`` and ``redis_for``: what ``hybridq status``
#: would take (``HYBRIDQ_REDIS_URL`` and ``HYBRIDQ_REDIS_PASSWORD_FILE``, ``HYBRIDQ_OUTBOX``,
#: ``HYBRIDQ_REDIS_FOR``), so that ``stats()`` and ``status --json`` agree in one environment.
FROM_ENV: Final = _Env.FROM_ENV


def stats(
    journal: str | os.PathLike[str] | None = None,
    *,
    redis_url: str | _Env | None = FROM_ENV,
    outbox: str | _Env | None = FROM_ENV,
    outbox_table: str | None = None,
    exact: bool = False,
    redis_for: Mapping[str, str] | _Env | None = FROM_ENV,
    all: bool = False,  # noqa: A002 - stats(all=True) reads as what it does
) -> dict[str, Any]:
    """What ``hybridq status --json`` prints, cheaply enough for a health endpoint.

    With ``all``, what ``hybridq status --all --json`` prints instead: every forwarder that
    publishes its stats to ``redis_url`` (each with its journal's counts, backlog, oldest waiting
    job and when it was last seen, ``stale`` when it stopped publishing), and their totals
    (docs/operations.md, "One view of many journals"); ``journal`` and the rest are not read.

    What is left out comes from the environment, as ``hybridq status`` takes it: the journal
    from ``HYBRIDQ_JOURNAL``, the Redis to ask from ``HYBRIDQ_REDIS_URL`` (and its password from
    ``HYBRIDQ_REDIS_PASSWORD_FILE``), the outbox from ``HYBRIDQ_OUTBOX`` (``HYBRIDQ_OUTBOX_TABLE``),
    the other Redis instances from ``HYBRIDQ_REDIS_FOR``. ``None`` leaves a part out whatever the
    environment says (``redis_url=None``: Redis is never asked).

    The counts come from the figures the forwarder saves with each checkpoint, plus the journal
    records it has not read yet; without them (no forwarder ever ran here, or a compaction or
    another process's ledger write since), or with ``exact``, from a full scan of the journal
    and the ledger. Both give the same answer once the forwarder has taken its step (docs/api.md,
    "Stats for a health endpoint").

    Args:
        journal: the journal directory.
        redis_url: also report whether this Redis answers (the ``redis`` key).
        outbox: a transactional outbox's DSN: also its backlog (the ``outbox`` key).
        outbox_table: the outbox's table.
        exact: always scan (what ``hybridq status --exact`` does).
        all: every forwarder's published snapshot instead of one journal (needs ``redis_url``).
        redis_for: queues kept on other Redis instances (queue → URL, ``--redis-for``): also
            each instance's state and queue lengths (the ``redis_instances`` key).

    Raises:
        ConfigError: no ``journal`` and no ``HYBRIDQ_JOURNAL``; with ``all``, no Redis URL.
        TransportError: with ``all``, Redis does not answer.
    """
    if all:
        return _all(redis_url)
    path = existing_journal_dir(default_journal() if journal is None else journal)
    if redis_url is FROM_ENV:
        redis_url = _env_redis_url()
    if outbox is FROM_ENV:
        outbox = os.environ.get("HYBRIDQ_OUTBOX") or None
    outbox_table = outbox_table or os.environ.get("HYBRIDQ_OUTBOX_TABLE") or DEFAULT_TABLE
    if redis_for is FROM_ENV:
        redis_for = parse_redis_for(split_env(os.environ.get(REDIS_FOR_VAR, "")))
    holder = forwarder_holder(path)
    out = None if exact else _from_snapshot(path, running=holder is not None)
    if out is None:
        out = consistent(path, lambda compacted: _counts(path, compacted))
    out["forwarder"] = holder
    snapshot = load_snapshot(path)
    out.update(window_figures(path, snapshot, exact=exact))
    out.update(limit_figures(path, snapshot))
    out.update(fair_figures(path, snapshot))
    segments, size, disk = journal_usage(path)  # disk: the blocks held (docs/cli.md, status --json)
    out["journal"] = {"path": path, "segments": segments, "bytes": size, "disk_bytes": disk}
    flows = workflow_counts(path)
    if flows:  # docs/workflows.md: running, succeeded, failed, cancelled, waiting_on_deps
        out["workflows"] = flows
    if redis_url is not None:
        out["redis"] = {"url": redact_url(redis_url), **_redis_state(redis_url)}
    if redis_for:
        out["redis_instances"] = _instances(redis_url, redis_for)
    if outbox is not None:
        backlog = read_backlog(outbox, outbox_table)
        out["outbox"] = {
            "dsn": redact_url(outbox),
            "table": outbox_table,
            "rows": backlog.rows,
            "oldest_age_s": backlog.oldest_age_s(),
            "set_aside": backlog.set_aside,
        }
    return out


def _all(redis_url: str | _Env | None) -> dict[str, Any]:
    """``stats(all=True)``: the published snapshots on ``redis_url`` (``HYBRIDQ_REDIS_URL``)."""
    url = _env_redis_url() if redis_url is FROM_ENV else redis_url
    if not isinstance(url, str):
        raise ConfigError("stats(all=True) reads Redis: give redis_url= (or set HYBRIDQ_REDIS_URL)")
    return fleet(url)


def collect_status(
    journal: str,
    *,
    redis_url: str | None = None,
    outbox: str | None = None,
    outbox_table: str = DEFAULT_TABLE,
) -> dict[str, Any]:
    """The status object of ``hybridq status --json``, from a full scan (``stats(exact=True)``).

    With ``outbox`` (a DSN), also the transactional outbox's backlog: its committed rows the
    relay has not moved into the journal yet, and the oldest one's age (``docs/outbox.md``).
    """
    return stats(
        journal, redis_url=redis_url, outbox=outbox, outbox_table=outbox_table, exact=True, redis_for=None
    )


def _from_snapshot(path: str, *, running: bool = False) -> dict[str, Any] | None:
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


def _counts(path: str, compacted: Compacted) -> dict[str, Any]:
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


def _env_redis_url() -> str | None:
    """``HYBRIDQ_REDIS_URL`` with the password in ``HYBRIDQ_REDIS_PASSWORD_FILE``, as ``--redis`` takes it."""
    url = os.environ.get("HYBRIDQ_REDIS_URL") or None
    password_file = os.environ.get("HYBRIDQ_REDIS_PASSWORD_FILE")
    return with_password(url, read_password(password_file)) if url and password_file else url


def _age(since: float | None) -> float:
    """Seconds since ``since`` (0 when there is nothing)."""
    return 0.0 if since is None else round(max(0.0, time.time() - since), 3)


def _instances(default: str | None, redis_for: Mapping[str, str]) -> list[dict[str, Any]]:
    """Per Redis instance: its URL, the queues it holds, whether it is up, its queues' lengths.

    ``queues``: the queues mapped to it, and ``"*"`` (every other queue) for the default one;
    ``queued``: the length of each of its RQ queues that belongs there (``None`` while down).
    """
    routes = Routes(default or "", redis_for)
    urls = routes.urls if default is not None else sorted(set(redis_for.values()))
    out: list[dict[str, Any]] = []
    for url in urls:
        queues = routes.queues_on(url) + (["*"] if url == default else [])
        state = _redis_state(url, owns=functools.partial(_lives_on, routes, url))
        out.append({"url": redact_url(url), "queues": queues, **state})
    return out


def _lives_on(routes: Routes, url: str, queue: str) -> bool:
    return routes.url_for(queue) == url


def _redis_state(url: str, *, owns: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Whether Redis is ``up``, and how many jobs are ``waiting_for_a_worker``.

    ``refused``, only when Redis answers but refuses this URL: why (``redisurl.refusal``).

    The jobs a worker recently left because it cannot run them (not importable there, or not
    allowed: see :mod:`hybridq.worker.waiting`); ``None`` while Redis is down. With ``owns`` (which
    queues live on this Redis), also ``queued``: the length of each of those RQ queues.
    """
    from redis.exceptions import RedisError  # noqa: PLC0415

    from hybridq.errors import TransportError  # noqa: PLC0415
    from hybridq.transport.redisurl import refusal  # noqa: PLC0415
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415 - only when Redis is asked for
    from hybridq.worker import waiting  # noqa: PLC0415

    transport = RQTransport(url, socket_timeout_s=1.0)
    try:
        transport.ping()
        state: dict[str, Any] = {
            "up": True,
            "waiting_for_a_worker": waiting.current(transport.connection, limit=0).count,
        }
        if owns is not None:
            state["queued"] = _queue_lengths(transport.connection, owns)
    except (TransportError, RedisError) as exc:
        state = {"up": False, "waiting_for_a_worker": None}
        why = refusal(exc.__cause__ or exc)
        if why is not None:  # it answered, but refuses this URL (a password missing from it, ...)
            state["refused"] = why
        if owns is not None:
            state["queued"] = None
    finally:
        transport.close()
    return state


def _queue_lengths(conn: Any, owns: Callable[[str], bool]) -> dict[str, int]:
    """The length of every RQ queue Redis knows that ``owns`` says lives there."""
    from hybridq.protocol import keys  # noqa: PLC0415

    prefix = keys.rq_queue("")
    names = sorted(
        name
        for raw in conn.smembers(keys.rq_queues())
        if (name := (raw.decode() if isinstance(raw, bytes) else str(raw)).removeprefix(prefix))
        and owns(name)
    )
    return {name: int(conn.llen(keys.rq_queue(name))) for name in names}
