"""A task module as an application writes one: it imports ``os`` and ``subprocess``, and a class
holds imported functions. With ``HYBRIDQ_ALLOW=tests.guarded_tasks``, only what is *defined*
here may run (tests/integration/test_guard.py): ``tests.guarded_tasks.os.system`` must not.
"""

from __future__ import annotations

import os
import subprocess

import hybridq


def touch(path: str) -> str:
    """Create ``path`` (the allowed effect)."""
    with open(path, "a", encoding="utf-8"):
        pass
    return path


def _private(path: str) -> str:
    return touch(path)


class Tools:
    """A class of this module: its own functions may run, the imported ones it holds may not."""

    shell = staticmethod(os.system)
    run = staticmethod(subprocess.run)

    @staticmethod
    def touch(path: str) -> str:
        return touch(path)

    @classmethod
    def touch_cls(cls, path: str) -> str:
        return touch(path)


@hybridq.task()
def registered_touch(path: str) -> str:
    """A registered task (a ``hybridq.Task`` object, not a function)."""
    return touch(path)
