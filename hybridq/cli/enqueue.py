"""``hybridq enqueue``: append one job to the journal."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import click

from hybridq.cli.options import (
    _fail,
    journal_option,
    shown,
)
from hybridq.envelope.model import function_path
from hybridq.errors import EnvelopeError, HybridqError


@click.command()
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
@click.option(
    "--priority",
    type=click.IntRange(0, 9),
    default=0,
    show_default=True,
    help="0-9: among a queue's waiting jobs, higher is forwarded first (docs/api.md).",
)
@click.option(
    "--limit-key",
    default=None,
    metavar="KEY",
    help="The key the forwarder's limits and fairness count the job under, e.g. tenant:42.",
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
    priority: int,
    limit_key: str | None,
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
      hybridq enqueue billing.charge 42 --priority 9 --limit-key tenant:42
    """
    from hybridq.envelope.model import Retry  # noqa: PLC0415
    from hybridq.envelope.tagged import decode_call  # noqa: PLC0415
    from hybridq.producer.queue import Queue  # noqa: PLC0415

    values = [_json_arg(f"argument {n}", raw) for n, raw in enumerate(args, 1)]
    unchecked = _import_module_of(func)  # so that the enqueue below can check the name
    if unchecked is not None:
        click.echo(
            f"hybridq: note: cannot check that {shown(func)} exists here ({shown(unchecked)}); a worker "
            "that imports its module fails the job if it lacks the name, one that cannot leaves it "
            "waiting (hybridq doctor lists it)",
            err=True,
        )
    kwargs = _json_arg("--kwargs", kwargs_json) if kwargs_json is not None else {}
    if not isinstance(kwargs, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--kwargs")
    try:  # tagged values (docs/http.md), as the HTTP API takes them
        values, kwargs = decode_call(values, kwargs)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="ARG or --kwargs") from None
    try:
        queue = Queue(queue_name, journal)
        job = queue.enqueue_call(
            func,
            values,
            kwargs,
            idempotency_key=key,
            delay=delay,
            retry=Retry(max_attempts=retry) if retry else None,
            priority=priority,
            limit_key=limit_key,
        )
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    click.echo(job.id)


def _import_module_of(func: str) -> str | None:
    """Import the module ``func`` names, as a worker would (the current directory on the path).

    The current directory only if it is ours and no one else may write to it (a module planted
    there would run here).

    ``None`` once imported: the enqueue then checks the name (``hybridq.producer.calls``). Else
    why not: the module is not on this host's path (a producer without the task code), or
    importing it failed. The longest prefix that is a module is the one imported, as a worker's.
    """
    try:
        function_path(func)
    except EnvelopeError:
        return None  # not a dotted path: the enqueue says so
    cwd = os.getcwd()
    st = os.stat(cwd)
    if cwd not in sys.path and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
        sys.path.append(cwd)  # only a directory no one else can plant a module in
    parts = func.split(".")
    for n in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:n])
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
                continue  # not a module: a shorter prefix may be
            return f"importing {name} failed: {exc}"
        except Exception as exc:  # the module's own code raised
            return f"importing {name} failed: {exc!r}"
        return None
    return f"no module {parts[0]!r} on this host's path"


def _json_arg(what: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        hint = " (a string needs double quotes: '\"text\"')" if raw[:1] not in '[{"' else ""
        raise click.BadParameter(f"{raw!r} is not JSON{hint}", param_hint=what) from None
