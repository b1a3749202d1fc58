"""``hybridq status``: what the journal, the ledger and Redis say (``hybridq doctor``: cli/doctor.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from hybridq.cli.options import (
    EXIT_FINDINGS,
    _bad_usage,
    _fail,
    _given_journal,
    _with_password_file,
    check_outbox_option,
    make_journal_option,
    outbox_options,
    password_file_option,
    redis_for_option,
    shown,
)
from hybridq.errors import HybridqError


def _journal_unless_all(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """``--journal`` is required, except with ``--all`` (which reads Redis only)."""
    if ctx.params.get("show_all"):
        return value or ""
    return str(_given_journal(ctx, param, value))


@click.command()
@make_journal_option(_journal_unless_all, "required unless --all")
@click.option(
    "--redis",
    "redis_url",
    envvar="HYBRIDQ_REDIS_URL",
    default=None,
    show_envvar=True,
    help="Also report whether this Redis answers (optional: counts never need it); with --all, "
    "the Redis to read every forwarder's snapshot from.",
)
@password_file_option
@redis_for_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the contract in docs/cli.md).")
@click.option("--watch", is_flag=True, help="Print it again every --interval seconds until Ctrl-C.")
@click.option(
    "--interval", type=click.FloatRange(0.1, None), default=2.0, show_default=True, help="For --watch."
)
@click.option(
    "--exact",
    is_flag=True,
    help="Scan the journal and the ledger instead of reading the forwarder's figures (slower).",
)
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    is_eager=True,  # before --journal, which it makes optional
    help="Every forwarder that publishes its stats to --redis (one line each, stale ones flagged), "
    "and their totals, instead of one journal (docs/operations.md).",
)
@click.option(
    "--forget",
    "forget_owner",
    metavar="OWNER",
    default=None,
    help="With --all: remove the forwarder OWNER (as --all lists it) from the view, after scaling "
    "down; one still running reappears at its next snapshot.",
)
@outbox_options
@click.pass_context
def status(
    ctx: click.Context,
    journal: str,
    redis_url: str | None,
    redis_password_file: str | None,
    as_json: bool,
    watch: bool,
    interval: float,
    exact: bool,
    outbox_dsn: str | None,
    outbox_table: str,
    redis_for: dict[str, str],
    show_all: bool,
    forget_owner: str | None,
) -> None:
    """Show job counts from the journal, the completion ledger and the checkpoint (Redis not needed).

    Also: pending jobs per queue, the age of the oldest pending job, the forwarding lag (age of
    the oldest job not yet handed to Redis), the journal's size, with --redis whether Redis
    answers, and with --outbox the transactional outbox's backlog (rows not yet relayed into the
    journal, and the oldest one's age). With --watch --json, one JSON object per line.

    The counts are hybridq.stats(): the figures the forwarder saved at its last step, plus the
    journal records it has not read yet; --exact scans the journal and the ledger instead.

    With --redis-for QUEUE=URL (queues on other Redis instances), each instance's state and
    queue lengths too (the redis_instances key).

    With --all --redis URL: every forwarder sharing that Redis (each publishes its snapshot there
    every --stats-every seconds), with its host, journal, counts, backlog, oldest pending job
    and when it was last seen; STALE when it has not published for three intervals. Exit 4
    when one is stale. What Redis holds there is display only: anyone who can write to it can
    forge it (docs/security.md).

    \b
    Examples:
      hybridq status --json --journal ./hybridq-journal
      hybridq status --all --redis redis://127.0.0.1:6379/0
      hybridq status --watch --redis redis://127.0.0.1:6379/0
      hybridq status --outbox sqlite:////var/lib/app/app.db
    """
    from hybridq.ops.status import stats  # noqa: PLC0415

    redis_url = _with_password_file(redis_url, redis_password_file)
    if forget_owner is not None:
        _forget(ctx, redis_url if show_all else None, forget_owner)
        return
    if show_all:
        _status_all(ctx, redis_url, as_json=as_json, watch=watch, interval=interval)
        return
    if outbox_dsn is not None:
        check_outbox_option(ctx, outbox_dsn, outbox_table)
    while True:
        try:
            out = stats(
                journal,
                redis_url=redis_url,
                outbox=outbox_dsn,
                outbox_table=outbox_table,
                exact=exact,
                redis_for=redis_for,
            )
        except (HybridqError, OSError) as exc:
            _fail(ctx, exc)
        except Exception as exc:  # the outbox database's driver error (locked, ...)
            if outbox_dsn is None:
                raise
            _fail(ctx, RuntimeError(f"reading the outbox backlog: {exc}"))
        if as_json:
            click.echo(json.dumps(out))
        else:
            if watch:
                click.clear()
            _print_status(out)
        if not watch:
            return
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return


def _status_all(
    ctx: click.Context, redis_url: str | None, *, as_json: bool, watch: bool, interval: float
) -> None:
    """``status --all``: every forwarder's published snapshot; exit 4 when one is stale."""
    from hybridq.ops.fleet import fleet  # noqa: PLC0415

    if redis_url is None:
        _bad_usage(ctx, "--all reads what the forwarders publish to Redis: give --redis URL")
    while True:
        try:
            out = fleet(redis_url)
        except HybridqError as exc:
            _fail(ctx, exc)
        if as_json:
            click.echo(json.dumps(out))
        else:
            if watch:
                click.clear()
            _print_all(out)
        if not watch:
            break
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return
    if out["stale"] or out["invalid"]:
        ctx.exit(EXIT_FINDINGS)


