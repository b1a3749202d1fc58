"""What ``hybridq status`` reports (:func:`stats`), from the journal, the ledger and the checkpoint.

:func:`stats` reads the figures the forwarder saves with each step (:mod:`hybridq.lookup.stats`)
and the journal after them; :func:`collect_status` (``stats(exact=True)``) scans everything.
The counting is :mod:`hybridq.ops.status_counts`'s, what Redis says :mod:`hybridq.ops.status_redis`'s:
this module puts the status object together.

Redis is optional: every contract field comes from durable state on this host, so the answer is
the same whether Redis is up, down or freshly emptied.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any, Final

from hybridq.errors import ConfigError
from hybridq.journal.paths import default_journal, existing_journal_dir
from hybridq.journal.reader import journal_usage
from hybridq.ledger.checkpoint import forwarder_holder
from hybridq.ledger.compacted import consistent
from hybridq.lookup.stats import load_snapshot
from hybridq.ops.fleet import fleet
from hybridq.ops.limit_stats import fair_figures, limit_figures
from hybridq.ops.status_counts import from_snapshot, scan_counts
from hybridq.ops.status_redis import env_redis_url, instances, redis_state
from hybridq.ops.window_stats import window_figures
from hybridq.outbox.backlog import read_backlog
from hybridq.outbox.schema import DEFAULT_TABLE
from hybridq.security.secretfile import read_password
from hybridq.transport.redisurl import redact_url, with_password
from hybridq.transport.routes import ENV_VAR as REDIS_FOR_VAR
from hybridq.transport.routes import parse_redis_for, split_env
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
        redis_url = env_redis_url()
    if outbox is FROM_ENV:
        outbox = os.environ.get("HYBRIDQ_OUTBOX") or None
    outbox_table = outbox_table or os.environ.get("HYBRIDQ_OUTBOX_TABLE") or DEFAULT_TABLE
    if redis_for is FROM_ENV:
        redis_for = parse_redis_for(split_env(os.environ.get(REDIS_FOR_VAR, "")))
    holder = forwarder_holder(path)
    out = None if exact else from_snapshot(path, running=holder is not None)
    if out is None:
        out = consistent(path, lambda compacted: scan_counts(path, compacted))
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
        out["redis"] = {"url": redact_url(redis_url), **redis_state(redis_url)}
    if redis_for:
        out["redis_instances"] = instances(redis_url, redis_for)
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
    url = env_redis_url() if redis_url is FROM_ENV else redis_url
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
