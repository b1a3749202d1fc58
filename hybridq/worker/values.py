"""What a run makes of its task: the call (an ``async def`` task awaited), its value, its error.

Shared by every way a delivery runs (:mod:`hybridq.worker.run`): the value is stored as tagged
JSON (:mod:`hybridq.envelope.tagged`; its ``repr()`` when that cannot hold it), the error as its
traceback, cut to :data:`MAX_ERROR_CHARS`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import threading
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

from hybridq.envelope.codec import dumps_ascii
from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import encode, result_repr
from hybridq.errors import UnexpectedCancel

__all__ = ["MAX_ERROR_CHARS", "UnexpectedCancel", "call", "format_error", "jsonable", "own_cancel"]

log = logging.getLogger("hybridq.worker")

#: The most characters of a failure's traceback kept in its outcome (the end is kept).
MAX_ERROR_CHARS = 8192


def call(func: Callable[..., Any], env: Envelope) -> Any:
    """``func(*args, **kwargs)`` of ``env``; an ``async def`` task is run on an event loop of its own.

    RQ's loop (``--rq``, ``--simple``, a plain ``rq worker``) calls every task this way; the pool
    runs ``async def`` tasks on its process's loop instead (:mod:`hybridq.worker.perform`).
    """
    args, kwargs = env.call_args()  # tagged values decoded (hybridq.envelope.tagged)
    value = func(*args, **kwargs)
    if not inspect.iscoroutine(value):
        return value
    # Only where asyncio.run installs its Ctrl-C handler (the main thread, Python's own SIGINT
    # handler) can something outside cancel its task; RQ's work-horse ignores SIGINT and
    # SimpleWorker installs its own, so there a CancelledError is always the task's.
    interruptible = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    value, error = asyncio.run(_settled(value, interruptible=interruptible))
    if error is None:
        return value
    try:
        raise error
    finally:
        del error  # not kept as this frame ends: it is in its traceback (a reference cycle)


def own_cancel(error: asyncio.CancelledError) -> UnexpectedCancel:
    """``error``, a ``CancelledError`` the task ended with that hybridq did not ask for, as its failure.

    Neither a stop (a cancel's grace run out) nor its timeout (both are told apart before this
    is asked), nor, under RQ's loop, ``asyncio.run``'s Ctrl-C: the task raised it, or awaited a
    task or future that something else cancelled (another job's timeout, when they share one:
    ``asyncio.shield`` keeps a shared one from passing it on). Taken for a cancel from outside,
    it recorded nothing and the job ran again as ``lost``, the same error each time
    (docs/worker.md). Callers keep no name bound to the result: its cause's traceback holds
    their frame (a reference cycle that would keep the task's data until a collection).
    """
    failure = UnexpectedCancel(
        "the task ended with asyncio.CancelledError, which neither a stop nor its timeout asked "
        f"for (raised by the task, or by a task or future it awaited that was cancelled): {error!r}"
    )
    failure.__cause__ = error
    return failure


async def _settled(coro: Coroutine[Any, Any, Any], *, interruptible: bool) -> tuple[Any, Exception | None]:
    """What ``coro`` returned, or the error it raised, as the result of ``asyncio.run``'s task.

    A task that ends with an error keeps it, and the error's traceback holds the frame that
    holds the task (``asyncio.run``'s): a reference cycle that would hold a failed task's
    frames and data until a collection. A ``CancelledError`` the task raised itself is its failure
    (:func:`own_cancel`); anything else but an ``Exception`` (a cancel from outside, ``SystemExit``)
    is left to ``asyncio.run``, as before.
    """
    try:
        return await coro, None
    except Exception as exc:
        return None, exc
    except asyncio.CancelledError as exc:
        if interruptible and _cancel_asked():
            raise  # asyncio.run's Ctrl-C
        return None, own_cancel(exc)


def _cancel_asked() -> bool:
    """Whether the running task holds a cancel request (asyncio.run's Ctrl-C makes one)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def jsonable(value: Any, env: Envelope) -> tuple[Any, str]:
    """``value``'s (tagged) JSON form if it has one, else its ``repr()``; and its JSON text."""
    try:
        form = encode(value)[0]
        # json.dumps's text, without the encoder json.dumps builds per call (one per job).
        return form, dumps_ascii(form)
    except Exception:  # TypeError, ValueError, RecursionError, or what a value's own hooks raise
        log.warning("job %s (%s) returned a value JSON cannot hold; storing its repr()", env.id, env.func)
    text = result_repr(value)
    return text, dumps_ascii(text)


def format_error(error: BaseException) -> str:
    """The traceback of ``error``, its last :data:`MAX_ERROR_CHARS` characters."""
    text = "".join(traceback.format_exception(error))
    return text if len(text) <= MAX_ERROR_CHARS else "...\n" + text[-MAX_ERROR_CHARS:]
