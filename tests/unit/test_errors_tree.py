"""Every exception class hybridq defines belongs to one tree, drawn in hybridq.errors (issue 14.6)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import hybridq
import pytest
from hybridq import errors
from hybridq.errors import HybridqError

#: Not hybridq errors, on purpose: a chaos task's own failure stands for a user task's exception;
#: Stopped is the pusher's signal to the forwarder loop, which catches it (never a caller).
_NOT_ERRORS = {"PlannedFailure", "Stopped"}

#: Where each moved class used to live: the old import keeps working.
_REEXPORTED = {
    "hybridq.allow": ["NotAllowed"],
    "hybridq.guard": ["NotAllowed"],
    "hybridq.waiting": ["TaskUnavailable"],
    "hybridq.worker": ["NotAllowed", "DuplicateOfFailedJob", "StaleDelivery", "TaskUnavailable"],
    "hybridq.failures": ["JobNotFailed"],
    "hybridq.signing": ["SigningKeyError", "SignatureError"],
    "hybridq.redisurl": ["InvalidRedisURL"],
    "hybridq.journal.format": ["HeaderError"],
    "hybridq.journal.segment": ["SealError"],
    "hybridq.journal.fileops": ["FileOpError"],
    "hybridq.cron": ["CronError"],
    "hybridq.schedules": ["ScheduleError"],
}


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(hybridq.__path__, "hybridq."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("hybridq")
                and not name.startswith("_")  # a control-flow signal that never leaves its module
                and name not in _NOT_ERRORS
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_class_is_a_hybridq_error_defined_in_errors() -> None:
    classes = _exception_classes()
    assert len(classes) >= 28
    assert [path for path, cls in classes.items() if not issubclass(cls, HybridqError)] == []
    assert [path for path in classes if not path.startswith("hybridq.errors.")] == []


def test_the_drawn_tree_names_every_class() -> None:
    doc = errors.__doc__ or ""
    names = {cls.__name__ for cls in _exception_classes().values()}
    assert sorted(n for n in names if f" {n}" not in doc) == []
    assert sorted(names - {"HybridqError"}) == sorted(set(errors.__all__) - {"HybridqError"})


@pytest.mark.parametrize(("module", "names"), sorted(_REEXPORTED.items()))
def test_moved_classes_are_reexported_where_they_were(module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    for name in names:
        assert getattr(imported, name) is getattr(errors, name)


def test_other_bases_are_kept() -> None:
    # `except ValueError` clauses around these keep working.
    for cls in (errors.HeaderError, errors.InvalidRedisURL, errors.EnvelopeError, errors.ConfigError):
        assert issubclass(cls, ValueError)
    assert issubclass(errors.NotSerializable, TypeError)
