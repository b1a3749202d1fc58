"""OpenTelemetry spans of a job: its enqueue, the forwarder's push, its run (docs/observability.md).

Optional twice over: nothing here imports ``opentelemetry`` unless the application did (its
``opentelemetry-api``, the ``otel`` extra), and nothing is recorded unless a tracer provider is
configured (``trace.set_tracer_provider(...)``, or ``opentelemetry-instrument``). Otherwise each
hook is one dictionary look-up: :func:`tracer` returns ``None``.

- the enqueue (:func:`enqueue_carrier`, in ``Queue.prepare``): a ``PRODUCER`` span
  ``hybridq.enqueue``, whose context (W3C ``traceparent``, and what else the configured
  propagator writes) is stored in the job's envelope (``trace``);
- the forwarder's push (:func:`push_span`): a ``PRODUCER`` span ``hybridq.push`` per batch,
  linked to each job's enqueue span;
- the run (:func:`start_run`, :func:`end_run`, in the worker): a ``CONSUMER`` span ``hybridq.run``, a child of
  the enqueue span, with the job id, queue, task, attempt and outcome.

A tracing failure never fails a job: a hook whose span cannot be made logs a warning and goes
on untraced. A carrier larger than :data:`MAX_CARRIER_CHARS` keeps only its ``traceparent``
(and ``tracestate`` if it still fits), stored and read alike: the trace goes on, the baggage is
dropped. This module imports nothing of hybridq's: every role uses it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = [
    "MAX_CARRIER_CHARS",
    "end_run",
    "enqueue_carrier",
    "push_span",
    "start_run",
    "tracer",
]

#: The most characters a stored trace context may hold (keys and values): a W3C
#: ``traceparent`` is 55, a ``tracestate`` at most 512; baggage past this is not carried.
MAX_CARRIER_CHARS = 4096
#: The keys a carrier over :data:`MAX_CARRIER_CHARS` keeps while they fit: the parent first.
_KEPT = ("traceparent", "tracestate")
#: The most links one push span holds (the SDK keeps 128 by default).
_MAX_LINKS = 128
_SYSTEM = {"messaging.system": "hybridq"}

log = logging.getLogger("hybridq")
_tracer: Any = None
_MODULES = sys.modules
#: Whether the environment names a provider, which the API loads when first asked for one
#: (read once: an environment variable is set before the process starts).
_NAMED = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_UNKNOWN = object()


def tracer() -> Any:
    """The tracer of the configured provider; ``None`` (at the cost of a look-up) without one.

    No provider can be configured without ``opentelemetry.trace`` imported, so an application
    that never imported it pays one ``sys.modules`` look-up per hook. A provider is set once
    per process (the API refuses a second), so the tracer is kept once found. With the API
    imported and none set (redis-py 8 imports it wherever it is installed), the API's global is
    read rather than the API asked: asking at every run cost a pool worker's no-op job about
    5 % of its CPU (profiled with py-spy), and a provider set later is seen at the next hook.
    """
    global _tracer  # found once per process, as the provider is set once
    if _tracer is not None:
        return _tracer
    api = _MODULES.get("opentelemetry.trace")
    if api is None:
        return None
    # The API's private global (None until a provider is set); if it is ever gone, ask the API.
    if getattr(api, "_TRACER_PROVIDER", _UNKNOWN) is None and not _NAMED:
        return None
    provider = api.get_tracer_provider()
    if isinstance(provider, api.ProxyTracerProvider | api.NoOpTracerProvider):
        return None
    _tracer = provider.get_tracer("hybridq")
    return _tracer


def enqueue_carrier(job_id: str, func: str, queue: str) -> dict[str, str] | None:
    """Record the enqueue span of a job; the context to store in its envelope (``None``: none)."""
    if _tracer is None and "opentelemetry.trace" not in _MODULES:
        return None  # the common case, on every enqueue: one look-up, no call
    found = tracer()
    if found is None:
        return None
    try:
        carrier = _enqueue(found, _attributes("create", job_id, func, queue))
    except Exception:  # the application's SDK or propagator: never the enqueue's failure
        log.warning("tracing: the enqueue span of job %s failed; not traced", job_id, exc_info=True)
        return None
    return _bounded(carrier)


def _bounded(carrier: Mapping[str, str] | None) -> dict[str, str] | None:
    """``carrier`` within :data:`MAX_CARRIER_CHARS`: past it, what of :data:`_KEPT` fits."""
    if not carrier:
        return None
    if sum(len(k) + len(v) for k, v in carrier.items()) <= MAX_CARRIER_CHARS:
        return dict(carrier)
    kept: dict[str, str] = {}
    room = MAX_CARRIER_CHARS
    for key in _KEPT:
        value = carrier.get(key)
        if value is not None and len(key) + len(value) <= room:
            kept[key] = value
            room -= len(key) + len(value)
    return kept or None


def _attributes(operation: str, job_id: str, func: str, queue: str) -> dict[str, Any]:
    return {
        **_SYSTEM,
        "messaging.operation.type": operation,
        "messaging.destination.name": queue,
        "messaging.message.id": job_id,
        "hybridq.task": func,
    }


def _enqueue(found: Any, attributes: dict[str, Any]) -> dict[str, str]:
    from opentelemetry import propagate, trace  # noqa: PLC0415 - imported by the application already

    with found.start_as_current_span("hybridq.enqueue", kind=trace.SpanKind.PRODUCER, attributes=attributes):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
    return carrier


def _context(carrier: Mapping[str, str] | None) -> Any:
    from opentelemetry import propagate  # noqa: PLC0415 - tracer() found it imported

    bounded = _bounded(carrier)  # a record's, written by anyone: read within the same bound
    return propagate.extract(bounded) if bounded else None


@contextmanager
def push_span(carriers: Iterable[Mapping[str, str] | None], count: int) -> Iterator[None]:
    """A span around the forwarder's push of ``count`` jobs, linked to their enqueue spans."""
    found = tracer()
    span = None
    if found is not None:
        try:
            span = _push(found, carriers, count)
        except Exception:  # the application's SDK: never the push's failure
            log.warning("tracing: the push span failed; not traced", exc_info=True)
    if span is None:
        yield
        return
    from opentelemetry import trace  # noqa: PLC0415 - tracer() found it imported

    with trace.use_span(span, end_on_exit=True):
        yield


