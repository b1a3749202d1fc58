"""``hybridq outbox init`` (create the outbox table) and ``hybridq relay`` (outbox → journal)."""

from __future__ import annotations

import logging
import signal

import click

from hybridq.cli.options import EXIT_USAGE, _fail, journal_option
from hybridq.errors import HybridqError, JournalLocked
from hybridq.outbox.once import DEFAULT_DONE_TABLE, create_done_table, done_ddl
from hybridq.outbox.relay import DEFAULT_BATCH, DEFAULT_PG_POLL_S, DEFAULT_POLL_S, Relay
from hybridq.outbox.schema import (
    DEFAULT_TABLE,
    SUPPORTED_DSNS,
    connect,
    create_table,
    ddl,
    dialect_of,
    first_line,
    validate_table,
)
from hybridq.transport.redisurl import redact_url

_table_option = click.option(
    "--table",
    default=DEFAULT_TABLE,
    show_default=True,
    help="The outbox table (as in Outbox(table=...)).",
)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _usage(ctx: click.Context, message: str) -> None:
    """Bad input: one line on stderr, exit 2, nothing written."""
    click.echo(f"hybridq: error: {message}", err=True)
    ctx.exit(EXIT_USAGE)


@click.group()
def outbox() -> None:
    """Set up the transactional outbox (enqueue inside your database transaction).

    Your application calls Outbox().enqueue(conn, f, *args) inside its own transaction (sqlite3,
    psycopg 3, or SQLAlchemy over either); the row becomes a job when the transaction commits,
    and `hybridq relay` moves it into the journal. See docs/outbox.md.

    \b
    Example:
      hybridq outbox init --dsn sqlite:///app.db
      hybridq outbox init --dsn postgresql://app@db.internal/shop
      hybridq outbox init --print-sql > migrations/0007_hybridq_outbox.sql
      hybridq outbox init --print-sql --dsn postgresql://   (PostgreSQL's DDL, no connection)
      hybridq relay --outbox sqlite:///app.db --journal /var/lib/hybridq/journal
    """


@outbox.command("init")
@click.option("--dsn", default=None, metavar="DSN", help=f"The database: {SUPPORTED_DSNS}.")
@_table_option
@click.option(
    "--done-table",
    default=DEFAULT_DONE_TABLE,
    show_default=True,
    help="The table of outbox.once(conn) (exactly-once effects), created too.",
)
@click.option(
    "--print-sql",
    is_flag=True,
    help="Print the DDL (for --dsn's database kind; SQLite's without --dsn); connect to nothing.",
)
@click.pass_context
def outbox_init(ctx: click.Context, dsn: str | None, table: str, done_table: str, print_sql: bool) -> None:
    """Create the outbox table in the database DSN names (idempotent: an existing one is kept).

    The done table of outbox.once(conn) (exactly-once effects in this database) is created
    alongside it.

    SQLite: the database file is created if missing (its directory must exist). PostgreSQL: the
    database must exist; the table (bigserial id, bytea envelope), an index of the rows relays
    hold, and the trigger whose NOTIFY wakes the relays are created in one transaction. With
    --print-sql, print the DDL instead, for migrations you manage yourself.

    \b
    Examples:
      hybridq outbox init --dsn sqlite:///app.db            (relative to the working directory)
      hybridq outbox init --dsn sqlite:////var/lib/app/app.db
      hybridq outbox init --dsn postgresql://app:secret@db.internal:5432/shop
      hybridq outbox init --print-sql --table my_outbox
      hybridq outbox init --print-sql --dsn postgresql://
    """
    try:
        validate_table(table)
        validate_table(done_table)
        dialect = dialect_of(dsn) if dsn is not None else "sqlite"
    except ValueError as exc:
        _usage(ctx, str(exc))
        return
    if print_sql:
        click.echo(ddl(table, dialect=dialect) + done_ddl(done_table), nl=False)
        return
    if dsn is None:
        _usage(ctx, f"--dsn is required (or --print-sql); use {SUPPORTED_DSNS}")
        return
    try:
        conn = connect(dsn, create=True)
    except (ValueError, FileNotFoundError) as exc:
        _usage(ctx, str(exc))
        return
    except ConnectionError as exc:
        _fail(ctx, exc)
    try:
        created = create_table(conn, table)
        done_created = create_done_table(conn, done_table)
    except (OSError, HybridqError) as exc:
        _fail(ctx, exc)
    except Exception as exc:  # sqlite3.Error, psycopg.Error: not a database, read-only, no right, ...
        _fail(ctx, RuntimeError(first_line(exc)))
    finally:
        conn.close()
    click.echo(f"{'created' if created else 'exists:'} table {table} in {redact_url(dsn)}")
    click.echo(f"{'created' if done_created else 'exists:'} table {done_table} in {redact_url(dsn)}")


