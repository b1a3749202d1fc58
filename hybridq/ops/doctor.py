"""``hybridq doctor``: compare what the journal and ledger say with what Redis holds.

Answers "is anything lost or stuck?" for one journal directory:

* **missing**: forwarded, not terminal, and Redis has no such job (``--fix`` pushes it again);
* **stranded**: Redis says queued but it is in no queue, or a worker took it and died before
  starting it (``--fix`` replaces it and queues it again, the same attempt);
* **orphaned**: its task started and its worker's lease lapsed (the forwarder delivers the next
  attempt by itself; the doctor reports it);
* **duplicate queue entries**: one job id more than once in an RQ queue list;
* **in RQ's intermediate lists**: taken by a worker and not started (normally for milliseconds);
* **unknown**: hybridq jobs of this forwarder queued in Redis that the journal does not have
  as pending (finished already, or from a journal that was replaced);
* **waiting for a worker**: pending jobs a worker recently left because it cannot run them (the
  task does not import there, or no ``--allow`` covers it; :mod:`hybridq.worker.waiting`), with why.
* **unserved**: queues where this journal's jobs wait and no registered RQ worker listens;
* **merged**: job ids that several records share with *different* calls (an explicit
  ``job_id`` reused): the first delivered runs, the others are merged into it and never run.
  The same call under the same id (a retried enqueue) is deduplication, not a finding.
* **unattended**: no forwarder holds the journal (stopped, killed, never started) while jobs in
  it are unfinished: nothing forwards them, delivers their retries or records their outcomes
  until one starts. Without a checkpoint (no forwarder ever ran) it is the only check.
* **outbox rows set aside** (with an outbox, :func:`check_outbox`): bad rows the relay could not
  append to the journal, which wait for an operator (``docs/outbox.md``, "Bad rows").

A dry run by default: nothing is written unless ``fix`` is true. The forwarder may keep running
meanwhile (pushes are idempotent per job id).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from hybridq.cancels import read_requests
from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError
from hybridq.job import call_fingerprint
from hybridq.journal import ChainPosition, JournalReader, RecordType
from hybridq.journal.paths import existing_journal_dir
from hybridq.journal.records import Loc
from hybridq.ledger.checkpoint import forwarder_holder, load_checkpoint
from hybridq.ledger.compacted import Compacted, load_compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index
from hybridq.lookup.stats import load_snapshot
from hybridq.ops.limit_stats import long_waits
from hybridq.ops.window_stats import waiting_in_journal, window_figures
from hybridq.outbox.backlog import read_set_aside
from hybridq.protocol import DEFAULT_LEASE_S, ENTRY_POINT, Overwrite, keys
from hybridq.transport.base import Delivery, Probe
from hybridq.transport.redisurl import redact_url, transport_error
from hybridq.transport.rq import RQTransport
from hybridq.transport.rq_codec import plain_data
from hybridq.transport.sharded import ShardedTransport
from hybridq.worker import waiting

__all__ = ["DoctorReport", "check_outbox", "diagnose"]

#: Jobs probed per round trip.
BATCH = 1000
#: Ids listed per finding (the counts are always complete).
EXAMPLES = 10
#: An OOM reply to a push this recent is a finding (seconds).
OOM_RECENT_S = 600.0
#: Jobs read from the waiting list (hybridq.worker.waiting).
WAITING_LIMIT = 1000


@dataclass
class DoctorReport:
    """What :func:`diagnose` found (and, with ``fix``, did)."""

    checked: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    stranded: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)
    duplicate_entries: dict[str, int] = field(default_factory=dict)
    intermediate: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    unserved: dict[str, int] = field(default_factory=dict)
    merged: list[str] = field(default_factory=list)
    #: Pending jobs a worker left because it cannot run them: id, func, queue, reason, worker, at.
    waiting: list[dict[str, Any]] = field(default_factory=list)
    fixed: int = 0
    #: With several Redis: per instance (URL, redacted), its queues of checked jobs and their count.
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Who holds the journal's forwarder lock (``"forwarder pid N on HOST"``); ``None``: none runs.
    forwarder: str | None = None
    #: While no forwarder runs: the unfinished jobs in the journal (nothing moves them on).
    unattended: int = 0
    #: With an outbox: its rows the relay set aside, and the first few (id, job_id, created_at, why).
    outbox_set_aside: int = 0
    outbox_set_aside_rows: list[dict[str, Any]] = field(default_factory=list)
    #: Redis answered OOM to the forwarder's push within :data:`OOM_RECENT_S` (pushes paused,
    #: jobs wait in the journal): ``"... N s ago"``; or its maxmemory-policy may evict keys.
    redis_memory: list[str] = field(default_factory=list)
    #: Limit keys whose jobs waited with no room for long (a finding to read, not a fault: the
    #: limit may be meant; it leaves ``healthy`` as it is).
    limit_waits: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        """Nothing missing, stranded, orphaned, duplicated, unknown, unserved, merged, waiting, unattended."""
        return not (
            self.unattended
            or self.missing
            or self.stranded
            or self.orphaned
            or self.duplicate_entries
            or self.unknown
            or self.unserved
            or self.merged
            or self.waiting
            or self.outbox_set_aside
            or self.redis_memory
        )

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON object (id lists are complete)."""
        out = dataclasses.asdict(self)
        out["healthy"] = self.healthy
        return out


