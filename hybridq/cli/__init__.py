"""The ``hybridq`` command (also ``python -m hybridq``): wiring only, no business logic.

It owns the commands, their options, messages and exit codes, and is the only package that
imports click; it may use every other package (loading each only when its command runs), and
nothing imports it but ``hybridq.__main__``.

The group and its global options live here; each command group is a module beside this one
(``journal``, ``forward``, ``status`` with ``doctor``, ``enqueue``, ``worker``, ``failed``,
``demo`` with ``chaos``, ``outbox`` with ``relay``), and what they share (the exit codes,
``--journal``, ``--redis``) is in ``options``. The exit codes are documented there and in ``docs/cli.md``.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from typing import Any

import click

from hybridq import __version__
from hybridq.cli.options import (
    DEFAULT_REDIS_URL,
    EXIT_CORRUPT,
    EXIT_ERROR,
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    _Context,
    _fail,
)
from hybridq.errors import MissingExtra

__all__ = [
    "DEFAULT_REDIS_URL",
    "EXIT_CORRUPT",
    "EXIT_ERROR",
    "EXIT_FINDINGS",
    "EXIT_OK",
    "EXIT_USAGE",
    "cli",
    "main",
]


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


#: Each command: the module of this package that defines it, and its function's name there.
#: Loaded when used: ``hybridq worker`` does not import the forwarder, the journal reader, the
#: status code or the HTTP server (about 0.15 s of start-up, timed by the burn-down benchmark).
_COMMANDS = {
    "journal": ("journal", "journal"),
    "forward": ("forward", "forward"),
    "status": ("status", "status"),
    "enqueue": ("enqueue", "enqueue"),
    "worker": ("worker", "worker"),
    "doctor": ("doctor", "doctor"),
    "failed": ("failed", "failed"),
    "cancel": ("cancel", "cancel"),
    "demo": ("demo", "demo"),
    "chaos": ("demo", "chaos"),
    "outbox": ("outbox", "outbox"),
    "relay": ("outbox", "relay"),
    "serve": ("serve", "serve"),
}


class _LazyGroup(click.Group):
    """A group whose commands are imported when first looked up (``--help`` looks up all)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_COMMANDS})

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a feature whose extra is not installed is one line, exit 1."""
        try:
            return super().invoke(ctx)
        except MissingExtra as exc:
            _fail(ctx, exc)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS and cmd_name not in self.commands:
            module, name = _COMMANDS[cmd_name]
            self.add_command(getattr(importlib.import_module(f"hybridq.cli.{module}"), name), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
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


def main() -> None:
    """Entry point of the ``hybridq`` script."""
    cli(prog_name="hybridq")
