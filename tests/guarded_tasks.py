"""A task module as an application writes one: it imports ``os`` and ``subprocess``, and a class
holds imported functions. With ``HYBRIDQ_ALLOW=tests.guarded_tasks``, only what is *defined*
here may run (tests/integration/test_guard.py): ``tests.guarded_tasks.os.system`` must not.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import subprocess
import zipfile

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


# Classes whose call runs a constructor defined elsewhere (issue 27, HIGH): each is defined here,
# but calling it runs the standard library's ``__init__``/``__new__`` with the job's arguments.


class Proc(subprocess.Popen):  # type: ignore[type-arg]
    """Runs a command: Popen's constructor, inherited."""


class Log(logging.FileHandler):
    """Creates or truncates a file: FileHandler's constructor, inherited."""


class Archive(zipfile.ZipFile):
    """Creates or truncates a file: ZipFile's constructor, inherited."""


class Held:
    """A constructor taken from another module, held under this class's name."""

    __init__ = subprocess.Popen.__init__


class Made(type):
    """A metaclass whose call is defined here (allowed)."""

    def __call__(cls, *args: object, **kwargs: object) -> object:
        return super().__call__(*args, **kwargs)


class Note:
    """A class whose constructor is defined here (allowed): it touches ``path``."""

    def __init__(self, path: str) -> None:
        touch(path)

    def __repr__(self) -> str:
        return "Note()"


class ChildNote(Note):
    """Inherits the constructor of a class of this module (allowed)."""


class MadeNote(Note, metaclass=Made):
    """A constructor and a metaclass call, both defined here (allowed)."""


@dataclasses.dataclass
class Record:
    """A dataclass: its generated ``__init__`` belongs to this module (allowed)."""

    path: str

    def __post_init__(self) -> None:
        touch(self.path)


class Color(enum.Enum):
    """A metaclass call (EnumType's) defined in the standard library: refused."""

    RED = "red"


# Callables that are neither functions nor classes (what held in issue 27's review): refused.
touch_partial = functools.partial(os.system)


class _Caller:
    def __call__(self, command: str) -> int:
        return os.system(command)


caller = _Caller()