def diagnose(
    journal: str,
    transport: RQTransport | ShardedTransport,
    *,
    lease_s: float = DEFAULT_LEASE_S,
    fix: bool = False,
) -> DoctorReport:
    """Compare ``journal`` with Redis; with ``fix``, re-deliver missing and stranded jobs.

    ``transport``: one Redis, or several (:class:`ShardedTransport`): each is inspected for the
    queues that live on it; ``report.instances`` says, per Redis, which queues it holds and how
    many of the checked jobs are there.
    """
    path = existing_journal_dir(journal)
    checkpoint = load_checkpoint(path)
    compacted = load_compacted(path)
    index = load_index(path, compacted, keys=False)
    report = DoctorReport()
    _find_unattended(path, compacted, index, report)
    report.redis_memory = memory_findings(path)
    report.limit_waits = long_waits(path, load_snapshot(path))
    if checkpoint is None:
        return report  # no forwarder ever ran here: Redis holds none of this journal's jobs
    pending: dict[str, tuple[Loc, Envelope]] = {}
    batch: list[tuple[Loc, Envelope]] = []
    for loc, env in _forwarded_pending(path, checkpoint.positions, index, compacted):
        pending[env.id] = (loc, env)
        batch.append((loc, env))
        if len(batch) >= BATCH:
            _probe(transport, batch, lease_s, report)
            batch = []
    _probe(transport, batch, lease_s, report)
    listed: list[dict[str, Any]] = []
    for url, part, owns in _instances(transport):
        queues = {env.queue for _, env in pending.values() if owns(env.queue)}
        try:
            _inspect_queues(part, queues, pending, checkpoint.owner, report, owns=owns)
            listed += waiting.current(part.connection, limit=WAITING_LIMIT).examples
            report.unserved.update(_unserved(part, queues))
        except RedisError as exc:
            error = transport_error(exc)
            raise type(error)(f"{redact_url(url)}: {error}") from exc
        if isinstance(transport, ShardedTransport):
            report.instances[redact_url(url)] = {
                "queues": sorted(queues),
                "checked": sum(1 for _, env in pending.values() if owns(env.queue)),
            }
    report.waiting = [w for w in listed if w.get("id") in pending]  # not run by another since
    report.merged = merged_ids(path, compacted, set(pending))
    if fix:
        redo = [
            Delivery(
                env,
                checkpoint.owner,
                loc,
                attempt=index.attempts(loc) + 1,
                overwrite=Overwrite.ALWAYS if job_id in report.stranded else Overwrite.NEVER,
                lease_s=lease_s,
                # The forwarder's current generation: claims refuse an older one (the epoch fence).
                gen=checkpoint.generation,
            )
            for job_id in report.missing + report.stranded
            for loc, env in [pending[job_id]]
        ]
        for start in range(0, len(redo), BATCH):
            result = transport.push(redo[start : start + BATCH])
            report.fixed += result.pushed
    return report


