"""The backend's settings: ``TASKS[alias]["OPTIONS"]``, and the outbox DSN of a Django database.

One place reads them, for the backend (enqueue, results) and for the management commands
(``hybridq_forward``, ``hybridq_worker``, ``hybridq_outbox_init``), so what the web process
writes and what the forwarder and workers read cannot disagree. docs/django.md lists them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from django.core.exceptions import ImproperlyConfigured

from hybridq.outbox.schema import DEFAULT_TABLE, validate_table

__all__ = ["Options", "allowed_prefixes", "outbox_dsn", "parse_options", "under"]

#: The keys ``OPTIONS`` may hold; any other is a typo, refused at start.
KNOWN = frozenset({"journal", "redis_url", "allow", "database", "outbox_table", "always_outbox"})


@dataclass(frozen=True, slots=True)
class Options:
    """The backend's options, checked.

    Attributes:
        journal: the journal directory (``None``: ``$HYBRIDQ_JOURNAL``).
        redis_url: the Redis the forwarder and workers use (``None``: ``$HYBRIDQ_REDIS_URL``,
            else hybridq's default).
        allow: module prefixes whose tasks a worker may run (empty: the project's apps).
        database: the Django database alias whose transactions the outbox joins.
        outbox_table: the outbox table's name.
        always_outbox: enqueue through the outbox outside ``atomic()`` too (autocommit: the
            row commits at once), for hosts without the journal.
    """

    journal: str | None
    redis_url: str | None
    allow: tuple[str, ...]
    database: str
    outbox_table: str
    always_outbox: bool


def parse_options(raw: Mapping[str, Any]) -> Options:
    """Check ``OPTIONS``; ImproperlyConfigured (one line) for an unknown key or a bad value."""
    unknown = sorted(set(raw) - KNOWN)
    if unknown:
        raise ImproperlyConfigured(
            f"hybridq backend: unknown OPTIONS {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(KNOWN))}"
        )
    allow = raw.get("allow", ())
    if (
        isinstance(allow, str)
        or not isinstance(allow, Sequence)
        or not all(isinstance(a, str) for a in allow)
    ):
        raise ImproperlyConfigured("hybridq backend: OPTIONS['allow'] must be a list of module prefixes")
    try:
        table = validate_table(raw.get("outbox_table", DEFAULT_TABLE))
    except ValueError as exc:
        raise ImproperlyConfigured(f"hybridq backend: OPTIONS['outbox_table']: {exc}") from None
    journal, redis_url = raw.get("journal"), raw.get("redis_url")
    for name, value in (("journal", journal), ("redis_url", redis_url), ("database", raw.get("database"))):
        if value is not None and (not isinstance(value, str | os.PathLike) or not str(value)):
            raise ImproperlyConfigured(f"hybridq backend: OPTIONS[{name!r}] must be a non-empty string")
    return Options(
        journal=None if journal is None else os.fspath(journal),
        redis_url=redis_url,
        allow=tuple(allow),
        database=raw.get("database", "default"),
        outbox_table=table,
        always_outbox=bool(raw.get("always_outbox", False)),
    )


def outbox_dsn(database: Mapping[str, Any]) -> str:
    """The DSN ``hybridq forward --outbox`` reads the outbox of a ``DATABASES`` entry with.

    SQLite: ``sqlite:///`` and the file's absolute path. PostgreSQL: a ``postgresql://`` URL
    with its user, password, host (a socket directory goes in ``?host=``), port and name.
    Anything else raises ImproperlyConfigured: the outbox supports these two.
    """
    engine = str(database.get("ENGINE", ""))
    name = database.get("NAME")
    if engine.endswith("sqlite3"):
        if not name or str(name) == ":memory:" or str(name).startswith("file:"):
            raise ImproperlyConfigured("hybridq: the outbox needs an SQLite database file, not memory")
        return "sqlite:///" + str(Path(name).resolve())
    if engine.endswith("postgresql"):
        user, password = database.get("USER") or "", database.get("PASSWORD") or ""
        host, port = str(database.get("HOST") or ""), str(database.get("PORT") or "")
        auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
        where = "" if not host or host.startswith("/") else quote(host, safe="")
        where += f":{port}" if port and where else ""
        query = f"?host={quote(host, safe='/')}" if host.startswith("/") else ""
        if host.startswith("/") and port:
            query += f"&port={port}"
        return f"postgresql://{auth}{'@' if auth else ''}{where}/{quote(str(name or ''), safe='')}{query}"
    raise ImproperlyConfigured(
        f"hybridq: the outbox supports SQLite and PostgreSQL databases, not {engine or 'no ENGINE'!r}"
    )


def allowed_prefixes() -> tuple[str, ...]:
    """The module prefixes whose ``@task`` functions hybridq may run or name in a result.

    Every hybridq backend's ``allow``; a backend without one allows the project's own apps
    (``INSTALLED_APPS`` less Django's, the backport's and hybridq's). Read from the settings,
    so the worker and the web process agree.
    """
    from django.apps import apps  # noqa: PLC0415 - needs Django set up, unlike the rest
    from django.conf import settings  # noqa: PLC0415

    prefixes: list[str] = []
    for params in getattr(settings, "TASKS", {}).values():
        if not str(params.get("BACKEND", "")).startswith("hybridq.contrib.django"):
            continue
        allow = parse_options(params.get("OPTIONS", {})).allow
        prefixes.extend(
            allow
            or (
                config.name
                for config in apps.get_app_configs()
                if not config.name.startswith(("django.", "django_tasks", "hybridq."))
            )
        )
    return tuple(dict.fromkeys(prefixes))


def under(module: str, prefixes: Sequence[str]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or inside one (``shop.tasks`` under ``shop``)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)