def _forget(ctx: click.Context, redis_url: str | None, owner: str) -> None:
    """``status --all --forget OWNER``: one line, exit 1 when no such forwarder is listed."""
    from hybridq.ops.fleet import forget  # noqa: PLC0415

    if redis_url is None:
        _bad_usage(ctx, "--forget needs --all and --redis URL")
    try:
        removed = forget(redis_url, owner)
    except HybridqError as exc:
        _fail(ctx, exc)
    if not removed:
        _fail(ctx, RuntimeError(f"no forwarder {owner!r} in the view"))
    click.echo(f"forgot {shown(owner, one_line=True)}")


def _print_all(out: dict[str, Any]) -> None:
    """One line per forwarder (escaped: anyone who writes to Redis wrote it), then the totals."""
    for f in out["forwarders"]:
        seen = f"last seen {f['last_seen_age_s']:.0f} s ago"
        name = shown(f["owner"], one_line=True)
        if "invalid" in f:
            click.echo(f"INVALID {name}: {shown(f['invalid'], one_line=True)} ({seen})")
        elif f["stale"]:
            click.echo(f"STALE   {name}: not seen for its TTL ({seen})")
        else:
            where = shown(f"{f['host']}:{f['journal']}", one_line=True)
            click.echo(f"ok      {name} {where} ({seen})")
            click.echo("        " + _counts_line(f))
    total = out["total"]
    click.echo(
        f"total of {out['fresh']} forwarder(s) seen ({out['stale']} stale, {out['invalid']} invalid): "
        + _counts_line(total)
    )


def _counts_line(f: dict[str, Any]) -> str:
    queues = ", ".join(f"{q}={n}" for q, n in f["queues"].items()) or "none"
    return shown(
        f"accepted {f['accepted']}, succeeded {f['succeeded']}, failed {f['failed']}, pending "
        f"{f['pending']} ({queues}), not yet forwarded {f['not_yet_forwarded']}, oldest pending "
        f"{f['oldest_pending_age_s']} s, forwarding lag {f['forwarding_lag_s']} s",
        one_line=True,
    )


def _print_status(out: dict[str, Any]) -> None:
    for name in (
        "accepted",
        "forwarded",
        "succeeded",
        "failed",
        "pending",
        "duplicates_suppressed",
        "not_yet_forwarded",
        "delayed_held",
        "duplicate_pushes",
        "invalid_records",
        "retrying",
        "failed_listed",
        "cancelled",
        "cancels_pending",
        "oldest_pending_age_s",
        "forwarding_lag_s",
    ):
        click.echo(f"{name:>22}: {out[name]}")
    queues = ", ".join(f"{q}={n}" for q, n in sorted(out["queues"].items())) or "none"
    click.echo(f"{'pending per queue':>22}: {queues}")
    click.echo(f"{'forwarder':>22}: {out['forwarder'] or 'not running'}")
    click.echo(
        f"{'journal':>22}: {out['journal']['path']} ({out['journal']['segments']} segments, "
        f"{out['journal']['bytes']} bytes, {out['journal']['disk_bytes']} on disk)"
    )
    if "workflows" in out:
        flows = out["workflows"]
        click.echo(
            f"{'workflows':>22}: {flows.get('running', 0)} running, {flows.get('failed', 0)} failed, "
            f"{flows.get('succeeded', 0)} succeeded, {flows.get('cancelled', 0)} cancelled; "
            f"{flows.get('waiting_on_deps', 0)} jobs waiting on depends_on"
        )
    if "redis" in out:
        redis = out["redis"]
        down = f"REFUSED ({redis['refused']})" if redis.get("refused") else "DOWN"
        click.echo(f"{'redis':>22}: {redis['url']} {'up' if redis['up'] else down}")
        if out["redis"].get("waiting_for_a_worker"):
            # Left by workers that cannot import them or are not allowed to run them.
            click.echo(
                f"{'waiting for a worker':>22}: {out['redis']['waiting_for_a_worker']} (see hybridq doctor)"
            )
    for instance in out.get("redis_instances", []):
        queued = instance["queued"]
        down = f"REFUSED ({instance['refused']})" if instance.get("refused") else "DOWN"
        lengths = (
            down
            if queued is None
            else "up, " + (", ".join(f"{q}={n}" for q, n in queued.items()) or "no queues")
        )
        click.echo(f"{'redis instance':>22}: {instance['url']} [{', '.join(instance['queues'])}] {lengths}")
    if "outbox" in out:
        box = out["outbox"]
        aside = (
            f"; {box['set_aside']} set aside (bad rows: hybridq doctor --outbox)" if box["set_aside"] else ""
        )
        click.echo(
            f"{'outbox':>22}: {box['rows']} rows not yet relayed, oldest {box['oldest_age_s']} s{aside} "
            f"(table {box['table']} in {box['dsn']})"
        )
