"""The ``hybridq`` command (also ``python -m hybridq``): wiring only, no business logic.

Exit codes (documented in ``docs/cli.md``):

* 0 — success; for ``journal verify``: the journal is healthy (a torn tail is healthy).
* 1 — an error (bad path, I/O error); one line on stderr.
* 2 — bad usage (unknown option, bad value).
* 3 — the journal is corrupt; the message names file, offset and the records affected.
* 4 — ``doctor`` found something (missing, stranded or orphaned jobs, duplicates, unknown jobs).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import click

from hybridq import __version__
from hybridq.errors import HybridqError, JournalCorruption
from hybridq.journal.paths import DEFAULT_JOURNAL
from hybridq.journal.reader import JournalReader, segment_usage
from hybridq.journal.recovery import verify
from hybridq.status import read_password, redact_url, with_password

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_FINDINGS = 4

#: Where ``--redis`` points when neither the option nor ``HYBRIDQ_REDIS_URL`` is given.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

#: Journals larger than this get a progress bar on stderr.
PROGRESS_THRESHOLD_BYTES = 16 << 20

journal_option = click.option(
    "--journal",
    "journal",
    envvar="HYBRIDQ_JOURNAL",
    default=DEFAULT_JOURNAL,
    show_default=True,
    show_envvar=True,
    type=click.Path(file_okay=False),
    help="Journal directory (relative paths are relative to the working directory).",
)


class _JsonLogFormatter(logging.Formatter):
    """One JSON object per log line: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _Context:
    def __init__(self, *, debug: bool) -> None:
        self.debug = debug


def _fail(ctx: click.Context, exc: BaseException) -> NoReturn:
    """One clear line on stderr (a traceback only with --debug), and the right exit code."""
    obj = ctx.find_object(_Context)
    if obj is not None and obj.debug:
        raise exc
    code = EXIT_CORRUPT if isinstance(exc, JournalCorruption) else EXIT_ERROR
    click.echo(f"hybridq: error: {exc}", err=True)
    ctx.exit(code)
    raise AssertionError  # pragma: no cover - ctx.exit raises


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hybridq")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Logs on stderr: text lines, or one JSON object per line.",
)
@click.pass_context
def cli(ctx: click.Context, debug: bool, log_format: str) -> None:
    """hybridq: a task queue whose source of truth is a local, fsync'd journal.

    \b
    Example:
      hybridq demo
      hybridq forward --journal /var/lib/hybridq/journal --redis redis://127.0.0.1:6379/0
      hybridq status --json --journal /var/lib/hybridq/journal

    \b
    Exit codes: 0 ok, 1 error, 2 bad usage, 3 corrupt journal, 4 doctor found problems
    (docs/cli.md).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonLogFormatter()
        if log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=[handler])
    ctx.obj = _Context(debug=debug)


@cli.group()
def journal() -> None:
    """Inspect the journal directory.

    \b
    Example:
      hybridq journal verify --journal ./hybridq-journal
    """


def _progress(total: int) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A stderr progress bar over ``total`` bytes when the journal is large, else nothing."""
    if total < PROGRESS_THRESHOLD_BYTES:
        return None, lambda: None
    bar = click.progressbar(length=total, label="scanning", file=sys.stderr, show_pos=False)
    bar.__enter__()
    return bar.update, lambda: bar.__exit__(None, None, None)


