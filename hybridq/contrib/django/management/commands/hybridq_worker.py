"""``manage.py hybridq_worker``: a hybridq worker pool with Django set up in every process."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand

from hybridq.contrib.django.commands import add_common_arguments, backend_settings, run_hybridq

#: The module every job of the backend runs (hybridq.contrib.django.run.run_task).
RUN_MODULE = "hybridq.contrib.django.run"


class Command(BaseCommand):
    """Run ``hybridq worker --redis R --allow hybridq.contrib.django.run ... QUEUES``."""

    help = (
        "Run a hybridq worker for the backend's queues (default: all of its QUEUES), Django set "
        "up before the pool forks. It runs only @task functions of the modules OPTIONS['allow'] "
        "names (default: the project's apps under BASE_DIR). Options after the command go to "
        "`hybridq worker`, e.g. `manage.py hybridq_worker --processes 2 --threads 4`."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> argparse.ArgumentParser:
        """Django's parser, passing the options it does not know to `hybridq worker`."""
        return add_common_arguments(super().create_parser(prog_name, subcommand, **kwargs), "worker")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """``--queue`` (repeatable), ``--backend`` and `hybridq worker`'s options."""
        parser.add_argument(
            "--queue",
            "-q",
            action="append",
            default=[],
            help="A queue to work on (repeatable; default: every queue in the backend's QUEUES).",
        )

    def handle(self, *_args: Any, **options: Any) -> None:
        """Build the command line from the settings and run it."""
        config, queues = backend_settings(options["backend"])
        argv = ["worker", "--allow", RUN_MODULE, "--import", RUN_MODULE]
        if config.redis_url is not None:
            argv += ["--redis", config.redis_url]
        run_hybridq([*argv, *options["hybridq_args"], *(options["queue"] or sorted(queues))])
