"""``hybridq doctor``: compare the journal and ledger with what Redis holds, and fix what is lost."""

from __future__ import annotations

import json
from typing import Any

import click

from hybridq.cli.options import (
    EXIT_FINDINGS,
    _fail,
    check_outbox_option,
    journal_option,
    outbox_options,
    redis_for_option,
    redis_option,
    shown,
)
from hybridq.errors import HybridqError
from hybridq.protocol import DEFAULT_LEASE_S


@click.command()
@journal_option
@redis_option
@redis_for_option
@click.option(
    "--fix",
    is_flag=True,
    help="Deliver again the jobs Redis lost (missing) or no worker will take (stranded).",
)
@click.option(
    "--lease",
    "lease_s",
    type=click.FloatRange(0.5, 3600),
    default=DEFAULT_LEASE_S,
    show_default=True,
    help="The forwarder's --lease.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@outbox_options
@click.pass_context
def doctor(
    ctx: click.Context,
    journal: str,
    redis_url: str,
    fix: bool,
    lease_s: float,
    as_json: bool,
    redis_for: dict[str, str],
    outbox_dsn: str | None,
    outbox_table: str,
) -> None:
    """Compare the journal and ledger with what Redis holds: is anything lost or stuck?

    Reports forwarded jobs Redis no longer has (missing), jobs no worker will take (stranded),
    jobs whose worker died mid-task (orphaned: the forwarder re-delivers them by itself),
    duplicate queue entries, jobs in RQ's intermediate lists, this forwarder's jobs queued in
    Redis that the journal does not have as pending (unknown), queues where jobs wait that no
    registered RQ worker serves (unserved), job ids shared by different calls (merged: only
    the first runs), and unfinished jobs while no forwarder holds the journal (unattended:
    nothing moves them on until one starts). With --outbox, also the outbox rows the relay set
    aside (bad rows it cannot append; docs/outbox.md). A dry run unless --fix. With --redis-for
    QUEUE=URL, every Redis instance is checked, each for its own queues (an unreachable one:
    exit 1, naming it).
    Exit 0 when healthy, 4 when it found something (after fixing it, with --fix).

    \b
    Examples:
      hybridq doctor --journal /var/lib/hybridq/journal --redis redis://127.0.0.1:6379/0
      hybridq doctor --fix
    """
    from hybridq.ops.doctor import diagnose  # noqa: PLC0415
    from hybridq.transport.routes import Routes  # noqa: PLC0415
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415
    from hybridq.transport.sharded import ShardedTransport  # noqa: PLC0415

    if outbox_dsn is not None:
        check_outbox_option(ctx, outbox_dsn, outbox_table)
    routes = Routes(redis_url, redis_for)
    transport = ShardedTransport(routes) if routes.sharded else RQTransport(redis_url)
    try:
        report = diagnose(journal, transport, lease_s=lease_s, fix=fix)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    finally:
        transport.close()
    if outbox_dsn is not None:
        _doctor_outbox(ctx, report, outbox_dsn, outbox_table)
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        if report.unattended:
            click.echo(_unattended_line(report.unattended, journal))
        click.echo(f"checked {report.checked} forwarded, unfinished job(s): {_counted(report.verdicts)}")
        for name in ("missing", "stranded", "orphaned", "intermediate", "unknown"):
            ids: list[str] = getattr(report, name)
            if ids:
                more = f" (+{len(ids) - 10} more)" if len(ids) > 10 else ""
                click.echo(f"{name}: {len(ids)}: {' '.join(ids[:10])}{more}")
        if report.duplicate_entries:
            entries = ", ".join(f"{job_id} ({n} times)" for job_id, n in report.duplicate_entries.items())
            click.echo(f"duplicate queue entries: {entries}")
        if report.unserved:
            waiting = ", ".join(f"{q} ({n} waiting)" for q, n in report.unserved.items())
            click.echo(f"queues no worker serves: {waiting}")
        if report.merged:
            click.echo(
                f"job ids shared by different calls (only the first runs): {' '.join(report.merged[:10])}"
            )
        for w in report.waiting[:10]:
            line = f"waiting for a worker that can run it: {w.get('id')} ({w.get('func')}): {w.get('reason')}"
            click.echo(shown(line.replace("\n", " ")))  # a worker wrote it, or anyone who writes to Redis
        if report.outbox_set_aside:
            rows = "; ".join(
                f"id {r['id']} job {r['job_id']}: {r['why']}" for r in report.outbox_set_aside_rows
            )
            click.echo(
                shown(
                    f"outbox rows set aside: {report.outbox_set_aside}: {rows} (docs/outbox.md, 'Bad rows')"
                )
            )
        for line in report.redis_memory:
            click.echo(line)
        for line in report.limit_waits:
            click.echo(shown(line))
        if fix:
            click.echo(f"fixed: {report.fixed} job(s) delivered again")
        click.echo("healthy" if report.healthy else "problems found")
    if not report.healthy:
        ctx.exit(EXIT_FINDINGS)


def _counted(counts: dict[str, int]) -> str:
    """``{"queued": 9, "stranded": 1}`` in words: ``9 queued, 1 stranded`` (``none`` if empty)."""
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def _unattended_line(jobs: int, journal: str) -> str:
    """What ``doctor`` says when no forwarder holds the journal while jobs in it are unfinished."""
    return (
        f"no forwarder holds this journal: {jobs} unfinished job(s) wait until one runs "
        f"(hybridq forward --journal {journal}; docs/forwarder.md)"
    )


def _doctor_outbox(ctx: click.Context, report: Any, dsn: str, table: str) -> None:
    """The outbox part of ``doctor`` (hybridq.ops.doctor.check_outbox); its driver's error in one line."""
    from hybridq.ops.doctor import check_outbox  # noqa: PLC0415
    from hybridq.transport.redisurl import redact_url  # noqa: PLC0415

    try:
        check_outbox(report, dsn, table)
    except Exception as exc:  # the database driver's own error: locked, no right, ...
        _fail(ctx, RuntimeError(f"outbox {redact_url(dsn)}: {exc}"))