@journal.command("verify")
@journal_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.pass_context
def journal_verify(ctx: click.Context, journal: str, as_json: bool) -> None:
    """Check every record of the journal; exit 0 when healthy, 3 when corrupt.

    Read-only: a torn tail left by a crashed producer is reported (it is repaired when the
    forwarder next opens the journal); corruption is reported with the file, the byte offset
    and the records affected.

    \b
    Example:
      hybridq journal verify --journal ./hybridq-journal
    """
    on_bytes, done = _progress(segment_usage(journal)[1])
    try:
        report = verify(journal, on_bytes=on_bytes)
    except (HybridqError, OSError) as exc:
        done()
        _fail(ctx, exc)
    done()
    if as_json:
        out: dict[str, Any] = {
            "ok": True,
            "chains": report.chains,
            "segments": report.segments,
            "records": report.records,
            "bytes": report.bytes,
            "live_writers": report.live_chains,
            "torn_tails": [
                {"path": t.path, "offset": t.offset, "dropped_bytes": t.dropped_bytes}
                for t in report.torn_tails
            ],
        }
        click.echo(json.dumps(out))
        return
    click.echo(
        f"ok: {report.records} records in {report.segments} segments "
        f"({report.chains} writers, {report.live_chains} live), {report.bytes} bytes"
    )
    for torn in report.torn_tails:
        click.echo(
            f"torn tail: {torn.path} at offset {torn.offset}, {torn.dropped_bytes} bytes "
            "(left by a crash; never acknowledged; repaired when the journal is next opened)"
        )


@journal.command("repair")
@journal_option
@click.option(
    "--accept-loss",
    is_flag=True,
    help="Change the journal: drop the damaged records (and what follows them) as listed. Without "
    "it, a dry run: report what would be dropped, change nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the full report (every dropped record) as JSON.")
@click.pass_context
def journal_repair(ctx: click.Context, journal: str, accept_loss: bool, as_json: bool) -> None:
    """Repair mid-file damage that stops the forwarder (exit 3), by dropping the damaged records.

    A dry run by default: it lists, per damaged chain, where the damage is and exactly which
    records would be dropped, and changes nothing (exit 3 if anything would be dropped, 0 if the
    journal is healthy). With --accept-loss it backs up every file it changes or removes into
    repair-backup-<time>/ (with repair-report.json listing every dropped record), cuts the
    damaged segment after its last good record, seals it, and moves what follows aside. The
    ledger (ledger/) is checked the same way. A running forwarder must be stopped first.

    \b
    Examples:
      hybridq journal repair --journal /var/lib/hybridq/journal
      hybridq journal repair --accept-loss --journal /var/lib/hybridq/journal
    """
    from hybridq.journal.repair import repair  # noqa: PLC0415

    reports = []
    for path in (journal, os.path.join(journal, "ledger")):
        if path != journal and not os.path.isdir(path):
            continue
        on_bytes, done = _progress(segment_usage(path)[1])
        try:
            reports.append(repair(path, accept_loss=accept_loss, progress=on_bytes))
        except (HybridqError, OSError) as exc:
            done()
            _fail(ctx, exc)
        done()
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in reports]))
    else:
        for report in reports:
            _print_repair(report)
    damaged = any(not r.healthy for r in reports)
    if damaged and not accept_loss:
        ctx.exit(EXIT_CORRUPT)


def _print_repair(report: Any) -> None:
    if report.healthy:
        click.echo(f"{report.path}: healthy ({report.segments} segments): nothing to repair")
        return
    verb = "dropped" if report.applied else "would drop"
    for chain in report.repairs:
        seqs = [d for d in chain.dropped if d.seq is not None]
        span = f", sequence numbers {seqs[0].seq}..{seqs[-1].last_seq or seqs[-1].seq}" if seqs else ""
        click.echo(
            f"{chain.path} at offset {chain.offset}: {chain.reason}: {verb} {chain.data_records_dropped} "
            f"record(s){span} ({chain.bytes_dropped} bytes); {len(chain.truncated)} segment(s) cut, "
            f"{len(chain.removed)} moved aside"
        )
    if report.applied:
        click.echo(f"backup (every changed file, and repair-report.json): {report.backup}")
    else:
        click.echo(
            "dry run: nothing changed. Run again with --accept-loss to drop the records listed (--json: all)."
        )


