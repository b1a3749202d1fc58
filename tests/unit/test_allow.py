"""hybridq.security.allow.resolve: what an allowed prefix lets a job name (issue 13.1), without Redis."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hybridq.errors import NoSuchTask, NotAllowed
from hybridq.security.allow import resolve

from tests import guarded_tasks


@pytest.fixture(autouse=True)
def _allow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDQ_ALLOW", "tests.guarded_tasks")


@pytest.mark.parametrize(
    "path",
    [
        "tests.guarded_tasks.os.system",
        "tests.guarded_tasks.os.path.join",
        "tests.guarded_tasks.subprocess.run",
        "tests.guarded_tasks.__builtins__.__setitem__",
        "tests.guarded_tasks.__loader__.load_module",
        "tests.guarded_tasks.Tools.shell",
        "tests.guarded_tasks.Tools.run",
        "tests.guarded_tasks.Tools.__init__",
        "tests.guarded_tasks.Tools.mro",
        "tests.guarded_tasks.touch.__globals__",
        "tests.guarded_tasks._private",
        "tests.guarded_tasks.hybridq.task",
        "tests.tasks.add",  # another module of the package: not under the prefix
        "tests.guarded_tasksX.touch",
        "os.system",
        "tests.guarded_tasks",
        "tests.guarded_tasks.touch;rm",
    ],
)
def test_what_the_module_imports_or_hides_is_refused(path: str) -> None:
    with pytest.raises(NotAllowed):
        resolve(path)


def test_what_the_module_defines_resolves_to_itself() -> None:
    assert resolve("tests.guarded_tasks.touch") is guarded_tasks.touch
    assert resolve("tests.guarded_tasks.Tools") is guarded_tasks.Tools
    assert resolve("tests.guarded_tasks.Tools.touch") is guarded_tasks.Tools.touch
    assert resolve("tests.guarded_tasks.Tools.touch_cls") == guarded_tasks.Tools.touch_cls
    assert resolve("tests.guarded_tasks.registered_touch") is guarded_tasks.registered_touch


def test_a_registered_task_runs_without_any_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDQ_ALLOW")
    assert resolve("tests.guarded_tasks.registered_touch") is guarded_tasks.registered_touch
    with pytest.raises(NotAllowed):
        resolve("tests.guarded_tasks.touch")


def test_a_missing_function_or_module_is_an_error_not_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AttributeError):
        resolve("tests.guarded_tasks.no_such_function")
    monkeypatch.setenv("HYBRIDQ_ALLOW", "tests.no_such_module")
    with pytest.raises((ModuleNotFoundError, AttributeError)):
        resolve("tests.no_such_module.f")


def test_nothing_outside_the_allowed_prefix_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDQ_ALLOW", "tests.guarded_tasks")
    sys.modules.pop("tests.import_canary", None)
    with pytest.raises(NotAllowed):
        resolve("tests.import_canary.run")
    assert "tests.import_canary" not in sys.modules


def test_a_star_allows_every_callable_the_walk_reaches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDQ_ALLOW", "*")
    assert resolve("os.system") is os.system
    assert resolve("tests.guarded_tasks.subprocess.run") is subprocess.run


def test_a_prefix_may_name_one_function_or_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDQ_ALLOW", "tests.guarded_tasks.touch,tests.guarded_tasks.Tools")
    assert resolve("tests.guarded_tasks.touch") is guarded_tasks.touch
    assert resolve("tests.guarded_tasks.Tools.touch") is guarded_tasks.Tools.touch
    for path in ("tests.guarded_tasks.Tools.shell", "tests.guarded_tasks.touch_other"):
        with pytest.raises(NotAllowed):
            resolve(path)


@pytest.mark.parametrize(
    "path",
    [
        "tests.guarded_tasks.Proc",  # subprocess.Popen's constructor, inherited
        "tests.guarded_tasks.Log",  # logging.FileHandler's
        "tests.guarded_tasks.Archive",  # zipfile.ZipFile's
        "tests.guarded_tasks.Held",  # Popen.__init__ held under the class's own name
        "tests.guarded_tasks.Color",  # enum's metaclass __call__
    ],
)
def test_a_class_whose_call_runs_a_constructor_defined_elsewhere_is_refused(path: str) -> None:
    """Issue 27 (HIGH): ``class Proc(subprocess.Popen): pass`` ran a shell command for a Redis writer."""
    with pytest.raises(NotAllowed, match="defined outside the allowed modules"):
        resolve(path)


def test_a_class_whose_constructor_and_metaclass_call_are_defined_here_resolves() -> None:
    for name in ("Note", "ChildNote", "MadeNote", "Record", "Tools"):
        assert resolve(f"tests.guarded_tasks.{name}") is getattr(guarded_tasks, name)


@pytest.mark.parametrize(
    "path",
    [
        "tests.guarded_tasks.touch_partial",  # functools.partial(os.system)
        "tests.guarded_tasks.caller",  # an instance with __call__
        "tests.guarded_tasks.caller.__call__",
        "tests..guarded_tasks.touch",  # empty parts
        "tests.guarded_tasks.touch.",
        ".tests.guarded_tasks.touch",
        "tests.guarded_tasks:touch",  # the module:attribute form
        "tests.guarded_tasks.ｔｏｕｃｈ",  # fullwidth letters: an identifier, another name  # noqa: RUF001
        "ｔｅｓｔｓ.guarded_tasks.touch",  # noqa: RUF001
        "",
    ],
)
def test_what_held_in_the_review_stays_refused(path: str) -> None:
    """Issue 27's "what held": partials, callable instances, empty parts, ``module:attr``,
    fullwidth names (Python folds them in source, not in ``getattr``) are refused (or, under
    the allowed prefix, no such function): nothing runs."""
    with pytest.raises((NotAllowed, NoSuchTask)):
        resolve(path)
