"""``hybridq worker``: an RQ worker that runs hybridq jobs."""

from __future__ import annotations

import logging
import os
import sys

import click

from hybridq.cli.options import (
    _fail,
    redis_option,
)
from hybridq.errors import HybridqError
from hybridq.status import redact_url


@click.command()
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
