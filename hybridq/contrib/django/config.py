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

from hybridq.errors import NotAllowed
from hybridq.outbox.schema import DEFAULT_TABLE, validate_table

__all__ = [
    "KEY_PREFIX",
    "RUN_PATH",
    "Options",
    "allowed_prefixes",
    "check_task_path",
    "outbox_dsn",
    "parse_options",
    "queues_of",
    "under",
]

#: The function every job of the backend names: the worker-side entry point.
RUN_PATH = "hybridq.contrib.django.run.run_task"
#: How a job of the backend's idempotency key starts: ``django:<task path>:<job id>``.
KEY_PREFIX = "django:"

#: The keys ``OPTIONS`` may hold; any other is a typo, refused at start.
KNOWN = frozenset({"journal", "redis_url", "allow", "database", "outbox_table", "always_outbox"})


@dataclass(frozen=True, slots=True)
class Options:
    """The backend's options, checked.

    Attributes:
        journal: the journal directory (``None``: ``$HYBRIDQ_JOURNAL``).
        redis_url: the Redis the forwarder and workers use (``None``: ``$HYBRIDQ_REDIS_URL``,
            else hybridq's default).
        allow: module prefixes whose tasks a worker may run (empty: the project's apps under
            ``BASE_DIR``).
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
        always_outbox=_bool(raw, "always_outbox"),
    )


def _bool(raw: Mapping[str, Any], name: str) -> bool:
    """``raw[name]`` if a bool (default False): ``"false"`` is truthy, so a string is refused."""
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"hybridq backend: OPTIONS[{name!r}] must be True or False, not {value!r}")
    return value


def queues_of(params: Mapping[str, Any]) -> list[str]:
    """A backend's ``QUEUES`` (default ``["default"]``); an empty list is refused.

    The framework reads ``[]`` as "any queue name", but a worker has to be told which queues to
    work on: a queue nobody works on would hold its jobs for ever.
    """
    queues = params.get("QUEUES", ["default"])
    if isinstance(queues, str) or not isinstance(queues, Sequence) or not queues:
        raise ImproperlyConfigured(
            "hybridq backend: QUEUES must be a non-empty list of queue names (the queues workers work on)"
        )
    return list(queues)


#: ``DATABASES[...]["OPTIONS"]`` keys Django itself reads (not libpq's): kept out of the DSN.
DJANGO_ONLY_OPTIONS = frozenset(
    {"assume_role", "isolation_level", "pool", "server_side_binding", "cursor_factory"}
)


def outbox_dsn(database: Mapping[str, Any], vendor: str) -> str:
    """The DSN ``hybridq forward --outbox`` reads the outbox of a ``DATABASES`` entry with.

    ``vendor`` is the connection's (``connections[alias].vendor``), so GeoDjango's engines
    (SpatiaLite, PostGIS) count as the database they are. SQLite: ``sqlite:///`` and the
    file's absolute path. PostgreSQL: a ``postgresql://`` URL with its user, password, host (a
    socket directory, or none: ``?host=``), port and name, and the entry's libpq ``OPTIONS``
    (``sslmode``, ...) as query parameters. Anything else raises ImproperlyConfigured.
    """
    name = database.get("NAME")
    if vendor == "sqlite":
        if not name or str(name) == ":memory:" or str(name).startswith("file:"):
            raise ImproperlyConfigured("hybridq: the outbox needs an SQLite database file, not memory")
        return "sqlite:///" + str(Path(name).resolve())
    if vendor == "postgresql":
        user, password = database.get("USER") or "", database.get("PASSWORD") or ""
        host, port = str(database.get("HOST") or ""), str(database.get("PORT") or "")
        auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
        tcp = bool(host) and not host.startswith("/")
        where = quote(host, safe="") + (f":{port}" if port else "") if tcp else ""
        query: dict[str, str] = {} if tcp else {k: v for k, v in (("host", host), ("port", port)) if v}
        options = database.get("OPTIONS") or {}
        query.update((str(k), str(v)) for k, v in options.items() if k not in DJANGO_ONLY_OPTIONS)
        params = "&".join(f"{quote(k, safe='')}={quote(v, safe='/')}" for k, v in query.items())
        return (
            f"postgresql://{auth}{'@' if auth else ''}{where}/{quote(str(name or ''), safe='')}"
            f"{'?' if params else ''}{params}"
        )
    raise ImproperlyConfigured(
        f"hybridq: the outbox supports SQLite and PostgreSQL databases, not {vendor or 'no ENGINE'!r}"
    )


def allowed_prefixes() -> tuple[str, ...]:
    """The module prefixes whose ``@task`` functions hybridq may run or name in a result.

    Every hybridq backend's ``allow``; a backend without one allows the project's own apps:
    those whose code is under ``settings.BASE_DIR`` (not in a ``site-packages``: a virtualenv
    inside the project holds third-party apps, which are not the project's), less Django's, the
    backport's and hybridq's. Read from the settings, so the worker and the web process agree.
    """
    from django.conf import settings  # noqa: PLC0415 - needs Django set up, unlike the rest

    prefixes: list[str] = []
    for params in getattr(settings, "TASKS", {}).values():
        if not str(params.get("BACKEND", "")).startswith("hybridq.contrib.django"):
            continue
        allow = parse_options(params.get("OPTIONS", {})).allow
        prefixes.extend(allow or _project_apps(getattr(settings, "BASE_DIR", None)))
    return tuple(dict.fromkeys(prefixes))


def _project_apps(base_dir: object) -> list[str]:
    """The installed apps whose code is in the project (under ``base_dir``); none without it."""
    from django.apps import apps  # noqa: PLC0415

    if not isinstance(base_dir, str | os.PathLike):
        return []
    base = Path(base_dir).resolve()
    found = []
    for config in apps.get_app_configs():
        path = Path(config.path).resolve()
        if (
            path.is_relative_to(base)
            and not {"site-packages", "dist-packages"} & set(path.parts)
            and not config.name.startswith(("django.", "django_tasks", "hybridq."))
        ):
            found.append(config.name)
    return found


def check_task_path(path: object) -> str:
    """The module of the task path ``path``, checked before anything is imported.

    One rule for the worker (what a job may run) and ``get_result`` (what a result may name):
    dotted identifiers, no private name or dunder in any part (``shop._x.tasks.f``,
    ``shop.__main__.f``), the module under an allowed prefix. NotAllowed (one line) otherwise.
    """
    parts = path.split(".") if isinstance(path, str) else []
    if len(parts) < 2 or not all(part.isidentifier() and not part.startswith("_") for part in parts):
        raise NotAllowed(f"{path!r} is not a Django task path")
    module = path.rpartition(".")[0] if isinstance(path, str) else ""
    prefixes = allowed_prefixes()
    if not under(module, prefixes):
        raise NotAllowed(
            f"Django task {path!r} is not under an allowed prefix ({', '.join(prefixes) or 'none'}); "
            "add its module to the hybridq backend's OPTIONS['allow']"
        )
    return module


def under(module: str, prefixes: Sequence[str]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or inside one (``shop.tasks`` under ``shop``)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)
