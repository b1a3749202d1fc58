"""What ``hybridq forward`` runs beside the forwarder: the outbox relay, schedules, the HTTP API.

Each is opened and checked before the forwarder starts (a bad one is exit 2, nothing written)
and stopped after it. Apart from :mod:`hybridq.cli.forward` (the command's options and its run)
to keep each module short.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

import click

from hybridq.cli.options import _bad_usage, _fail
from hybridq.cli.serve import start_server
from hybridq.errors import HybridqError, JournalLocked
from hybridq.transport.redisurl import redact_url
from hybridq.transport.routes import Routes

if TYPE_CHECKING:
    from hybridq.forwarder.loop import Forwarder
    from hybridq.http.config import ServeConfig
    from hybridq.http.server import Server
    from hybridq.outbox.background import BackgroundRelay
    from hybridq.scheduler import Scheduler

#: Seconds a stopping forwarder waits for its outbox relay (SQLite waits up to 30 s for a lock).
RELAY_STOP_TIMEOUT_S = 45.0


def _start_server(
    ctx: click.Context,
    forwarder: Forwarder,
    config: ServeConfig,
    capacity: int | None,
    relay: BackgroundRelay | None,
) -> Server:
    """``--serve``: the HTTP API in a thread, its /metrics this forwarder's."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from hybridq.ops.metrics import FSYNC_SECONDS, ForwarderMetrics  # noqa: PLC0415

    registry = CollectorRegistry()
    registry.register(ForwarderMetrics(forwarder, capacity=capacity, outbox=relay))
    forwarder.on_durable_write = FSYNC_SECONDS.observe
    registry.register(FSYNC_SECONDS)
    server = start_server(ctx, config, registry)
    server.start()
    return server


def _describe_route(routes: Routes, url: str) -> str:
    """``URL`` (redacted), with the queues mapped to it when there are several Redis."""
    queues = routes.queues_on(url)
    if url == routes.default and routes.sharded:
        queues = [*queues, "every other queue"]
    return redact_url(url) + (f" ({', '.join(queues)})" if routes.sharded else "")


def _load_schedules(ctx: click.Context, modules: tuple[str, ...], journal: str) -> Scheduler:
    """The schedules the modules declare, checked: a bad one is exit 2 now, nothing written."""
    from hybridq.scheduler import Scheduler  # noqa: PLC0415
    from hybridq.schedules import load_schedules  # noqa: PLC0415

    # Like `hybridq worker` (and `rq worker`): modules in the current directory import.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        declared = load_schedules(modules)
        return Scheduler(journal, declared)
    except ValueError as exc:  # ScheduleError, EnvelopeError: the schedule, not the system
        _bad_usage(ctx, str(exc))


def _open_relay(ctx: click.Context, dsn: str, table: str, journal: str) -> BackgroundRelay:
    """The outbox relay, opened: a bad outbox is exit 2 now, before the forwarder starts."""
    from hybridq.outbox.background import BackgroundRelay  # noqa: PLC0415

    try:
        relay = BackgroundRelay(dsn, journal, table=table)
    except ValueError as exc:  # a bad DSN or table name
        _bad_usage(ctx, str(exc))
    try:
        relay.open()
    except (FileNotFoundError, JournalLocked) as exc:  # no database or table; another relay
        _bad_usage(ctx, str(exc))
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    except Exception as exc:  # the database driver's own error: not a database, locked, ...
        _fail(ctx, RuntimeError(f"outbox {redact_url(dsn)}: {exc}"))
    return relay


def _stop_relay(relay: BackgroundRelay) -> None:
    """Stop the relay after its batch in flight; close it unless it is stuck (then it is left)."""
    relay.stop()
    if relay.join(RELAY_STOP_TIMEOUT_S):
        relay.close()
    else:
        # Stuck in the database (a lock held past its timeout): exiting is a crash for it,
        # which loses nothing and makes no second job (docs/outbox.md).
        logging.getLogger("hybridq.relay").warning(
            "the outbox relay did not stop within %.0f s; exiting without it", RELAY_STOP_TIMEOUT_S
        )
