"""Which functions a worker may run: Redis write access must not mean code execution.

RQ imports whatever dotted path a job hash names. hybridq's worker runs a job's function only if
it was registered with :func:`hybridq.task` in the worker's process, or it is *defined* in a
module under a prefix the operator allows (``hybridq worker --allow app.tasks``, or the
environment variable ``HYBRIDQ_ALLOW=app.tasks,billing`` for any worker, a plain ``rq worker``
included). A job naming anything else fails for good, with an error that says how to allow it.

A prefix allows what its modules define, not what they import: with ``--allow app.tasks``,
``app.tasks.os.system`` is refused although ``app/tasks.py`` imports ``os``. :func:`resolve`
finds the function itself, never through RQ's ``import_attribute``:

1. the path must be registered or under an allowed prefix (text), with no ``__dunder__`` part;
   nothing outside the allowed modules is imported for it;
2. the module is the longest prefix of the path that imports as a module (``app.tasks``);
3. the rest is walked with ``getattr`` through classes only: never through a module, an
   instance or a function, and never to a name starting with ``_``;
4. what it finds must be a function, a class or a class's ``classmethod`` whose ``__module__``
   (and that of every class walked through) is under an allowed prefix, or the very task
   registered under that path;
5. a class must also be *constructed* by code of the allowed modules: what calling it runs, the
   ``__new__`` and ``__init__`` it has through its MRO and its metaclass's ``__call__``, must each
   be ``object``'s or ``type``'s own, or a function defined under an allowed prefix. A class
   defined here that inherits its constructor (``class Proc(subprocess.Popen): pass``) would
   run the standard library with the job's arguments: the class form of
   ``staticmethod(os.system)``, refused as that is.

``HYBRIDQ_ALLOW=*`` allows every callable the walk reaches (RQ's behaviour; not recommended).

This module must not import redis, rq or the journal (producers and workers both use it).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from hybridq.errors import NoSuchTask, NotAllowed

__all__ = [
    "ENV_VAR",
    "NoSuchTask",
    "NotAllowed",
    "allowed",
    "allowed_prefixes",
    "check_name",
    "refusal",
    "register",
    "resolve",
]

#: The environment variable holding the allowed module prefixes, comma-separated.
ENV_VAR = "HYBRIDQ_ALLOW"

_registered: set[str] = set()


def register(path: str) -> None:
    """Allow ``path`` in this process (``hybridq.task`` calls this for every task it makes)."""
    _registered.add(path)


def allowed_prefixes() -> tuple[str, ...]:
    """The prefixes in ``HYBRIDQ_ALLOW`` (read on each call: ``hybridq worker --allow`` sets it)."""
    raw = os.environ.get(ENV_VAR, "")
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def allowed(path: str) -> bool:
    """Whether ``path`` passes the text check (step 1): registered, or under an allowed prefix.

    Passing it is not enough to run: :func:`resolve` also checks what the path leads to.
    """
    if path in _registered:
        return True
    return _under_prefix(path, allowed_prefixes())


def _under_prefix(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(prefix in ("*", name) or name.startswith(prefix + ".") for prefix in prefixes)


def refusal(path: str) -> str:
    """The error for a refused function: what it is, and how to allow it.

    Never a hint to allow the standard library (``--allow os`` would let every job run
    ``os.system``): such a function is to be called from a task of one's own.
    """
    module = path.rpartition(".")[0]
    top = path.partition(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return (
            f"{path} is not allowed to run on this worker: it is in Python's standard library "
            f"({top}); enqueue a task of your own that calls it (see docs/security.md)"
        )
    return (
        f"{path} is not allowed to run on this worker: decorate it with @hybridq.task and have the "
        f"worker import its module, or allow the module that defines it (hybridq worker --allow "
        f"{module}, or {ENV_VAR}={module}); see docs/security.md"
    )


def resolve(path: str, extra: tuple[str, ...] = ()) -> Callable[..., Any]:
    """The function at ``path``, if this worker may run it (see the module docstring).

    ``extra``: prefixes allowed besides ``HYBRIDQ_ALLOW``'s (``hybridq.testing``'s ``allow=``).

    Raises:
        NotAllowed: the path, or what it leads to, is not allowed (nothing outside the allowed
            modules was imported).
        NoSuchTask: the module imports, but lacks the name (:func:`_attribute`).
        ImportError, AttributeError: an allowed module does not exist here or fails to import,
            or a package lacks a module (it may be a newer deploy's).
    """
    prefixes = allowed_prefixes() + extra
    parts = path.split(".") if isinstance(path, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise NotAllowed(f"{path!r} is not a dotted path")
    if not (path in _registered or _under_prefix(path, prefixes)) or any(p.startswith("__") for p in parts):
        raise NotAllowed(refusal(path))
    everything = "*" in prefixes
    module, walked = _longest_module(parts)
    obj: Any = module
    for i, name in enumerate(parts[walked:], start=walked):
        if not everything:
            if obj is not module and not (
                isinstance(obj, type) and (path in _registered or _defined_under(obj, prefixes))
            ):
                raise NotAllowed(
                    f"{path}: {name} is looked up on {obj!r}, not on a class of an allowed module"
                )
            if name.startswith("_"):
                raise NotAllowed(f"{path}: {name} is private; {refusal(path)}")
        obj = _attribute(obj, ".".join(parts[:i]), name, path, last=i == len(parts) - 1, hint=_WORKER_HINT)
        if isinstance(obj, types.ModuleType) and not everything:
            raise NotAllowed(f"{path}: {name} is a module the allowed one imports; {refusal(path)}")
    if everything or path in _registered:  # registered once the module is imported
        if not callable(obj):
            raise NotAllowed(f"{path} is not callable")
        return obj  # type: ignore[no-any-return]
    if not (inspect.isfunction(obj) or isinstance(obj, type) or _is_classmethod(obj)):
        raise NotAllowed(f"{path} is not a function or a class ({type(obj).__name__}); {refusal(path)}")
    if not _defined_under(obj, prefixes):
        raise NotAllowed(
            f"{path} is {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}, "
            f"defined outside the allowed modules; {refusal(path)}"
        )
    if isinstance(obj, type):
        foreign = _foreign_constructor(obj, prefixes)
        if foreign is not None:
            raise NotAllowed(
                f"{path} is not allowed to run on this worker: it is a class whose call runs {foreign}, "
                "defined outside the allowed modules (give the class an __init__ of its own, or "
                "enqueue a function that builds it; see docs/security.md)"
            )
    return obj  # type: ignore[no-any-return]


#: What calling a class runs, and the harmless default of each: ``type.__call__`` runs the
#: class's ``__new__`` and ``__init__``; ``object``'s do nothing with the arguments.
_CONSTRUCTION = (("__new__", object, False), ("__init__", object, False), ("__call__", type, True))


def _foreign_constructor(cls: type, prefixes: tuple[str, ...]) -> str | None:
    """The name of what calling ``cls`` runs that is defined outside ``prefixes``; ``None``: none.

    Each of ``__new__``, ``__init__`` (found through the class's MRO) and its metaclass's
    ``__call__`` (through the metaclass's MRO) must be the harmless default or a Python function
    whose ``__module__`` is allowed. A builtin's slot (``dict.__init__``), another module's
    function or a callable object is foreign.
    """
    for name, default, on_metaclass in _CONSTRUCTION:
        owner = next(k for k in (type(cls) if on_metaclass else cls).__mro__ if name in vars(k))
        if owner is default:
            continue
        attr = vars(owner)[name]
        func = attr.__func__ if isinstance(attr, staticmethod | classmethod) else attr
        if not (inspect.isfunction(func) and _defined_under(func, prefixes)):
            module = getattr(func, "__module__", None) or owner.__module__
            return f"{module}.{getattr(func, '__qualname__', f'{owner.__qualname__}.{name}')}"
    return None


#: What a worker that finds no such function says to do.
_WORKER_HINT = (
    "a typo, or a task newer than this code: deploy workers before the producers that use it, "
    "then hybridq failed requeue"
)


def check_name(path: str) -> bool:
    """Whether ``path`` names something, as far as the modules imported in this process tell.

    For producers, which need not have the task code: nothing is imported here. ``True``: found;
    ``False``: no module of the path is imported here (or a package lacks a module on it), so
    only a worker can tell. Raises :class:`NoSuchTask` when an imported module (or a class of
    it) lacks the name: the job could never run. Not the allowlist: producers do not know it.
    """
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:n]))
        if module is not None:
            break
    else:
        return False
    obj: Any = module
    try:
        for i in range(n, len(parts)):
            hint = "nothing was enqueued"
            obj = _attribute(obj, ".".join(parts[:i]), parts[i], path, last=i == len(parts) - 1, hint=hint)
    except NoSuchTask:
        raise
    except AttributeError:
        return False  # a package's module that is not imported here
    return True


def _attribute(obj: Any, owner: str, name: str, path: str, *, last: bool, hint: str) -> Any:
    """``getattr(obj, name)``; a name ``obj`` lacks is :class:`NoSuchTask`, unless it may be a module.

    ``obj`` (named ``owner``) imported here, so the name is a typo or a task newer than this
    code: the job can never run here. But a package may lack a *module* this worker's version
    does not have yet (a rolling deploy): a name missing from a package, that is not the path's
    last (a module is not what a job calls), stays an ``AttributeError`` (the job is left for
    another worker: :mod:`hybridq.worker.waiting`).
    """
    try:
        return getattr(obj, name)
    except AttributeError:
        if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__") and not last:
            raise
        raise NoSuchTask(f"no such function {path}: {owner} has no attribute {name!r} ({hint})") from None


def _longest_module(parts: list[str]) -> tuple[types.ModuleType, int]:
    """The module named by the longest prefix of ``parts`` that is one, and that prefix's length.

    The whole path is never a module (a module is not callable); a shorter prefix is tried only
    when the longer one is not a module (``ModuleNotFoundError`` for it or a parent of it, which
    Python imported, or tried to, on the way): nothing but the path's own packages is imported.
    """
    for n in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:n])
        module = sys.modules.get(name)
        if module is not None:
            return module, n
        try:
            return importlib.import_module(name), n
        except ModuleNotFoundError as exc:
            if n == 1 or exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise  # no module at all, or the module exists but something it imports does not
    raise ModuleNotFoundError(f"no module in {'.'.join(parts)!r}", name=parts[0])


def _is_classmethod(obj: object) -> bool:
    return inspect.ismethod(obj) and isinstance(obj.__self__, type) and inspect.isfunction(obj.__func__)


def _defined_under(obj: object, prefixes: tuple[str, ...]) -> bool:
    """Whether ``obj`` (a function, class or classmethod) was defined under an allowed prefix.

    Its module, or its full name (a prefix may name one function or class:
    ``HYBRIDQ_ALLOW=app.tasks.send``), must be under one.
    """
    target = obj.__func__ if _is_classmethod(obj) else obj  # type: ignore[attr-defined]
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not isinstance(module, str):
        return False
    return _under_prefix(module, prefixes) or (
        isinstance(qualname, str) and _under_prefix(f"{module}.{qualname}", prefixes)
    )