@journal.command("dump")
@journal_option
@click.pass_context
def journal_dump(ctx: click.Context, journal: str) -> None:
    """Print every record as one JSON line: writer, seq, type, segment, offset, payload.

    The payload is printed as text when it is UTF-8, else base64 in ``payload_b64``.

    \b
    Example:
      hybridq journal dump --journal ./hybridq-journal | head
    """
    try:
        reader = JournalReader(journal)
        for rec in reader.records():
            line: dict[str, Any] = {
                "writer": rec.writer_id,
                "seq": rec.seq,
                "type": rec.rtype,
                "segment": rec.segment_index,
                "offset": rec.offset,
            }
            try:
                line["payload"] = rec.payload.decode()
            except UnicodeDecodeError:
                line["payload_b64"] = base64.b64encode(rec.payload).decode()
            try:
                click.echo(json.dumps(line))
            except BrokenPipeError:
                _reader_left(ctx)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)


def _reader_left(ctx: click.Context) -> NoReturn:
    """The reader of stdout went away (``| head``): stop quietly, exit 0, as ``cat`` users expect.

    stdout is pointed at /dev/null first, so the interpreter's final flush cannot fail loudly.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    ctx.exit(EXIT_OK)
    raise AssertionError  # pragma: no cover - ctx.exit raises


_redis_url_option = click.option(
    "--redis",
    "redis_url",
    envvar="HYBRIDQ_REDIS_URL",
    default=DEFAULT_REDIS_URL,
    show_default=True,
    show_envvar=True,
    help="Redis URL (a password belongs in --redis-password-file or the environment, never on a "
    "shared command line).",
)

password_file_option = click.option(
    "--redis-password-file",
    "redis_password_file",
    envvar="HYBRIDQ_REDIS_PASSWORD_FILE",
    show_envvar=True,
    default=None,
    type=click.Path(dir_okay=False),
    help="Read the Redis password from this file (its first line), instead of the URL.",
)


def redis_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--redis URL`` and ``--redis-password-file PATH``; the command gets the combined URL."""

    @functools.wraps(command)
    def run(*args: Any, redis_password_file: str | None = None, **kwargs: Any) -> Any:
        kwargs["redis_url"] = _with_password_file(kwargs["redis_url"], redis_password_file)
        return command(*args, **kwargs)

    return _redis_url_option(password_file_option(run))


def _with_password_file(url: str | None, password_file: str | None) -> str | None:
    """``url`` with the password read from ``password_file`` (when both are given), checked.

    A URL redis-py cannot use is one line and exit 1 here, before anything starts.
    """
    from hybridq.redisurl import check_url  # noqa: PLC0415 - imports redis

    if url is None:
        return url
    try:
        if password_file is not None:
            url = with_password(url, read_password(password_file))
        return check_url(url)
    except (HybridqError, OSError) as exc:
        _fail(click.get_current_context(), exc)


@cli.command()
@journal_option
@redis_option
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
    default=10.0,
    show_default=True,
    type=click.FloatRange(0.5, 3600),
    help="Seconds a worker's claim on a job lasts unrenewed; a killed worker's job is delivered "
    "again about this long after it died.",
)
@click.option(
    "--key-ttl",
    "key_ttl_s",
    default=86400.0,
    show_default=True,
    type=click.FloatRange(1, None),
    help="Seconds a job's outcome stays stored under its idempotency key in Redis.",
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
@click.pass_context
def forward(
    ctx: click.Context,
    journal: str,
    redis_url: str,
    batch_size: int,
    idle_timeout: float,
    lease_s: float,
    key_ttl_s: float,
    metrics_port: int | None,
    metrics_addr: str,
    capacity: int | None,
) -> None:
    """Forward jobs from the journal into RQ queues on Redis (one forwarder per journal).

    Runs until SIGTERM or SIGINT, then finishes the batch in flight, saves its checkpoint and
    exits 0. While Redis is down it retries with backoff and logs once per change of state; a
    configuration Redis refuses (wrong password or user, no such database, an ACL that denies
    what it needs) is exit 1, not retried.

    \b
    Example:
      hybridq forward --journal /var/lib/hybridq/journal --redis redis://127.0.0.1:6379/0
    """
    from hybridq.forwarder import Forwarder  # noqa: PLC0415 - keep `hybridq --help` fast
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415

    transport = RQTransport(redis_url)
    try:
        forwarder = Forwarder(
            journal,
            transport,
            batch_size=batch_size,
            idle_timeout_s=idle_timeout,
            lease_s=lease_s,
            key_ttl_s=key_ttl_s,
        )
        forwarder.open()
        if metrics_port is not None:
            from hybridq.metrics import FSYNC_SECONDS, serve_metrics  # noqa: PLC0415

            forwarder.on_durable_write = FSYNC_SECONDS.observe
            if forwarder.completions is not None:
                forwarder.completions.on_durable_write = FSYNC_SECONDS.observe
            serve_metrics(forwarder, metrics_port, addr=metrics_addr, capacity=capacity)
            logging.getLogger("hybridq").info("metrics on http://%s:%d/metrics", metrics_addr, metrics_port)
    except (HybridqError, OSError) as exc:
        transport.close()
        _fail(ctx, exc)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: forwarder.stop())
    logging.getLogger("hybridq").info("forwarding to %s", redact_url(redis_url))
    try:
        forwarder.run()
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    finally:
        forwarder.close()
        transport.close()
    if forwarder.stats.down_since is not None:
        logging.getLogger("hybridq").warning(
            "stopped while Redis was unavailable; the undelivered jobs stay in the journal"
        )
    else:
        logging.getLogger("hybridq").info("stopped; checkpoint saved")


