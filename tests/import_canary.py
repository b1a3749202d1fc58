"""A module that records every import of it, and every call: workers' guards must never import it.

When ``HYBRIDQ_TEST_CANARY`` names a file, importing this module appends ``imported <pid>`` to it
and each function appends ``<name> <pid>``, whatever process does it (a worker, its work-horse).
"""

from __future__ import annotations

import os

#: The environment variable naming the record file.
ENV_VAR = "HYBRIDQ_TEST_CANARY"


def _record(event: str) -> None:
    path = os.environ.get(ENV_VAR)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{event} {os.getpid()}\n")


_record("imported")


def run(*args: object, **kwargs: object) -> str:
    """What a job hash planted in Redis would name."""
    _record("ran")
    return "ran"


def callback(*args: object, **kwargs: object) -> None:
    """What a planted RQ callback (on_success, on_failure, on_stopped) would name."""
    _record("callback")
