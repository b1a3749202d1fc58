"""What a run makes of its task: the call (an ``async def`` task awaited), its value, its error.

Shared by every way a delivery runs (:mod:`hybridq.worker.run`): the value is stored as tagged
JSON (:mod:`hybridq.envelope.tagged`; its ``repr()`` when that cannot hold it), the error as its
traceback, cut to :data:`MAX_ERROR_CHARS`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import traceback
from collections.abc import Callable
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.envelope.tagged import encode

__all__ = ["MAX_ERROR_CHARS", "call", "format_error", "jsonable"]

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
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def jsonable(value: Any, env: Envelope) -> tuple[Any, str]:
    """``value``'s (tagged) JSON form if it has one, else its ``repr()``; and its JSON text."""
    try:
        form = encode(value)[0]
        return form, json.dumps(form)
    except (TypeError, ValueError, RecursionError):
        log.warning("job %s (%s) returned a value JSON cannot hold; storing its repr()", env.id, env.func)
        return repr(value), json.dumps(repr(value))


def format_error(error: BaseException) -> str:
    """The traceback of ``error``, its last :data:`MAX_ERROR_CHARS` characters."""
    text = "".join(traceback.format_exception(error))
    return text if len(text) <= MAX_ERROR_CHARS else "...\n" + text[-MAX_ERROR_CHARS:]