def memory_findings(path: str) -> list[str]:
    """What the forwarder's last snapshot says of Redis's memory that needs an operator."""
    memory = window_figures(path, load_snapshot(path))["redis_memory"]
    if memory is None:
        return []
    out: list[str] = []
    age = memory["last_oom_age_s"]
    if age is not None and age <= OOM_RECENT_S:
        out.append(
            f"Redis answered OOM to a push {age:.0f} s ago (used {memory['used']} of "
            f"{memory['maxmemory']} bytes): pushes pause and jobs wait in the journal; something "
            "else fills Redis, or --redis-high-water is too high (docs/deploy.md, sizing Redis)"
        )
    if memory["maxmemory"] and memory["policy"] not in (None, "noeviction"):
        out.append(
            f"Redis's maxmemory-policy is {memory['policy']}: at its limit it may evict leases and "
            "stored outcomes (a job may run twice); noeviction is what a queue needs"
        )
    return out


def _find_unattended(path: str, compacted: Compacted, index: LedgerIndex, report: DoctorReport) -> None:
    """Who holds the forwarder lock; if nobody, how many jobs of the journal are unfinished.

    The kernel drops the lock when its holder dies, so a free lock means no forwarder runs.
    Every unfinished job then waits: one not forwarded yet stays in the journal, a retry is
    never delivered, and an outcome a worker stored in Redis is never recorded in the ledger
    (``job.wait()`` never returns). Counted only then: it reads the whole live journal.
    """
    report.forwarder = forwarder_holder(path)
    if report.forwarder is not None:
        return
    for record in JournalReader(path).records():
        segment = (record.writer_id, record.segment_index)
        if record.rtype == RecordType.DATA and not compacted.is_compacted(segment):
            report.unattended += not index.is_terminal((*segment, record.offset))


def check_outbox(report: DoctorReport, dsn: str, table: str) -> None:
    """Add the outbox's rows set aside to ``report`` (a finding: they wait for an operator).

    Raises what :func:`hybridq.outbox.backlog.read_set_aside` raises (a bad DSN, no database).
    """
    aside = read_set_aside(dsn, table, limit=EXAMPLES)
    report.outbox_set_aside = aside.count
    report.outbox_set_aside_rows = aside.rows


def _forwarded_pending(
    path: str, positions: Mapping[str, ChainPosition], index: LedgerIndex, compacted: Compacted
) -> Iterator[tuple[Loc, Envelope]]:
    """Forwarded jobs that are not terminal, not waiting for a retry, not held, not cancelled."""
    # A cancel in the ledger or still in a request file: never delivered again (the forwarder
    # settles it once no worker holds its lease).
    cancelled = set(index.cancels) | {loc for _path, jobs in read_requests(path) for _id, loc in jobs}
    waiting_here = waiting_in_journal(path)
    for record in JournalReader(path).records():
        if record.rtype != RecordType.DATA or compacted.is_compacted(
            (record.writer_id, record.segment_index)
        ):
            continue
        loc = (record.writer_id, record.segment_index, record.offset)
        if not record.consumed_by(positions):
            continue  # not forwarded yet: the forwarder's backlog, not Redis's business
        if index.is_terminal(loc) or loc in index.retries or loc in index.duplicates or loc in cancelled:
            continue  # a duplicate is never pushed: it waits for its key's owner
        if waiting_here(loc):
            continue  # read into the backlog, waiting for room in the window: never pushed
        try:
            env = Envelope.from_bytes(record.payload)
        except EnvelopeError:
            continue
        if env.run_at is not None and env.run_at > time.time():
            continue
        yield loc, env


def _probe(
    transport: RQTransport | ShardedTransport,
    batch: list[tuple[Loc, Envelope]],
    lease_s: float,
    report: DoctorReport,
) -> None:
    if not batch:
        return
    verdicts = transport.probe([Probe(env.id, env.key_id, env.queue) for _, env in batch], lease_s=lease_s)
    for (_, env), verdict in zip(batch, verdicts, strict=True):
        report.checked += 1
        word = str(verdict)  # a Verdict is a StrEnum: its word, not its repr, in the report
        report.verdicts[word] = report.verdicts.get(word, 0) + 1
        if verdict in ("missing", "stranded", "orphaned"):
            getattr(report, verdict).append(env.id)