def _push(found: Any, carriers: Iterable[Mapping[str, str] | None], count: int) -> Any:
    from opentelemetry import trace  # noqa: PLC0415 - tracer() found it imported

    links = []
    for carrier in carriers:
        context = trace.get_current_span(_context(carrier)).get_span_context() if carrier else None
        if context is not None and context.is_valid:
            links.append(trace.Link(context))
            if len(links) >= _MAX_LINKS:
                break
    attributes = {**_SYSTEM, "messaging.operation.type": "send", "messaging.batch.message_count": count}
    return found.start_span("hybridq.push", kind=trace.SpanKind.PRODUCER, links=links, attributes=attributes)


def start_run(carrier: Mapping[str, str] | None, *, job_id: str, func: str, queue: str, attempt: int) -> Any:
    """Start the span of one run of a job, current until :func:`end_run`; ``None`` untraced.

    A child of the job's enqueue span when its envelope carries one: spans the task opens are
    children of this one, and the task's context holds the envelope's baggage. The worker
    starts it when the task starts, and ends it with the outcome.
    """
    found = tracer()
    if found is None:
        return None
    try:
        from opentelemetry import context, trace  # noqa: PLC0415 - tracer() found it imported

        attributes = {**_attributes("process", job_id, func, queue), "hybridq.attempt": attempt}
        parent = _context(carrier)
        span = found.start_span(
            "hybridq.run", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
        )
        # In the record's context, not the worker's: the task sees the enqueue's baggage too.
        return span, context.attach(trace.set_span_in_context(span, parent))
    except Exception:  # the application's SDK, or a record's context: never the run's failure
        log.warning("tracing: the run span of job %s failed; not traced", job_id, exc_info=True)
        return None


def end_run(started: Any, outcome: str, *, final: bool, error: BaseException | None = None) -> None:
    """End a span :func:`start_run` started (``None``: nothing to do) with the run's outcome."""
    if started is None:
        return
    try:
        _end_run(started, outcome, final=final, error=error)
    except Exception:  # the application's SDK: never the outcome's failure
        log.warning("tracing: ending a run span failed", exc_info=True)


def _end_run(started: Any, outcome: str, *, final: bool, error: BaseException | None) -> None:
    from opentelemetry import context  # noqa: PLC0415 - start_run found it imported
    from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

    span, token = started
    context.detach(token)  # logs, does not raise, if the task left another context current
    span.set_attribute("hybridq.outcome", outcome)
    span.set_attribute("hybridq.final", final)
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:200]))
    span.end()