@cli.command()
@journal_option
@click.option(
    "--redis",
    "redis_url",
    envvar="HYBRIDQ_REDIS_URL",
    default=None,
    show_envvar=True,
    help="Also report whether this Redis answers (optional: counts never need it).",
)
@password_file_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the contract in docs/cli.md).")
@click.option("--watch", is_flag=True, help="Print it again every --interval seconds until Ctrl-C.")
@click.option(
    "--interval", type=click.FloatRange(0.1, None), default=2.0, show_default=True, help="For --watch."
)
@click.pass_context
def status(
    ctx: click.Context,
    journal: str,
    redis_url: str | None,
    redis_password_file: str | None,
    as_json: bool,
    watch: bool,
    interval: float,
) -> None:
    """Show job counts from the journal, the completion ledger and the checkpoint (Redis not needed).

    Also: pending jobs per queue, the age of the oldest pending job, the forwarding lag (age of
    the oldest job not yet handed to Redis), the journal's size and, with --redis, whether Redis
    answers. With --watch --json, one JSON object per line.

    \b
    Examples:
      hybridq status --json --journal ./hybridq-journal
      hybridq status --watch --redis redis://127.0.0.1:6379/0
    """
    from hybridq.status import collect_status  # noqa: PLC0415

    redis_url = _with_password_file(redis_url, redis_password_file)
    while True:
        try:
            out = collect_status(journal, redis_url=redis_url)
        except (HybridqError, OSError) as exc:
            _fail(ctx, exc)
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
        "oldest_pending_age_s",
        "forwarding_lag_s",
    ):
        click.echo(f"{name:>22}: {out[name]}")
    queues = ", ".join(f"{q}={n}" for q, n in sorted(out["queues"].items())) or "none"
    click.echo(f"{'pending per queue':>22}: {queues}")
    click.echo(f"{'forwarder':>22}: {out['forwarder'] or 'not running'}")
    click.echo(
        f"{'journal':>22}: {out['journal']['path']} ({out['journal']['segments']} segments, "
        f"{out['journal']['bytes']} bytes)"
    )
    if "redis" in out:
        click.echo(f"{'redis':>22}: {out['redis']['url']} {'up' if out['redis']['up'] else 'DOWN'}")
        if out["redis"].get("waiting_for_a_worker"):
            # Left by workers that cannot import them or are not allowed to run them.
            click.echo(
                f"{'waiting for a worker':>22}: {out['redis']['waiting_for_a_worker']} (see hybridq doctor)"
            )


