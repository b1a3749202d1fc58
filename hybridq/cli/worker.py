"""``hybridq worker``: an RQ worker that runs hybridq jobs."""

from __future__ import annotations

import logging
import os
import sys

import click

from hybridq.cli.options import (
    _fail,
    redis_for_option,
    redis_option,
)
from hybridq.errors import HybridqError
from hybridq.transport.redisurl import redact_url


@click.command()
@redis_option
@redis_for_option
@click.option("--burst", is_flag=True, help="Exit once the queues are empty.")
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Worker processes, each running many jobs (default: one per CPU core).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    metavar="N",
    help="Threads per process, each running one job at a time.",
)
@click.option(
    "--async-concurrency",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    metavar="N",
    help="Most `async def` tasks running at once per process, on its event loop.",
)
@click.option(
    "--max-jobs",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Replace a process by a fresh one after it ran N jobs (a task that leaks).",
)
@click.option(
    "--max-memory",
    type=click.FloatRange(min=1),
    default=None,
    metavar="MB",
    help="Replace a process by a fresh one once its peak memory (RSS) passes MB.",
)
@click.option(
    "--cancel-grace",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    metavar="S",
    help="A job cancelled while it runs (hybridq cancel) is stopped this long after the worker saw "
    "the cancel, unless it stopped on its own (current_job().check_cancelled()).",
)
@click.option(
    "--with-scheduler",
    is_flag=True,
    help="Also run RQ's scheduler, for plain RQ jobs scheduled on these queues (hybridq's own "
    "delays and retries are the forwarder's and need no scheduler).",
)
@click.option(
    "--rq",
    "rq_classes",
    is_flag=True,
    help="Run RQ's worker loop instead of the pool: one job at a time, a forked work-horse per job.",
)
@click.option(
    "--simple",
    is_flag=True,
    help="With RQ's worker loop (implies --rq): run jobs in the worker process (RQ's SimpleWorker), "
    "not a forked work-horse per job.",
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
    processes: int | None,
    threads: int,
    async_concurrency: int,
    max_jobs: int | None,
    max_memory: float | None,
    cancel_grace: float,
    with_scheduler: bool,
    rq_classes: bool,
    simple: bool,
    name: str | None,
    allow: tuple[str, ...],
    imports: tuple[str, ...],
    signing_key_file: str | None,
    queues: tuple[str, ...],
    redis_for: dict[str, str],
) -> None:
    """Run a worker for hybridq jobs on QUEUES (default: "default").

    By default a pool: one process per CPU core (--processes), each running up to --threads jobs
    at once (and up to --async-concurrency `async def` tasks on an event loop), taking, starting
    and recording jobs in batches (docs/worker.md). A process is replaced when it dies, after
    --max-jobs jobs, past --max-memory, or when a job ignores its timeout. The jobs stay RQ jobs
    (rq info, rq-dashboard and RQ's registries show them). It keeps serving across Redis restarts
    and outages (with --burst it does not wait: exit 1). A configuration Redis refuses (password,
    database, ACL) is exit 1, not retried. SIGTERM or SIGINT stops it warmly (a second: at once).

    --rq runs RQ's own worker loop instead (one job at a time; --simple: without a fork per job),
    restarted when Redis goes away; RQ's pub/sub shutdown command stops it with exit 0. A plain
    `rq worker --serializer rq.serializers.JSONSerializer QUEUE` also runs hybridq jobs with
    every guarantee (set HYBRIDQ_ALLOW for it).

    It runs only functions registered with @hybridq.task in a module it imported (--import), or
    under a module prefix allowed with --allow or HYBRIDQ_ALLOW (comma-separated): a job naming
    anything else fails for good, and nothing is imported for it. RQ itself resolves no function
    but hybridq's entry point (job class hybridq.worker.Job).

    With --signing-key-file or HYBRIDQ_SIGNING_KEY_FILE, it runs only jobs whose envelope carries
    a valid signature by one of the file's keys: unsigned or altered jobs fail for good.

    With --redis-for QUEUE=URL (or HYBRIDQ_REDIS_FOR, as given to the forwarder), it connects to
    the Redis that holds its queues; queues on different Redis need one worker per Redis.

    \b
    Example:
      hybridq worker --redis redis://127.0.0.1:6379/0 --allow myapp.tasks default emails
      hybridq worker --import myapp.tasks default
    """
    import importlib  # noqa: PLC0415

    from hybridq.envelope.model import validate_queue_name  # noqa: PLC0415
    from hybridq.security.allow import ENV_VAR, allowed_prefixes  # noqa: PLC0415
    from hybridq.security.signing import ENV_KEY_FILE, keyring  # noqa: PLC0415

    try:
        from hybridq.worker import run_worker  # noqa: PLC0415 - imports rq
    except ValueError as exc:  # an invalid RQ_KEY_PREFIX: RQ (and hybridq.protocol.keys) refuse it
        _fail(ctx, exc)

    try:
        names = [validate_queue_name(q) for q in queues] or ["default"]
    except HybridqError as exc:
        _fail(ctx, exc)
    redis_url = _redis_of(ctx, redis_url, redis_for, names)
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
        if rq_classes or simple:
            code = run_worker(
                names, url=redis_url, burst=burst, simple=simple, name=name, with_scheduler=with_scheduler
            )
        else:
            from hybridq.worker.pool import PoolOptions, run_pool  # noqa: PLC0415

            options = PoolOptions(
                processes=processes or os.cpu_count() or 1,
                threads=threads,
                async_concurrency=async_concurrency,
                max_jobs=max_jobs,
                max_memory_mb=max_memory,
                with_scheduler=with_scheduler,
                cancel_grace_s=cancel_grace,
            )
            code = run_pool(names, url=redis_url, options=options, burst=burst, name=name)
    except HybridqError as exc:  # RedisRefused: a wrong password, database or ACL
        _fail(ctx, exc)
    ctx.exit(code)


def _redis_of(ctx: click.Context, default: str, redis_for: dict[str, str], queues: list[str]) -> str:
    """The one Redis that holds ``queues`` (``--redis-for``); several: one line, exit 1."""
    from hybridq.transport.routes import Routes  # noqa: PLC0415

    routes = Routes(default, redis_for)
    urls = {routes.url_for(q): q for q in queues}
    if len(urls) > 1:
        where = ", ".join(f"{q} on {redact_url(u)}" for u, q in urls.items())
        _fail(
            ctx,
            HybridqError(
                f"these queues live on different Redis instances ({where}): run one worker per Redis"
            ),
        )
    return next(iter(urls))