def _inspect_queues(
    transport: RQTransport,
    queues: set[str],
    pending: dict[str, tuple[Loc, Envelope]],
    owner: str,
    report: DoctorReport,
    *,
    owns: Callable[[str], bool] = lambda _queue: True,
) -> None:
    conn = transport.connection
    known = {_text(q) for q in conn.smembers(keys.rq_queues())}
    names = queues | {name for q in known if owns(name := q.removeprefix(keys.rq_queue("")))}
    for name in sorted(names):
        ids = [_text(i) for i in conn.lrange(keys.rq_queue(name), 0, -1)]
        seen: dict[str, int] = {}
        for job_id in ids:
            seen[job_id] = seen.get(job_id, 0) + 1
        report.duplicate_entries.update({j: n for j, n in seen.items() if n > 1})
        report.intermediate += [_text(i) for i in conn.lrange(keys.rq_intermediate(name), 0, -1)]
        strangers = [j for j in seen if j not in pending]
        for job_id, raw in zip(strangers, _job_data(conn, strangers), strict=True):
            if raw is not None and raw[0] == ENTRY_POINT and raw[2] and raw[2][0].get("owner") == owner:
                report.unknown.append(job_id)


def _instances(
    transport: RQTransport | ShardedTransport,
) -> list[tuple[str, RQTransport, Callable[[str], bool]]]:
    """Per Redis: its URL, its transport, and which queues live there."""
    if not isinstance(transport, ShardedTransport):
        return [("", transport, lambda _queue: True)]
    out: list[tuple[str, RQTransport, Callable[[str], bool]]] = []
    for i, (url, part) in enumerate(zip(transport.urls, transport.shards, strict=True)):
        assert isinstance(part, RQTransport)
        out.append((url, part, functools.partial(_on_shard, transport, i)))
    return out


def _on_shard(transport: ShardedTransport, index: int, queue: str) -> bool:
    return transport.shard_of(queue) == index


def _unserved(transport: RQTransport, queues: set[str]) -> dict[str, int]:
    """Of ``queues``, those with jobs waiting and no registered RQ worker listening: {queue: n}.

    RQ registers every running worker in Redis (``rq:workers``, with its queue names) and drops
    the registration when the worker stops or stops sending heartbeats.
    """
    from rq import Worker  # noqa: PLC0415

    conn = transport.connection
    served = {name for worker in Worker.all(connection=conn) for name in worker.queue_names()}
    waiting = {name: int(conn.llen(keys.rq_queue(name))) for name in sorted(queues - served)}
    return {name: n for name, n in waiting.items() if n}


def merged_ids(path: str, compacted: Compacted, of: set[str]) -> list[str]:
    """Ids in ``of`` that several journal records share with different calls.

    Jobs that share a job id are one job (docs/enqueue.md): a record whose call differs from an
    earlier one under the same id never runs. A requeued job (a new record, ``requeue`` one
    higher) replaces its predecessor and is not merged. Compacted segments are not read.
    """
    calls: dict[tuple[str, int], set[str]] = {}
    for record in JournalReader(path).records():
        if record.rtype != RecordType.DATA or compacted.is_compacted(
            (record.writer_id, record.segment_index)
        ):
            continue
        try:
            env = Envelope.from_bytes(record.payload)
        except EnvelopeError:
            continue
        if env.id in of:
            calls.setdefault((env.id, env.requeue), set()).add(call_fingerprint(env))
    return sorted({job_id for (job_id, _), seen in calls.items() if len(seen) > 1})


def _job_data(conn: Any, job_ids: list[str]) -> list[Any]:
    pipe = conn.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(keys.rq_job(job_id), "data")
    out: list[Any] = []
    for blob in pipe.execute():
        try:
            out.append(json.loads(plain_data(blob)) if blob else None)
        except ValueError:
            out.append(None)
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