@cli.command()
@journal_option
@click.option("--queue", "queue_name", default="default", show_default=True, help="The queue.")
@click.option("--key", default=None, help="The idempotency key (default: the job id).")
@click.option(
    "--delay",
    type=click.FloatRange(0, None),
    default=None,
    help="Run no sooner than this many seconds from now.",
)
@click.option(
    "--kwargs", "kwargs_json", default=None, metavar="JSON", help="Keyword arguments, as a JSON object."
)
@click.option(
    "--retry",
    type=click.IntRange(1, 1000),
    default=None,
    metavar="N",
    help="Up to N attempts (backoff 1 s, doubling).",
)
@click.argument("func")
@click.argument("args", nargs=-1)
@click.pass_context
def enqueue(
    ctx: click.Context,
    journal: str,
    queue_name: str,
    key: str | None,
    delay: float | None,
    kwargs_json: str | None,
    retry: int | None,
    func: str,
    args: tuple[str, ...],
) -> None:
    """Enqueue FUNC(ARGS...) durably (Redis not needed) and print the job id.

    FUNC is a dotted path the workers can import. Each ARG is JSON: numbers, true/false/null,
    lists, objects, and strings in double quotes (quote them for the shell too). Nothing is
    written if any argument is not valid.

    \b
    Examples:
      hybridq enqueue tasks.add 1 2
      hybridq enqueue emails.send '"ada@example.com"' --key welcome:ada --queue emails
      hybridq enqueue reports.build --kwargs '{"month": "2026-11"}' --delay 60 --retry 3
    """
    from hybridq.envelope import Retry  # noqa: PLC0415
    from hybridq.producer import Queue  # noqa: PLC0415

    values = [_json_arg(f"argument {n}", raw) for n, raw in enumerate(args, 1)]
    kwargs = _json_arg("--kwargs", kwargs_json) if kwargs_json is not None else {}
    if not isinstance(kwargs, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--kwargs")
    try:
        queue = Queue(queue_name, journal)
        job = queue.enqueue_call(
            func,
            values,
            kwargs,
            idempotency_key=key,
            delay=delay,
            retry=Retry(max_attempts=retry) if retry else None,
        )
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    click.echo(job.id)


def _json_arg(what: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        hint = " (a string needs double quotes: '\"text\"')" if raw[:1] not in '[{"' else ""
        raise click.BadParameter(f"{raw!r} is not JSON{hint}", param_hint=what) from None


@cli.command()
@redis_option
@click.option("--burst", is_flag=True, help="Exit once the queues are empty.")
@click.option(
    "--simple",
    is_flag=True,
    help="Run jobs in the worker process (RQ's SimpleWorker) instead of a forked work-horse per job.",
)
@click.option("--name", default=None, help="The RQ worker name (default: RQ's).")
@click.option(
    "--allow",
    "allow",
    multiple=True,
    metavar="MODULE",
    help="Run functions and classes defined in modules under this prefix (repeatable; added to "
    "$HYBRIDQ_ALLOW); what those modules import from elsewhere is not allowed. Functions registered "
    "with @hybridq.task in an imported module run without it.",
)
@click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="Import this module at start (repeatable), e.g. the one holding your @hybridq.task functions.",
)
@click.option(
    "--signing-key-file",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PATH",
    help="Run only jobs whose envelope is signed with a key in this file (one per line); sets "
    "$HYBRIDQ_SIGNING_KEY_FILE. See docs/security.md.",
)
@click.argument("queues", nargs=-1)
@click.pass_context
def worker(
    ctx: click.Context,
    redis_url: str,
    burst: bool,
    simple: bool,
    name: str | None,
    allow: tuple[str, ...],
    imports: tuple[str, ...],
    signing_key_file: str | None,
    queues: tuple[str, ...],
) -> None:
    """Run an RQ worker for hybridq jobs on QUEUES (default: "default").

    It is `rq worker` with the JSON serializer, restarted when Redis goes away (backoff up to
    30 s, no spinning), so it keeps serving across Redis restarts and outages (with --burst it
    does not wait: exit 1). A configuration Redis refuses (password, database, ACL) is exit 1,
    not retried. RQ's pub/sub shutdown command stops it with exit 0 and a warning. A plain
    `rq worker --serializer rq.serializers.JSONSerializer QUEUE` also runs hybridq jobs with
    every guarantee (set HYBRIDQ_ALLOW for it); only the restarts are this command's.

    It runs only functions registered with @hybridq.task in a module it imported (--import), or
    under a module prefix allowed with --allow or HYBRIDQ_ALLOW (comma-separated): a job naming
    anything else fails for good, and nothing is imported for it. RQ itself resolves no function
    but hybridq's entry point (job class hybridq.worker.Job).

    With --signing-key-file or HYBRIDQ_SIGNING_KEY_FILE, it runs only jobs whose envelope carries
    a valid signature by one of the file's keys: unsigned or altered jobs fail for good.

    \b
    Example:
      hybridq worker --redis redis://127.0.0.1:6379/0 --allow myapp.tasks default emails
      hybridq worker --import myapp.tasks default
    """
    import importlib  # noqa: PLC0415

    from hybridq.allow import ENV_VAR, allowed_prefixes  # noqa: PLC0415
    from hybridq.envelope import validate_queue_name  # noqa: PLC0415
    from hybridq.signing import ENV_KEY_FILE, keyring  # noqa: PLC0415

    try:
        from hybridq.worker import run_worker  # noqa: PLC0415 - imports rq
    except ValueError as exc:  # an invalid RQ_KEY_PREFIX: RQ (and hybridq.keys) refuse it
        _fail(ctx, exc)

    try:
        names = [validate_queue_name(q) for q in queues] or ["default"]
    except HybridqError as exc:
        _fail(ctx, exc)
    # Like `rq worker` (its --path defaults to "."): task modules in the current directory import.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    if allow:
        # The environment, so forked work-horses (and anything they start) see it too.
        os.environ[ENV_VAR] = ",".join((*allowed_prefixes(), *allow))
    if signing_key_file is not None:
        os.environ[ENV_KEY_FILE] = os.path.abspath(signing_key_file)  # the work-horses read it too
    try:
        keyring()  # a key configured but unusable: fail now, not on every job
    except HybridqError as exc:
        _fail(ctx, exc)
    for module in imports:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            _fail(ctx, exc)
    if not allowed_prefixes() and not imports:
        logging.getLogger("hybridq").warning(
            "no --allow, --import or %s: only @hybridq.task functions of modules imported by other "
            "means will run",
            ENV_VAR,
        )
    logging.getLogger("hybridq").info("worker on %s at %s", ", ".join(names), redact_url(redis_url))
    try:
        code = run_worker(names, url=redis_url, burst=burst, simple=simple, name=name)
    except HybridqError as exc:  # RedisRefused: a wrong password, database or ACL
        _fail(ctx, exc)
    ctx.exit(code)


@cli.command()
@journal_option
@redis_option
@click.option(
    "--fix",
    is_flag=True,
    help="Deliver again the jobs Redis lost (missing) or no worker will take (stranded).",
)
@click.option(
    "--lease",
    "lease_s",
    type=click.FloatRange(0.5, 3600),
    default=10.0,
    show_default=True,
    help="The forwarder's --lease.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def doctor(
    ctx: click.Context, journal: str, redis_url: str, fix: bool, lease_s: float, as_json: bool
) -> None:
    """Compare the journal and ledger with what Redis holds: is anything lost or stuck?

    Reports forwarded jobs Redis no longer has (missing), jobs no worker will take (stranded),
    jobs whose worker died mid-task (orphaned: the forwarder re-delivers them by itself),
    duplicate queue entries, jobs in RQ's intermediate lists, this forwarder's jobs queued in
    Redis that the journal does not have as pending (unknown), queues where jobs wait that no
    registered RQ worker serves (unserved), and job ids shared by different calls (merged: only
    the first runs). A dry run unless --fix.
    Exit 0 when healthy, 4 when it found something (after fixing it, with --fix).

    \b
    Examples:
      hybridq doctor --journal /var/lib/hybridq/journal --redis redis://127.0.0.1:6379/0
      hybridq doctor --fix
    """
    from hybridq.doctor import diagnose  # noqa: PLC0415
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415

    transport = RQTransport(redis_url)
    try:
        report = diagnose(journal, transport, lease_s=lease_s, fix=fix)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    finally:
        transport.close()
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        click.echo(f"checked {report.checked} forwarded, unfinished job(s): {report.verdicts or 'none'}")
        for name in ("missing", "stranded", "orphaned", "intermediate", "unknown"):
            ids: list[str] = getattr(report, name)
            if ids:
                more = f" (+{len(ids) - 10} more)" if len(ids) > 10 else ""
                click.echo(f"{name}: {len(ids)}: {' '.join(ids[:10])}{more}")
        if report.duplicate_entries:
            click.echo(f"duplicate queue entries: {report.duplicate_entries}")
        if report.unserved:
            waiting = ", ".join(f"{q} ({n} waiting)" for q, n in report.unserved.items())
            click.echo(f"queues no worker serves: {waiting}")
        if report.merged:
            click.echo(
                f"job ids shared by different calls (only the first runs): {' '.join(report.merged[:10])}"
            )
        for w in report.waiting[:10]:
            click.echo(
                f"waiting for a worker that can run it: {w.get('id')} ({w.get('func')}): {w.get('reason')}"
            )
        if fix:
            click.echo(f"fixed: {report.fixed} job(s) delivered again")
        click.echo("healthy" if report.healthy else "problems found")
    if not report.healthy:
        ctx.exit(EXIT_FINDINGS)


@cli.group()
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
    from hybridq.failures import failed_jobs  # noqa: PLC0415

    try:
        jobs = failed_jobs(journal)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    for job in jobs:
        if as_json:
            click.echo(json.dumps(_failed_json(job)))
        else:
            error = (job.error or "").strip().splitlines()[-1:] or [""]
            click.echo(f"{job.id}  {job.queue}  {job.func}  attempts={job.attempts}  {error[0][:120]}")
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
    from hybridq.failures import JobNotFailed, failed_jobs  # noqa: PLC0415

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
    from hybridq.failures import failed_jobs, requeue  # noqa: PLC0415

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


@cli.command()
@click.option("--jobs", default=1000, show_default=True, type=click.IntRange(10, 1_000_000))
@click.option("--dir", "directory", type=click.Path(file_okay=False), help="Keep the demo's files here.")
@click.pass_context
def demo(ctx: click.Context, jobs: int, directory: str | None) -> None:
    """Run hybridq end to end on this machine, with faults, and print a tally.

    Starts a private redis-server (from PATH, or the `embedded` extra; no persistence), the
    forwarder and two `hybridq worker`s; enqueues JOBS jobs while Redis is stopped for a while,
    then SIGKILLed and restarted empty, and the forwarder is SIGKILLed once; then counts what ran
    from an effects file the tasks write. Everything it starts, it stops; everything it writes is
    under one directory it names. Exit 0 when nothing was lost.

    \b
    Example:
      hybridq demo --jobs 1000
    """
    from hybridq.demo import run_demo  # noqa: PLC0415

    try:
        with click.progressbar(length=jobs, label="enqueue", file=sys.stderr) as bar:
            result = run_demo(
                jobs=jobs,
                directory=directory,
                say=lambda m: click.echo(f"\n{m}", err=True),
                progress=bar.update,
            )
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    click.echo(
        f"accepted={result.accepted} succeeded={result.succeeded} ran={result.ran} lost={result.lost} "
        f"duplicate_deliveries={result.duplicate_runs + result.duplicates_suppressed} "
        f"duplicate_runs={result.duplicate_runs} duplicates_suppressed={result.duplicates_suppressed} "
        f"seconds={result.seconds:.1f}"
    )
    click.echo(f"files: {result.directory}")
    if result.duplicate_runs:
        click.echo(
            f"{result.duplicate_runs} job(s) ran twice: they had finished, and Redis was wiped before the "
            "forwarder recorded them in its ledger (the one window where a finished job runs again; see "
            "docs/guarantees.md).",
            err=True,
        )
    if result.lost:
        ctx.exit(EXIT_ERROR)


def _fault_list(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, ...]:
    from hybridq.testing.chaos import FAULTS  # noqa: PLC0415

    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if value.strip() == "all":
        return tuple(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise click.BadParameter(
            f"unknown fault(s) {', '.join(unknown) or '(none)'}; known: {', '.join(FAULTS)}"
        )
    return names


@cli.command()
@click.option(
    "--duration",
    default=60.0,
    show_default=True,
    type=click.FloatRange(5, 7 * 86400),
    help="Seconds of faults (the soak tier: 1800 or more).",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed of the fault schedule and the load (default: random, printed).",
)
@click.option(
    "--faults",
    default="all",
    show_default=True,
    callback=_fault_list,
    help="Comma-separated fault names, or all.",
)
@click.option(
    "--producers", default=2, show_default=True, type=click.IntRange(1, 32), help="Producer processes."
)
@click.option(
    "--workers",
    default=3,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Worker processes (hybridq worker and rq worker, alternating).",
)
@click.option(
    "--rate",
    default=10.0,
    show_default=True,
    type=click.FloatRange(0.1, 10_000),
    help="Jobs per second per producer.",
)
@click.option(
    "--gap",
    default=3.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Mean seconds between faults.",
)
@click.option(
    "--lease",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.5, 3600),
    help="The forwarder's --lease.",
)
@click.option(
    "--drain",
    default=180.0,
    show_default=True,
    type=click.FloatRange(1, 86400),
    help="Seconds the drain after the last fault may go without a job finishing; what is left then is lost.",
)
@click.option("--report", type=click.Path(dir_okay=False), help="Also write the verdict as JSON here.")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    help="Keep the run's files here (kept anyway on failure).",
)
@click.pass_context
def chaos(
    ctx: click.Context,
    duration: float,
    seed: int | None,
    faults: tuple[str, ...],
    producers: int,
    workers: int,
    rate: float,
    gap: float,
    lease: float,
    drain: float,
    report: str | None,
    directory: str | None,
) -> None:
    """Prove the guarantees on this machine: real processes, injected faults, an independent tally.

    Starts a private redis-server (no persistence), the forwarder, WORKERS workers (`hybridq
    worker` and plain `rq worker`, alternating) and PRODUCERS producer processes, then injects a
    seeded schedule of faults (docs/reliability.md S1, S2, S8-S12): producer kills and crash points,
    forwarder kills, worker and work-horse kills, Redis restarted empty, FLUSHALL, an evicting
    maxmemory, Redis stopped, SIGSTOPped and CLIENT PAUSEd, and network faults between the
    clients and Redis (latency, resets, a blackhole, replies cut). Jobs note their runs in a file of
    their own, so the verdict does not trust hybridq's counts. Prints one figure line per fault
    class and a total; exits 1 if an acknowledged job was lost, failed for good, or ran again
    after it had finished (and prints the seed to replay it), 0 otherwise. See
    docs/reliability.md.

    \b
    Faults: producer-kill producer-crash forwarder-kill worker-kill horse-kill redis-restart
            flushall evict redis-outage redis-sigstop client-pause net-latency net-reset
            net-blackhole net-cut
    \b
    Examples:
      hybridq chaos                                  # a minute of every fault
      hybridq chaos --duration 1800 --seed 42        # the soak tier
      hybridq chaos --faults redis-restart,flushall --seed 7 --duration 30
    """
    import random  # noqa: PLC0415

    from hybridq.testing.chaos import ChaosConfig  # noqa: PLC0415
    from hybridq.testing.chaos import main as chaos_main  # noqa: PLC0415

    cfg = ChaosConfig(
        duration_s=duration,
        seed=seed if seed is not None else random.SystemRandom().randrange(1, 1 << 31),
        faults=faults,
        producers=producers,
        workers=workers,
        rate=rate,
        gap_s=gap,
        lease_s=lease,
        drain_s=drain,
        directory=directory,
    )
    try:
        code = chaos_main(cfg, echo=click.echo, report=report)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    ctx.exit(code)


def main() -> None:
    """Entry point of the ``hybridq`` script."""
    cli(prog_name="hybridq")
