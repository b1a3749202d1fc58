"""``hybridq forward``: run the forwarder (journal → Redis, completions → ledger)."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

import click

# Re-exported for the old import path; the code reading these constants is in forward_addons: patch there.
from hybridq.cli.forward_addons import RELAY_STOP_TIMEOUT_S as RELAY_STOP_TIMEOUT_S  # noqa: PLC0414 - re-exported
from hybridq.cli.forward_addons import (
    _describe_route,
    _load_schedules,
    _open_relay,
    _start_server,
    _stop_relay,
)
from hybridq.cli.options import (
    _fail,
    journal_option,
    limit_option,
    outbox_options,
    redis_for_option,
    redis_option,
)
from hybridq.cli.serve import serve_config, tokens_option
from hybridq.errors import HybridqError
from hybridq.forwarder.config import DEFAULT_STATS_EVERY_S, DEFAULT_WINDOW_MIN, MIN_STATS_EVERY_S
from hybridq.protocol import DEFAULT_KEY_TTL_S, DEFAULT_LEASE_S
from hybridq.transport.routes import Routes

if TYPE_CHECKING:
    from hybridq.http.server import Server
    from hybridq.protocol.keylimits import Limits


def _stats_every(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """0 (never) or at least :data:`MIN_STATS_EVERY_S`: a usage error otherwise, before anything starts."""
    if value != 0 and value < MIN_STATS_EVERY_S:
        raise click.BadParameter(f"0 (never) or from {MIN_STATS_EVERY_S} to 3600 seconds", ctx, param)
    return value


@click.command()
@journal_option
@redis_option
@redis_for_option
@limit_option
@click.option(
    "--batch-size",
    default=500,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="Most jobs per Redis pipeline (and per checkpoint write).",
)
@click.option(
    "--idle-timeout",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.01, 60),
    help="Seconds to sleep without a nudge from a producer before looking anyway.",
)
@click.option(
    "--lease",
    "lease_s",
    default=DEFAULT_LEASE_S,
    show_default=True,
    type=click.FloatRange(0.5, 3600),
    help="Seconds a worker's claim on a job lasts unrenewed; a killed worker's job is delivered "
    "again about this long after it died.",
)
@click.option(
    "--key-ttl",
    "key_ttl_s",
    default=DEFAULT_KEY_TTL_S,
    show_default=True,
    type=click.FloatRange(1, None),
    help="Seconds a job's outcome stays stored under its idempotency key in Redis.",
)
@click.option(
    "--stats-every",
    "stats_every_s",
    default=DEFAULT_STATS_EVERY_S,
    show_default=True,
    type=click.FloatRange(0, 3600),
    callback=_stats_every,
    help="Seconds between two stats snapshots published to Redis for `hybridq status --all` "
    f"(each expires after three times that); 0: never, else at least {MIN_STATS_EVERY_S}.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (/metrics).",
)
@click.option(
    "--metrics-addr",
    default="127.0.0.1",
    show_default=True,
    help="The address the metrics endpoint listens on.",
)
@click.option(
    "--capacity",
    type=click.IntRange(1, None),
    default=None,
    help="Your producers' Queue(capacity=N), exported as the hybridq_capacity gauge (to alert on).",
)
@click.option(
    "--schedules",
    "schedule_modules",
    multiple=True,
    metavar="MODULE",
    help="Keep the periodic jobs this module declares with hybridq.schedule(...) (repeatable; "
    "imported from the current directory too). See docs/schedules.md.",
)
@click.option(
    "--window-max",
    default=10_000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Most jobs per queue kept queued in Redis; the rest wait in the journal "
    '(docs/forwarder.md, "The window").',
)
@click.option(
    "--window-min",
    default=DEFAULT_WINDOW_MIN,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Fewest jobs per queue kept queued in Redis while more wait (the window's floor).",
)
@click.option(
    "--redis-high-water",
    default=0.8,
    show_default=True,
    type=click.FloatRange(0.0, 1.0, max_open=True),
    help="Push nothing while Redis uses more than this share of its maxmemory (0: off).",
)
@click.option(
    "--allow-eviction",
    is_flag=True,
    help="Start even if Redis's maxmemory-policy is allkeys-*: at its limit Redis may then evict "
    "queued jobs, leases and epoch keys (jobs late, or run twice).",
)
@click.option(
    "--forget-finished/--keep-finished",
    default=None,
    help="Delete finished jobs' RQ hashes and results from Redis once harvested (default: only "
    "if Redis has a maxmemory); --keep-finished keeps RQ's result_ttl (rq tools show them).",
)
@click.option(
    "--fair-key",
    "fair_keys",
    multiple=True,
    envvar="HYBRIDQ_FAIR_KEYS",
    metavar="GLOB[=W]",
    callback=lambda _ctx, _param, value: _fair_keys(value),
    help="Take the waiting jobs of each limit key matching GLOB round robin, W per turn (default "
    "1), so a key with a long backlog does not starve one with a few (repeatable; "
    "HYBRIDQ_FAIR_KEYS: space-separated). E.g. 'tenant:*' or 'tenant:big=3' "
    '(docs/forwarder.md, "Priorities and fairness").',
)
@outbox_options
@click.option(
    "--serve",
    "serve_bind",
    default=None,
    metavar="HOST:PORT",
    help="Also serve the HTTP API (hybridq serve) on this address (or unix:PATH), in this process "
    "(docs/http.md).",
)
@tokens_option
@click.option(
    "--serve-allow",
    multiple=True,
    metavar="PREFIX",
    help="With --serve: accept tasks under this dotted prefix (as hybridq serve --allow).",
)
@click.option(
    "--serve-allowed-host",
    "serve_allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="With --serve and no --tokens-file: also answer this Host (as hybridq serve --allowed-host).",
)
@click.pass_context
def forward(
    ctx: click.Context,
    journal: str,
    redis_url: str,
    batch_size: int,
    idle_timeout: float,
    lease_s: float,
    key_ttl_s: float,
    stats_every_s: float,
    metrics_port: int | None,
    metrics_addr: str,
    capacity: int | None,
    schedule_modules: tuple[str, ...],
    outbox_dsn: str | None,
    outbox_table: str,
    serve_bind: str | None,
    tokens_file: str | None,
    serve_allow: tuple[str, ...],
    serve_allowed_hosts: tuple[str, ...],
    redis_for: dict[str, str],
    window_max: int,
    window_min: int,
    redis_high_water: float,
    allow_eviction: bool,
    forget_finished: bool | None,
    fair_keys: tuple[str, ...],
    limits: Limits,
) -> None:
    """Forward jobs from the journal into RQ queues on Redis (one forwarder per journal).

    Runs until SIGTERM or SIGINT, then finishes the batch in flight, saves its checkpoint and
    exits 0. While Redis is down it retries with backoff and logs once per change of state; a
    configuration Redis refuses (wrong password or user, no such database, an ACL that denies
    what it needs) is exit 1, not retried.

    With --outbox, it also runs the transactional outbox's relay (as `hybridq relay` does, in a
    thread, into this journal): one daemon for both. A relay failure is logged once and retried
    with backoff while forwarding goes on; a bad DSN, a missing database or table, or another
    relay on that outbox is one line and exit 2 at start, nothing written.

    \b
    Example:
      hybridq forward --journal /var/lib/hybridq/journal --redis redis://127.0.0.1:6379/0
      hybridq forward --journal /var/lib/hybridq/journal --outbox sqlite:////var/lib/app/app.db
      hybridq forward --journal /var/lib/hybridq/journal --schedules myapp.schedules

    With --schedules, it imports the module(s) and journals each tick of the schedules they
    declare as a job (one per tick, across restarts and Redis losses); a module that cannot be
    imported or a bad schedule is one line and exit 2, before anything is forwarded.

    With --serve HOST:PORT, it also serves the HTTP API of `hybridq serve` (its /metrics: this
    forwarder's) in a thread; SIGTERM stops both.
    With --redis-for QUEUE=URL (repeatable, or HYBRIDQ_REDIS_FOR), those queues go to their own
    Redis; the others to --redis (docs/deploy.md, "Sharded: queues over several Redis").
    With --limit PATTERN=SPEC (repeatable, or HYBRIDQ_LIMITS), jobs whose limit_key matches run
    at most N at once and start at most N per period, across every worker and forwarder on that
    Redis: e.g. --limit 'tenant:*=concurrency:2' --limit 'stripe=rate:100/s,concurrency:10'
    (docs/forwarder.md, "Limits per key").
    """
    from hybridq.forwarder.loop import Forwarder  # noqa: PLC0415 - keep `hybridq --help` fast
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415

    config = None
    if serve_bind is not None:
        config = serve_config(
            ctx,
            journal=journal,
            bind=serve_bind,
            tokens_file=tokens_file,
            allow=serve_allow,
            allowed_hosts=serve_allowed_hosts,
            redis_url=redis_url,
            capacity=capacity,
        )
    scheduler = _load_schedules(ctx, schedule_modules, journal) if schedule_modules else None
    relay = None if outbox_dsn is None else _open_relay(ctx, outbox_dsn, outbox_table, journal)
    from hybridq.transport.base import Transport  # noqa: PLC0415
    from hybridq.transport.sharded import ShardedTransport  # noqa: PLC0415

    routes = Routes(redis_url, redis_for)
    transport: Transport = ShardedTransport(routes) if routes.sharded else RQTransport(redis_url)
    server: Server | None = None
    try:
        forwarder = Forwarder(
            journal,
            transport,
            batch_size=batch_size,
            idle_timeout_s=idle_timeout,
            lease_s=lease_s,
            key_ttl_s=key_ttl_s,
            stats_every_s=stats_every_s,
            schedules=scheduler,
            window_min=min(window_min, window_max),
            window_max=window_max,
            redis_high_water=redis_high_water,
            allow_eviction=allow_eviction,
            forget_finished=forget_finished,
            fair_keys=fair_keys,
            limits=limits,
        )
        forwarder.open_waiting_for_space()  # a full disk pauses here too (docs/operations.md)
        if metrics_port is not None:
            from hybridq.ops.metrics import FSYNC_SECONDS, serve_metrics  # noqa: PLC0415

            forwarder.on_durable_write = FSYNC_SECONDS.observe
            serve_metrics(forwarder, metrics_port, addr=metrics_addr, capacity=capacity, outbox=relay)
            logging.getLogger("hybridq").info("metrics on http://%s:%d/metrics", metrics_addr, metrics_port)
        if config is not None:
            server = _start_server(ctx, forwarder, config, capacity, relay)
    except (HybridqError, OSError) as exc:
        transport.close()
        if relay is not None:
            relay.close()
        _fail(ctx, exc)

    def stop(*_: object) -> None:
        forwarder.stop()
        if relay is not None:
            relay.stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    logging.getLogger("hybridq").info(
        "forwarding to %s", ", ".join(_describe_route(routes, url) for url in routes.urls)
    )
    if relay is not None:
        relay.start()
    try:
        forwarder.run()
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    finally:
        if server is not None:
            server.stop()
        if relay is not None:
            _stop_relay(relay)
        forwarder.close()
        transport.close()
    if forwarder.stats.down_since is not None:
        logging.getLogger("hybridq").warning(
            "stopped while Redis was unavailable; the undelivered jobs stay in the journal"
        )
    else:
        logging.getLogger("hybridq").info("stopped; checkpoint saved")


def _fair_keys(value: tuple[str, ...]) -> tuple[str, ...]:
    """``--fair-key`` values, checked now: a bad one is a usage error (exit 2), nothing started."""
    from hybridq.forwarder.selector import parse_fair_keys  # noqa: PLC0415 - keep --help fast

    try:
        parse_fair_keys(value)
    except HybridqError as exc:
        raise click.BadParameter(str(exc), param_hint="--fair-key") from None
    return value
