"""``manage.py hybridq_outbox_init``: the outbox (and done) tables in the backend's database."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connections, transaction

from hybridq.contrib.django.commands import backend_settings
from hybridq.outbox import Outbox
from hybridq.outbox.once import create_done_table, done_ddl
from hybridq.outbox.schema import Dialect


class Command(BaseCommand):
    """Create hybridq's outbox table and ``outbox.once``'s done table (both kept if they exist)."""

    help = (
        "Create the transactional outbox's table (and the done table of outbox.once) in the "
        "backend's database; existing tables are kept. --print-sql prints the SQL instead, for "
        "a migration of your own (migrations.RunSQL)."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """``--backend`` and ``--print-sql``."""
        parser.add_argument("--backend", default="default", help="The TASKS alias (default: %(default)s).")
        parser.add_argument("--print-sql", action="store_true", help="Print the SQL; change nothing.")

    def handle(self, *_args: Any, **options: Any) -> None:
        """Create the tables on Django's own connection to the database."""
        config, _queues = backend_settings(options["backend"])
        outbox = Outbox(config.outbox_table)
        conn = connections[config.database]
        if conn.vendor not in ("sqlite", "postgresql"):
            raise CommandError(f"the outbox supports SQLite and PostgreSQL, not {conn.vendor}")
        dialect: Dialect = "postgresql" if conn.vendor == "postgresql" else "sqlite"
        if options["print_sql"]:
            self.stdout.write(outbox.ddl(dialect) + "\n" + done_ddl())
            return
        if dialect == "sqlite":  # executescript commits: run it in Django's autocommit
            conn.ensure_connection()
            created = outbox.create_table(conn.connection)
            create_done_table(conn.connection)
        else:
            with transaction.atomic(using=config.database):
                created = outbox.create_table(conn.connection)
                create_done_table(conn.connection)
        state = "created" if created else "already there"
        self.stdout.write(f"outbox table {config.outbox_table!r} in database {config.database!r}: {state}")
