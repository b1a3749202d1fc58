"""Every exception class hybridq defines belongs to one tree, drawn in hybridq.errors (issue 14.6)."""

from __future__ import annotations

import gc
import importlib
import pickle
import pkgutil
from collections.abc import Iterator

import hybridq
import pytest
from hybridq import errors
from hybridq.errors import HybridqError

#: Not hybridq errors, on purpose (by where they are defined, so a new class of the same name
#: elsewhere is still caught): a chaos task's own failure stands for a user task's exception;
#: NotStarted is the pool's signal that a task was not called (its claim is gone), a
#: BaseException so that the outcome's recording of the task's exceptions cannot take it for
#: the task's own failure, and caught inside the worker package (hybridq.worker.perform).
_NOT_ERRORS = {
    "hybridq.testing.chaos.PlannedFailure",
    "hybridq.worker.runner.NotStarted",
    "hybridq.testing.torture_stack.HarnessError",  # the torture harness's own failure: no verdict on hybridq
    "hybridq.forwarder.flow_steps.StepFailed",  # a workflow's end, caught in hybridq.forwarder.flows
    # a spill write held back (the journal's free space), an OSError the ledger index catches
    "hybridq.ledger.spill_files.SpillRefused",
}

#: Where each moved class used to live: the old import keeps working.
_REEXPORTED = {
    "hybridq.security.allow": ["NotAllowed"],
    "hybridq.worker.guard": ["NotAllowed"],
    "hybridq.worker.waiting": ["TaskUnavailable"],
    "hybridq.worker.values": ["UnexpectedCancel"],
    "hybridq.worker": ["NotAllowed", "DuplicateOfFailedJob", "StaleDelivery", "TaskUnavailable"],
    "hybridq.ops.failures": ["JobNotFailed"],
    "hybridq.security.signing": ["SigningKeyError", "SignatureError"],
    "hybridq.transport.redisurl": ["InvalidRedisURL"],
    "hybridq.journal.format": ["HeaderError"],
    "hybridq.journal.segment": ["SealError"],
    "hybridq.journal.fileops": ["FileOpError"],
    "hybridq.cron": ["CronError"],
    "hybridq.schedules": ["ScheduleError"],
    "hybridq.forwarder.push": ["Stopped"],
    "hybridq.http.node": ["NodeDown"],
    "hybridq.http.answers": ["Forbidden"],
}


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class the package defines, once its modules are imported.

    Found through the subclasses of BaseException, not the modules' names: a class nested in
    another, defined in a function or kept under another name counts too.
    """
    for info in pkgutil.walk_packages(hybridq.__path__, "hybridq."):
        importlib.import_module(info.name)
    found: dict[str, type[BaseException]] = {}
    for cls in _subclasses(BaseException):
        path = f"{cls.__module__}.{cls.__qualname__}"
        if (
            cls.__module__.split(".")[0] == "hybridq"
            and not cls.__name__.startswith("_")  # a control-flow signal that never leaves its module
            and path not in _NOT_ERRORS
        ):
            found[path] = cls
    return found


def test_every_exception_class_is_a_hybridq_error_defined_in_errors() -> None:
    classes = _exception_classes()
    assert len(classes) >= 28
    assert [path for path, cls in classes.items() if not issubclass(cls, HybridqError)] == []
    # Exactly hybridq.errors, not a private module of it: the path users catch and pickles hold.
    assert [path for path, cls in classes.items() if cls.__module__ != "hybridq.errors"] == []


def test_every_error_pickles_by_its_public_path() -> None:
    # A pickle names the class by __module__ and __qualname__: the path must resolve to the class
    # in code as it was before errors.py became a package, where every class lived in one module.
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert (cls.__module__, cls.__qualname__) == ("hybridq.errors", name)
        assert b"hybridq.errors\x94" in pickle.dumps(cls, protocol=4)
        assert pickle.loads(pickle.dumps(cls)) is cls
    error = pickle.loads(pickle.dumps(errors.RetryLaterExpired("spun")))
    assert type(error) is errors.RetryLaterExpired
    assert error.args == ("spun",)


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


def test_a_class_outside_the_tree_is_found_wherever_it_is_defined() -> None:
    # Defined in a function, nested in a class, named like an old exception: still found.
    def define() -> type[BaseException]:
        class Holder:
            class Stopped(Exception):
                pass

        Holder.Stopped.__module__ = "hybridq.somewhere"
        return Holder.Stopped

    stray = define()
    try:
        found = [path for path, cls in _exception_classes().items() if cls is stray]
        assert len(found) == 1
        assert found[0].endswith("define.<locals>.Holder.Stopped")
    finally:
        del stray
        gc.collect()  # gone from BaseException's subclasses before another test looks
    assert not [path for path in _exception_classes() if path.startswith("hybridq.somewhere")]
