"""``hybridq cancel``: cancel jobs by id (durable at once; the forwarder acts on it)."""

from __future__ import annotations

import json

import click

from hybridq.cli.options import EXIT_ERROR, _fail, journal_option
from hybridq.errors import HybridqError


@click.command()
@journal_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per id.")
@click.argument("job_ids", nargs=-1, required=True)
@click.pass_context
def cancel(ctx: click.Context, journal: str, as_json: bool, job_ids: tuple[str, ...]) -> None:
    """Cancel jobs: a queued or held one never runs, a running one is asked to stop.

    One line per JOB_ID says what happened. Exit 0 if every job is cancelled (now, or already);
    1 if any was not (it had finished or failed already, or is unknown): the others are
    cancelled all the same. Needs neither Redis nor a running forwarder (docs/api.md).

    \b
    Example:
      hybridq cancel 01a22d5981129cc616500e5c84939d91 --journal ./hybridq-journal
    """
    from hybridq.cancels import CANCELLED, REQUESTED, cancel  # noqa: PLC0415

    try:
        results = cancel(job_ids, journal)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    for r in results:
        if as_json:
            click.echo(json.dumps({"id": r.id, "state": r.state, "message": r.message}))
        else:
            click.echo(f"{r.id}: {r.message}")
    if any(r.state not in (REQUESTED, CANCELLED) for r in results):
        ctx.exit(EXIT_ERROR)
