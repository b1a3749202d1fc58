"""The enqueue call's checks, apart from :class:`hybridq.producer.queue.Queue` that uses them.

``split_call`` splits ``enqueue(f, *args, **kwargs)``'s keywords into the function's and the
options (shared with ``hybridq.outbox``); ``task_path`` is the function's dotted path, a name
that a module imported here lacks refused; the ``_`` helpers check a queue's defaults and a call's
options (retry policy, durations, delay or run time) and copy a journal error for each caller of a
batch. :mod:`hybridq.producer.queue` imports them all, so every name stays importable from there.

This module must not import redis or rq.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hybridq.envelope.limits import MAX_SECONDS, check_seconds, check_time
from hybridq.envelope.model import Envelope, Retry, function_path
from hybridq.errors import EnvelopeError, JournalIOError, RecordTooLarge
from hybridq.journal import MAX_PAYLOAD_BYTES
from hybridq.security import allow
from hybridq.security.signing import Keyring, keyring

__all__ = ["check_options", "encode_envelopes", "split_call", "task_path"]

_OPTIONS = (
    *("job_timeout", "result_ttl", "description", "meta", "retry", "job_id", "delay", "run_at"),
    *("priority", "limit_key", "depends_on"),
)
#: ``rq.Queue.enqueue`` options hybridq does not support: refused rather than silently handed to
#: the function (which would then fail in the worker).
_RQ_ONLY_OPTIONS = frozenset(
    {
        "ttl",
        "failure_ttl",
        "at_front",
        "on_success",
        "on_failure",
        "on_stopped",
        "pipeline",
        "timeout",
        "group_id",
        "repeat",
        "rate_limit",
        "webhooks",
        "unique",
    }
)


def split_call(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    """Split ``enqueue(f, *args, **kwargs)``'s keywords into the function's and the options.

    Shared by :meth:`Queue.enqueue` and ``hybridq.outbox.Outbox.enqueue``: RQ's own options are
    refused, and RQ's explicit form ``enqueue(f, args=(...), kwargs={...}, **options)`` works.
    """
    unsupported = sorted(_RQ_ONLY_OPTIONS.intersection(kwargs))
    if unsupported:
        raise EnvelopeError(
            f"enqueue option(s) {', '.join(unsupported)} are RQ's and not supported by hybridq; "
            "if they are your function's arguments, use enqueue_call(f, args, kwargs)"
        )
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    if "args" in kwargs or "kwargs" in kwargs:
        # rq's explicit form: enqueue(f, args=(...), kwargs={...}, **options)
        if args or set(kwargs) - {"args", "kwargs"}:
            raise EnvelopeError("with explicit args=/kwargs=, pass no other arguments")
        args = tuple(kwargs.pop("args", None) or ())
        kwargs = dict(kwargs.pop("kwargs", None) or {})
    return args, kwargs, options


def check_options(
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    idempotency_key: str | None,
    description: str | None,
    meta: Mapping[str, Any] | None,
    retry: Retry | None,
) -> None:
    """Refuse a call's arguments and options that a worker could not run or Redis could not store.

    Raises :class:`EnvelopeError` (a ``ValueError``) before anything is built or written.
    """
    # type() checks first: isinstance against the ABCs costs a microsecond per call.
    if type(args) not in (tuple, list) and (isinstance(args, str | bytes) or not isinstance(args, Sequence)):
        raise EnvelopeError("args must be a list or tuple")
    if kwargs is not None and type(kwargs) is not dict and not isinstance(kwargs, Mapping):
        raise EnvelopeError("kwargs must be a mapping")
    if kwargs and any(type(name) is not str for name in kwargs):
        raise EnvelopeError("kwargs names must be strings")
    if idempotency_key is not None and (not isinstance(idempotency_key, str) or not idempotency_key):
        raise EnvelopeError("idempotency_key must be a non-empty string")
    if description is not None and not isinstance(description, str):
        raise EnvelopeError("description must be a string")  # Redis could not store it (issue 13)
    if meta is not None and not isinstance(meta, Mapping):
        raise EnvelopeError("meta must be a mapping")
    if meta and "hybridq" in meta:
        raise EnvelopeError("meta key 'hybridq' is reserved for hybridq's own bookkeeping")
    if retry is not None:
        _check_retry(retry)


def _signed(ring: Keyring, env: Envelope) -> Envelope:
    """``env`` signed, still marked fresh if it was (signing decodes the record: the mark is not in it)."""
    signed = ring.sign(env)
    signed._fresh_key = env._fresh_key
    return signed


def encode_envelopes(jobs: Iterable[Envelope]) -> tuple[list[Envelope], list[bytes]]:
    """Check, sign and serialize envelopes for ``Queue._commit`` (raises before anything is written)."""
    envelopes = list(jobs)
    for env in envelopes:
        if not isinstance(env, Envelope):
            raise TypeError("enqueue_many takes envelopes from Queue.prepare(...)")
    ring = keyring()  # read per call, not per Queue: a rotated key file applies at once
    if ring is not None:
        envelopes = [_signed(ring, env) for env in envelopes]
    payloads = []
    for env in envelopes:
        payload = env.to_bytes()
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise RecordTooLarge(len(payload), MAX_PAYLOAD_BYTES)
        payloads.append(payload)
    return envelopes, payloads


def _check_retry(retry: object) -> None:
    if not isinstance(retry, Retry):
        raise EnvelopeError("retry must be a hybridq.Retry")
    if max(retry.backoff_s, retry.backoff_max_s) > MAX_SECONDS:
        raise EnvelopeError(f"Retry backoffs must be at most {MAX_SECONDS} seconds (ten years)")


def _seconds(name: str, value: float | None) -> float | None:
    """A positive duration of at most ``MAX_SECONDS`` (larger ones break inside RQ), or ``None``.

    A queue's defaults are checked once, when it is made, not again at every enqueue.
    """
    return None if value is None else check_seconds(name, value)


def _run_at(
    now: float, delay: float | dt.timedelta | None, run_at: float | dt.datetime | None
) -> float | None:
    if delay is not None and run_at is not None:
        raise EnvelopeError("give delay or run_at, not both")
    if isinstance(delay, dt.timedelta):
        delay = delay.total_seconds()
    if delay is not None:
        seconds = check_seconds("delay", delay, zero=True)  # a number or a timedelta
        return now + seconds if seconds > 0 else None
    if isinstance(run_at, dt.datetime):
        if run_at.tzinfo is None:
            raise EnvelopeError("run_at must be timezone-aware (e.g. datetime.now(timezone.utc))")
        return check_time("run_at", run_at.timestamp())
    return None if run_at is None else check_time("run_at", run_at)


#: One call's envelopes and their serialized records, as ``Queue._commit`` takes them.
_Call = tuple[list[Envelope], list[bytes]]


def _copy_io_error(exc: JournalIOError) -> JournalIOError:
    """The same failure for another caller of the same journal batch (each names its own jobs)."""
    cause = exc.__cause__
    if not isinstance(cause, OSError):
        cause = OSError(exc.errno, os.strerror(exc.errno) if exc.errno else str(exc))
    copy = JournalIOError(exc.path, exc.op, cause)
    copy.__cause__ = cause
    return copy


#: Dotted-path names checked by :func:`task_path`: ``True`` found, else how many modules this
#: process had imported when none of the name's could be looked at (checked again once it has
#: imported more). Bounded: past it, names are checked at every enqueue.
_NAMES: dict[str, bool | int] = {}
_NAMES_MAX = 4096


def task_path(func: Callable[..., Any] | str) -> str:
    """The dotted path of ``func`` (:func:`~hybridq.envelope.model.function_path`), checked to exist.

    A name given as a string whose module this process has imported, and that the module lacks
    (``tasks.sendd``), raises :class:`~hybridq.errors.NoSuchTask`: no worker could ever run it
    (docs/enqueue.md). Nothing is imported for the check; a name checked before costs a lookup.
    """
    if type(func) is not str:
        return function_path(func)  # a function or class object: it exists
    seen = _NAMES.get(func)
    if seen is True or seen == len(sys.modules):
        return func  # checked before (function_path too): one lookup per enqueue, as before
    path = function_path(func)
    found = allow.check_name(path)
    if len(_NAMES) < _NAMES_MAX:
        _NAMES[path] = True if found else len(sys.modules)
    return path
