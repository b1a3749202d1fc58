"""``hybridq failed``: jobs that failed for good (list, show, requeue)."""

from __future__ import annotations

import json
from typing import Any

import click

from hybridq.cli.options import (
    _fail,
    journal_option,
    shown,
)
from hybridq.errors import HybridqError


@click.group()
def failed() -> None:
    """Jobs that failed for good: list, show, requeue (from the ledger; Redis not needed).

    \b
    Example:
      hybridq failed list --journal ./hybridq-journal
    """


@failed.command("list")
@journal_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def failed_list(ctx: click.Context, journal: str, as_json: bool) -> None:
    """List jobs that failed for good, oldest first.

    \b
    Example:
      hybridq failed list --journal ./hybridq-journal
    """
    from hybridq.ops.failures import failed_jobs  # noqa: PLC0415

    try:
        jobs = failed_jobs(journal)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    for job in jobs:
        if as_json:
            click.echo(json.dumps(_failed_json(job)))
        else:
            error = (job.error or "").strip().splitlines()[-1:] or [""]
            click.echo(shown(f"{job.id}  {job.queue}  {job.func}  attempts={job.attempts}  {error[0][:120]}"))
    if not as_json:
        click.echo(f"{len(jobs)} failed job(s)", err=True)


@failed.command("show")
@journal_option
@click.argument("job_id")
@click.pass_context
def failed_show(ctx: click.Context, journal: str, job_id: str) -> None:
    """Show one failed job as JSON: its call, attempts and last error.

    \b
    Example:
      hybridq failed show 01a22d5981129cc616500e5c84939d91 --journal ./hybridq-journal
    """
    from hybridq.errors import JobNotFailed  # noqa: PLC0415
    from hybridq.ops.failures import failed_jobs  # noqa: PLC0415

    try:
        match = [j for j in failed_jobs(journal) if j.id == job_id]
        if not match:
            raise JobNotFailed(job_id)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    click.echo(json.dumps(_failed_json(match[-1]), indent=2))


@failed.command("requeue")
@journal_option
@click.option("--all", "requeue_all", is_flag=True, help="Requeue every listed failure.")
@click.argument("job_ids", nargs=-1)
@click.pass_context
def failed_requeue(ctx: click.Context, journal: str, requeue_all: bool, job_ids: tuple[str, ...]) -> None:
    """Accept failed jobs again (same job id, attempts start over); prints each job id.

    Nothing is requeued if any JOB_ID is not a listed failure.

    \b
    Example:
      hybridq failed requeue 01a22d5981129cc616500e5c84939d91
      hybridq failed requeue --all
    """
    from hybridq.ops.failures import failed_jobs, requeue  # noqa: PLC0415

    if bool(job_ids) == requeue_all:
        raise click.UsageError("give job ids or --all (not both)")
    try:
        ids = [j.id for j in failed_jobs(journal)] if requeue_all else list(job_ids)
        jobs = requeue(ids, journal)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    for job in jobs:
        click.echo(job.id)
    click.echo(f"requeued {len(jobs)} job(s)", err=True)


def _failed_json(job: Any) -> dict[str, Any]:
    return {
        "id": job.id,
        "func": job.func,
        "queue": job.queue,
        "attempts": job.attempts,
        "failed_at": job.failed_at,
        "error": job.error,
        "args": list(job.envelope.args) if job.envelope is not None else None,
        "kwargs": dict(job.envelope.kwargs) if job.envelope is not None else None,
    }
