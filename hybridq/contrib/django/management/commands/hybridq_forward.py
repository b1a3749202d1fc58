"""``manage.py hybridq_forward``: the forwarder and the outbox relay of the backend's database."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand

from hybridq.contrib.django.commands import add_common_arguments, backend_settings, database_dsn, run_hybridq


class Command(BaseCommand):
    """Run ``hybridq forward --journal J --redis R --outbox <the database> ...``."""

    help = (
        "Forward the journal's jobs to Redis and relay the outbox of the backend's database into "
        "the journal (`hybridq forward --outbox`): one per journal. Options after the command "
        "go to `hybridq forward`, e.g. `manage.py hybridq_forward --lease 5`."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> argparse.ArgumentParser:
        """Django's parser, passing the options it does not know to `hybridq forward`."""
        return add_common_arguments(super().create_parser(prog_name, subcommand, **kwargs), "forward")

    def handle(self, *_args: Any, **options: Any) -> None:
        """Build the command line from the settings and run it."""
        config, _queues = backend_settings(options["backend"])
        argv = ["forward", "--outbox", database_dsn(config), "--outbox-table", config.outbox_table]
        if config.journal is not None:
            argv += ["--journal", config.journal]
        if config.redis_url is not None:
            argv += ["--redis", config.redis_url]
        run_hybridq([*argv, *options["hybridq_args"]])
