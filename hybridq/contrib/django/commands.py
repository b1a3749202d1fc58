"""What the management commands share: the backend's settings, and running the hybridq command.

``manage.py hybridq_forward`` and ``hybridq_worker`` run ``hybridq forward`` and ``hybridq
worker`` in the manage.py process (Django set up, its settings the single source of the
journal, the Redis URL, the outbox's database and the allowlist), with the options the command
line adds after them passed through unchanged: ``manage.py hybridq_worker --processes 2``.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connections

from hybridq.contrib.django.config import Options, outbox_dsn, parse_options, queues_of

__all__ = ["add_common_arguments", "backend_settings", "database_dsn", "run_hybridq"]

BACKEND_PREFIX = "hybridq.contrib.django"


def add_common_arguments(parser: argparse.ArgumentParser, what: str) -> argparse.ArgumentParser:
    """``--backend ALIAS``; every option Django's parser does not know goes to ``hybridq <what>``.

    Returns the parser, its ``parse_args`` made to keep the options it does not know (in
    ``hybridq_args``, in their order) instead of refusing them: ``hybridq <what>`` checks them.
    """
    parser.add_argument(
        "--backend",
        default="default",
        help="The TASKS alias whose hybridq backend to use (default: %(default)s).",
    )
    parser.epilog = f"Any other option is passed to `hybridq {what}` (`hybridq {what} --help` lists them)."
    known_only = parser.parse_known_args

    def parse_args(args: Any = None, namespace: Any = None) -> argparse.Namespace:
        options: argparse.Namespace
        options, rest = known_only(args, namespace)
        options.hybridq_args = rest
        return options

    parser.parse_args = parse_args  # type: ignore[method-assign,assignment]
    return parser


def backend_settings(alias: str) -> tuple[Options, list[str]]:
    """The options and queues of ``TASKS[alias]``; CommandError if it is not a hybridq backend."""
    params = getattr(settings, "TASKS", {}).get(alias)
    if not isinstance(params, dict) or not str(params.get("BACKEND", "")).startswith(BACKEND_PREFIX):
        raise CommandError(f"TASKS[{alias!r}] is not a hybridq backend ({BACKEND_PREFIX}.HybridqBackend)")
    return parse_options(params.get("OPTIONS", {})), queues_of(params)


def database_dsn(options: Options) -> str:
    """The outbox DSN of the backend's database (``OPTIONS['database']``)."""
    if options.database not in settings.DATABASES:
        raise CommandError(f"OPTIONS['database'] names {options.database!r}, which DATABASES lacks")
    return outbox_dsn(settings.DATABASES[options.database], connections[options.database].vendor)


def run_hybridq(argv: list[str]) -> NoReturn:
    """Run ``hybridq ARGV`` here, and exit with its exit code (SystemExit, as manage.py expects).

    Django's database connections are closed first: the worker's pool forks, and a connection
    must never be shared by two processes.
    """
    from hybridq.cli import cli  # noqa: PLC0415 - the command line loads only what it runs

    connections.close_all()
    result: Any = cli.main(args=argv, prog_name="hybridq", standalone_mode=True)
    raise SystemExit(result if isinstance(result, int) else 0)
