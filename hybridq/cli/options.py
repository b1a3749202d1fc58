"""What the commands share: exit codes, the journal and Redis options, how a command fails.

The options are ``--journal``, ``--redis`` and ``--redis-password-file``; a command fails with one
line on stderr (a traceback only with ``--debug``) and the exit code below.

Exit codes (documented in ``docs/cli.md``):

* 0 — success; for ``journal verify``: the journal is healthy (a torn tail is healthy).
* 1 — an error (bad path, I/O error); one line on stderr.
* 2 — bad usage (unknown option, bad value, no ``--journal`` where one is needed).
* 3 — the journal is corrupt; the message names file, offset and the records affected.
* 4 — ``doctor`` found something (missing, stranded or orphaned jobs, duplicates, unknown jobs,
  unfinished jobs while no forwarder runs).
"""

from __future__ import annotations

import functools
import os
import sys
import unicodedata
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from hybridq.errors import HybridqError, JournalCorruption

_F = TypeVar("_F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_FINDINGS = 4

#: Where ``--redis`` points when neither the option nor ``HYBRIDQ_REDIS_URL`` is given.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

#: What a command that needs a journal says when given none (exit 2): as the Python API
#: (``hybridq.journal.paths.NO_JOURNAL``), the command line never guesses one. A forwarder
#: started in the wrong directory would otherwise forward an empty journal without a word.
NO_JOURNAL = "no journal given: pass --journal PATH or set HYBRIDQ_JOURNAL (docs/cli.md)"


def _given_journal(ctx: click.Context, _param: click.Parameter, value: str | None) -> str:
    if not value:
        _bad_usage(ctx, NO_JOURNAL)
    return value


def make_journal_option(callback: Any, required: str = "required") -> Callable[[_F], _F]:
    """``--journal`` (``HYBRIDQ_JOURNAL``), checked by ``callback``; ``required`` says when in --help."""
    return click.option(
        "--journal",
        "journal",
        envvar="HYBRIDQ_JOURNAL",
        show_envvar=True,
        type=click.Path(file_okay=False),
        callback=callback,
        help=f"Journal directory, {required} (relative paths are relative to the working directory).",
    )


journal_option = make_journal_option(_given_journal)


class _Context:
    def __init__(self, *, debug: bool) -> None:
        self.debug = debug


def shown(text: object, *, one_line: bool = False) -> str:
    """``text`` safe for a terminal: control and format characters escaped (``\\x1b``, ``\\u202e``).

    Error texts come from tasks, and waiting reasons from whoever writes to Redis: printed raw,
    an escape sequence clears the screen, retitles the terminal or hides a link, and a
    right-to-left override reverses what follows; a lone surrogate cannot be encoded at all.
    Tabs stay; so do newlines, unless ``one_line`` (a newline there would print a fake line).
    """
    out = str(text)
    if out.isprintable():
        return out
    kept = "\t" if one_line else "\n\t"
    return "".join(
        c if c in kept or unicodedata.category(c) not in _UNSAFE else c.encode("unicode_escape").decode()
        for c in out
    )


#: Unicode categories :func:`shown` escapes: controls, format (bidi overrides), separators,
#: lone surrogates.
_UNSAFE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _fail(ctx: click.Context, exc: BaseException) -> NoReturn:
    """One clear line on stderr (a traceback only with --debug), and the right exit code."""
    obj = ctx.find_object(_Context)
    if obj is not None and obj.debug:
        raise exc
    code = EXIT_CORRUPT if isinstance(exc, JournalCorruption) else EXIT_ERROR
    click.echo(f"hybridq: error: {shown(exc)}", err=True)
    ctx.exit(code)
    raise AssertionError  # pragma: no cover - ctx.exit raises


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
    from hybridq.security.secretfile import read_password  # noqa: PLC0415
    from hybridq.transport.redisurl import check_url, with_password  # noqa: PLC0415 - imports redis

    if url is None:
        return url
    try:
        if password_file is not None:
            url = with_password(url, read_password(password_file))
        return check_url(url)
    except (HybridqError, OSError) as exc:
        _fail(click.get_current_context(), exc)


def outbox_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--outbox DSN`` and ``--outbox-table NAME`` (``HYBRIDQ_OUTBOX``, ``HYBRIDQ_OUTBOX_TABLE``).

    The command gets ``outbox_dsn`` (``None``: no outbox) and ``outbox_table``.
    """
    from hybridq.outbox.schema import DEFAULT_TABLE, SUPPORTED_DSNS  # noqa: PLC0415

    dsn = click.option(
        "--outbox",
        "outbox_dsn",
        envvar="HYBRIDQ_OUTBOX",
        show_envvar=True,
        default=None,
        metavar="DSN",
        help=f"The transactional outbox's database ({SUPPORTED_DSNS}); see docs/outbox.md.",
    )
    table = click.option(
        "--outbox-table",
        "outbox_table",
        envvar="HYBRIDQ_OUTBOX_TABLE",
        show_envvar=True,
        default=DEFAULT_TABLE,
        show_default=True,
        help="The outbox table (as in Outbox(table=...)).",
    )
    return dsn(table(command))


def _bad_usage(ctx: click.Context, message: str) -> NoReturn:
    """Bad input: one line on stderr, exit 2, nothing written."""
    click.echo(f"hybridq: error: {message}", err=True)
    ctx.exit(EXIT_USAGE)
    raise AssertionError  # pragma: no cover - ctx.exit raises


def redis_for_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--redis-for QUEUE=URL`` (repeatable; else ``HYBRIDQ_REDIS_FOR``): queues on other Redis.

    The command gets ``redis_for``, the checked queue → URL map (empty: every queue on
    ``--redis``); a bad entry is one line and exit 1, before anything starts.
    """

    @functools.wraps(command)
    def run(*args: Any, redis_for: tuple[str, ...] = (), **kwargs: Any) -> Any:
        from hybridq.transport.routes import ENV_VAR, parse_redis_for, split_env  # noqa: PLC0415

        entries = list(redis_for) or split_env(os.environ.get(ENV_VAR, ""))
        try:
            kwargs["redis_for"] = parse_redis_for(entries)
        except HybridqError as exc:
            _fail(click.get_current_context(), exc)
        return command(*args, **kwargs)

    option = click.option(
        "--redis-for",
        "redis_for",
        multiple=True,
        metavar="QUEUE=URL",
        help="Keep QUEUE on this Redis instead of --redis (repeatable; or $HYBRIDQ_REDIS_FOR, "
        "'q1=URL,q2=URL'). See docs/deploy.md, 'Sharded'.",
    )
    return option(run)


def limit_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--limit PATTERN=SPEC`` (repeatable; else ``HYBRIDQ_LIMITS``): per-key limits.

    The command gets ``limits``, the checked :class:`~hybridq.protocol.keylimits.Limits`; a bad
    entry is one line and exit 2 (a usage error), before anything starts.
    """

    @functools.wraps(command)
    def run(*args: Any, limit: tuple[str, ...] = (), **kwargs: Any) -> Any:
        from hybridq.protocol.keylimits import parse_limits  # noqa: PLC0415

        entries = list(limit) or [e for e in os.environ.get("HYBRIDQ_LIMITS", "").split(";") if e.strip()]
        try:
            kwargs["limits"] = parse_limits(entries)
        except HybridqError as exc:
            _bad_usage(click.get_current_context(), str(exc))
        return command(*args, **kwargs)

    option = click.option(
        "--limit",
        "limit",
        multiple=True,
        metavar="PATTERN=SPEC",
        help="Limit the jobs whose limit_key matches the glob PATTERN: SPEC is concurrency:N "
        "(at most N run at once), rate:N/s|N/m|N/h (at most N start per period), or both, "
        "comma-separated. Repeatable; the first matching PATTERN wins. Or $HYBRIDQ_LIMITS, "
        "items separated by ';'. See docs/forwarder.md, 'Limits per key'.",
    )
    return option(run)


def check_outbox_option(ctx: click.Context, dsn: str, table: str) -> None:
    """A bad DSN, a missing database or table: one line, exit 2 (before anything is read)."""
    from hybridq.outbox.backlog import READ_TIMEOUT_S, check_outbox  # noqa: PLC0415

    try:
        check_outbox(dsn, table, timeout_s=READ_TIMEOUT_S)  # a locked database: said in 2 s, not 30
    except (ValueError, FileNotFoundError) as exc:
        _bad_usage(ctx, str(exc))
    except Exception as exc:  # the database driver's own error: not a database, locked, ...
        from hybridq.transport.redisurl import redact_url  # noqa: PLC0415

        _fail(ctx, RuntimeError(f"outbox {redact_url(dsn)}: {exc}"))