@click.command()
@click.option("--outbox", "dsn", required=True, metavar="DSN", help=f"The outbox database: {SUPPORTED_DSNS}.")
@journal_option
@_table_option
@click.option(
    "--batch-size",
    default=DEFAULT_BATCH,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="Most rows per journal append (one fsync) and per delete.",
)
@click.option(
    "--poll",
    "poll_s",
    default=None,
    type=click.FloatRange(0.001, 60),
    help=f"Seconds to wait before looking again when the outbox is empty [default: {DEFAULT_POLL_S} on "
    f"SQLite; on PostgreSQL a NOTIFY wakes the relay, and this fallback is {DEFAULT_PG_POLL_S}].",
)
@click.option("--once", is_flag=True, help="Relay until the outbox is empty, then exit.")
@click.pass_context
def relay(
    ctx: click.Context, dsn: str, journal: str, table: str, batch_size: int, poll_s: float | None, once: bool
) -> None:
    """Move committed outbox rows into the journal, then delete them.

    Each row already holds its job (id and idempotency key fixed when your application inserted
    it), so a relay killed at any point makes neither a lost nor a second job: rows it had
    appended but not deleted are found in the journal on restart and deleted. The forwarder
    (`hybridq forward` on the same journal) delivers the jobs as any others.

    SQLite: an empty outbox is looked at again every --poll seconds; one relay per outbox (it
    locks DATABASE.relay.lock; a second one exits 2). PostgreSQL (psycopg 3): several relays may
    run at once (FOR UPDATE SKIP LOCKED; up to 16 on one journal); each commit's NOTIFY wakes
    them, --poll is the fallback; if PostgreSQL goes away (a restart), the relay logs one line,
    reconnects with backoff and goes on.

    Runs until SIGTERM or SIGINT (finishes the batch in flight, exits 0); logs its progress
    every few seconds while busy. With --once, relays what is there and exits. Bad DSN, no
    database or no outbox table (create it with `hybridq outbox init`): one line, exit 2; a
    PostgreSQL that cannot be reached at start: one line, exit 1.

    \b
    Example:
      hybridq relay --outbox sqlite:///app.db --journal /var/lib/hybridq/journal
      hybridq relay --outbox sqlite:///app.db --journal ./hybridq-journal --once
      hybridq relay --outbox postgresql://relay@db.internal/shop --journal /var/lib/hybridq/journal
    """
    try:
        worker = Relay(dsn, journal, table=table, batch_size=batch_size, poll_s=poll_s)
    except ValueError as exc:
        _usage(ctx, str(exc))
        return
    try:
        worker.open()
    except (FileNotFoundError, JournalLocked) as exc:
        _usage(ctx, str(exc))
        return
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    log = logging.getLogger("hybridq.relay")
    previous = {signum: signal.signal(signum, lambda *_: worker.stop()) for signum in _STOP_SIGNALS}
    try:
        if once:
            moved = worker.run_once()
            log.info("relayed %d jobs; backlog %d", moved, worker.backlog())
        else:
            worker.run()
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    finally:
        worker.close()
        for signum, handler in previous.items():  # when called in-process (tests, embedding)
            signal.signal(signum, handler)
