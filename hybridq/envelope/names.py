"""Job ids, and the checks of queue names and function paths, apart from the envelope that holds them.

:mod:`hybridq.envelope.model` re-exports every name (``from hybridq.envelope.model import
new_job_id`` keeps working).

This module must not import redis, rq, click or the journal.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable

from hybridq.errors import EnvelopeError

__all__ = [
    "function_path",
    "idempotency_id",
    "new_job_id",
    "random_bytes",
    "validate_job_id",
    "validate_queue_name",
]

_JOB_ID = re.compile(r"\A[A-Za-z0-9_-]{1,128}\Z")
_QUEUE_NAME = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
_DOTTED = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+\Z")


def new_job_id(now: float | None = None) -> str:
    """A new job id: 32 hex digits, 48 bits of milliseconds then 80 random bits.

    Sortable by creation time, unique without coordination, and a valid RQ job id.
    """
    ms = int((time.time() if now is None else now) * 1000) & 0xFFFFFFFFFFFF
    # A getrandom call per id (~0.3 us), not a batch read ahead: a process copied other than by
    # fork (a VM or container snapshot restored twice) would repeat read-ahead bytes, and the
    # id is the default idempotency key (a repeat silently drops the second job).
    return f"{ms:012x}{random_bytes(10).hex()}"


_getrandom: Callable[[int, int], bytes] | None = getattr(os, "getrandom", None)
_GRND_NONBLOCK = getattr(os, "GRND_NONBLOCK", 0)


def random_bytes(n: int) -> bytes:
    """``n`` bytes from the kernel's random source, the GIL kept where the platform allows.

    ``os.urandom`` lets the GIL go around its getrandom(2) call: with 16 threads enqueueing, the
    thread then waits to get it back, ~1.5 context switches and ~10 % of the enqueue rate
    (docs/benchmarks.md). ``os.getrandom`` makes the same call holding it; ``GRND_NONBLOCK``
    keeps that from ever blocking (it only could before the kernel's pool is first seeded,
    early at boot), and ``os.urandom`` takes over then and where there is no ``getrandom``.
    """
    global _getrandom  # dropped for good where the kernel refuses the call
    if _getrandom is not None:
        try:
            data = _getrandom(n, _GRND_NONBLOCK)
        except BlockingIOError:
            pass  # not seeded yet: os.urandom waits for it, the GIL let go
        except OSError:
            # ENOSYS (a kernel before 3.17) or EPERM (a seccomp filter): os.urandom reads
            # /dev/urandom there, and so does every later id.
            _getrandom = None
        else:
            if len(data) == n:
                return data
    return os.urandom(n)


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a valid RQ job id (``[A-Za-z0-9_-]``, at most 128), else raise."""
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise EnvelopeError(f"invalid job id {job_id!r}: use 1-128 of [A-Za-z0-9_-]")
    return job_id


def validate_queue_name(name: str) -> str:
    """Return ``name`` if it is a valid queue name, else raise :class:`EnvelopeError`."""
    if not isinstance(name, str) or not _QUEUE_NAME.match(name):
        raise EnvelopeError(
            f"invalid queue name {name!r}: use 1-128 of [A-Za-z0-9_.-], not starting with . or -"
        )
    return name


def idempotency_id(key: str) -> str:
    """An RQ-safe id for an idempotency key of any text (a hash; the key itself is kept verbatim)."""
    return "k" + hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def function_path(func: object) -> str:
    """The importable dotted path of ``func`` (a callable or a dotted-path string).

    Refuses what a worker in another process could not import: lambdas, nested functions,
    functions defined in ``__main__``, bound methods of instances, and strings that are not
    dotted paths.
    """
    if isinstance(func, str):
        if func in _CHECKED_PATHS:
            return func
        if not _DOTTED.match(func):
            raise EnvelopeError(f"{func!r} is not a dotted path like 'package.module.function'")
        if func.startswith("__main__."):
            # A worker's __main__ is the worker itself, never the module that meant the function.
            raise EnvelopeError(f"{func!r} names __main__; use the module the workers can import")
        if len(_CHECKED_PATHS) < _CHECKED_PATHS_MAX:
            _CHECKED_PATHS.add(func)
        return func
    if not callable(func):
        raise EnvelopeError(f"{func!r} is neither a callable nor a dotted path")
    self_obj = getattr(func, "__self__", None)
    if self_obj is not None and not isinstance(self_obj, type) and not _is_module(self_obj):
        raise EnvelopeError(f"{func!r} is a method bound to an instance; enqueue a module-level function")
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None)
    if not module or not qualname:
        raise EnvelopeError(f"{func!r} has no importable name")
    if "<lambda>" in qualname:
        raise EnvelopeError("lambdas cannot be enqueued: a worker could not import them")
    if "<locals>" in qualname:
        raise EnvelopeError(f"{qualname} is defined inside a function; workers cannot import it")
    if module == "__main__":
        raise EnvelopeError(f"{qualname} is defined in __main__; move it to a module the workers can import")
    return f"{module}.{qualname}"


#: Dotted-path strings found valid (a producer names the same few functions again and again).
_CHECKED_PATHS: set[str] = set()
_CHECKED_PATHS_MAX = 4096


def _is_module(obj: object) -> bool:
    return type(obj).__name__ == "module"
