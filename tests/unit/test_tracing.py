"""OpenTelemetry spans of a job (issue 33): enqueue → push (linked) → run (a child), in process.

The SDK's in-memory exporter records what :mod:`hybridq.tracing` makes; the tracer is the one
of a private provider (the process's global one can be set only once). The forwarder and the
worker are the real ones, on fakeredis (``hybridq.testing.fake_stack``). A real worker process
exporting its spans is ``tests/integration/test_tracing_worker.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridq import Queue, tracing
from hybridq.journal import JournalReader
from hybridq.testing import fake_stack
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("hybridq"))
    yield exporter
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def test_enqueue_records_a_producer_span_and_stores_its_context(
    spans: InMemorySpanExporter, journal_dir: Path
) -> None:
    job = Queue("mail", journal_dir).enqueue("tests.tasks.add", 1, 2)
    [span] = named(spans, "hybridq.enqueue")
    assert span.kind is trace.SpanKind.PRODUCER
    assert span.attributes is not None
    assert span.attributes["messaging.message.id"] == job.id
    assert span.attributes["messaging.destination.name"] == "mail"
    assert span.attributes["hybridq.task"] == "tests.tasks.add"
    [record] = JournalReader(str(journal_dir)).records()
    context = span.get_span_context()
    traceparent = json.loads(record.payload)["trace"]["traceparent"]
    assert traceparent.startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")  # W3C


def test_a_trace_shows_enqueue_then_push_linked_then_run_as_its_child(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    with fake_stack(tmp_path / "j", allow="tests.tasks") as stack:
        ok = stack.queue().enqueue("tests.tasks.traced_task")
        bad = stack.queue().enqueue("tests.tasks.traced_task", fail=True)
        stack.run()
    enqueues = {span.attributes["messaging.message.id"]: span for span in named(spans, "hybridq.enqueue")}  # type: ignore[index]
    runs = {span.attributes["messaging.message.id"]: span for span in named(spans, "hybridq.run")}  # type: ignore[index]
    for job, outcome in ((ok, "succeeded"), (bad, "failed")):
        run, enqueue = runs[job.id], enqueues[job.id]
        assert run.kind is trace.SpanKind.CONSUMER
        assert run.parent is not None
        assert run.parent.span_id == enqueue.get_span_context().span_id
        assert run.get_span_context().trace_id == enqueue.get_span_context().trace_id
        assert run.attributes is not None
        assert run.attributes["hybridq.outcome"] == outcome
        assert run.attributes["hybridq.attempt"] == 1
        assert run.attributes["hybridq.final"] is True
        assert run.attributes["messaging.destination.name"] == "default"
        # The task's own span is a child of the run's.
        [inside] = [
            s
            for s in named(spans, "inside")
            if s.parent and s.parent.span_id == run.get_span_context().span_id
        ]
        assert inside.get_span_context().trace_id == run.get_span_context().trace_id
    assert runs[bad.id].status.status_code is trace.StatusCode.ERROR
    assert runs[ok.id].status.status_code is trace.StatusCode.UNSET
    [push] = named(spans, "hybridq.push")  # both jobs in one batch
    linked = {link.context.span_id for link in push.links}
    assert linked == {enqueues[ok.id].get_span_context().span_id, enqueues[bad.id].get_span_context().span_id}
    assert push.attributes is not None
    assert push.attributes["messaging.batch.message_count"] == 2


def test_untraced_enqueues_carry_no_context(journal_dir: Path) -> None:
    """opentelemetry imported (by this test module) but no provider configured: nothing recorded."""
    assert tracing.tracer() is None
    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 2)
    [record] = JournalReader(str(journal_dir)).records()
    assert "trace" not in json.loads(record.payload)


def test_without_opentelemetry_imported_nothing_imports_it(tmp_path: Path) -> None:
    """The hooks cost a look-up: an application that never imported opentelemetry never loads it."""
    code = (
        "import sys, hybridq\n"
        f"job = hybridq.Queue('default', {str(tmp_path / 'j')!r}).enqueue('tests.tasks.add', 1, 2)\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


class BrokenTracer:
    """A tracer whose every span fails (an SDK or exporter bug in the application)."""

    def start_as_current_span(self, *_: object, **__: object) -> None:
        raise RuntimeError("broken SDK")

    start_span = start_as_current_span


def test_a_broken_tracer_never_fails_an_enqueue_a_push_or_a_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tracing, "_tracer", BrokenTracer())
    with fake_stack(tmp_path / "j", allow="tests.tasks") as stack:
        job = stack.queue().enqueue("tests.tasks.add", 1, 2)
        stack.run()
        assert stack.result(job.id) == 3
    assert job.envelope.trace is None
    assert "tracing: the enqueue span of job" in caplog.text
    assert "tracing: the run span of job" in caplog.text
    assert "tracing: the push span failed" in caplog.text


def test_every_run_of_a_job_is_a_child_of_its_one_enqueue(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    """A RetryLater, then a success: two run spans under the same enqueue span."""
    with fake_stack(tmp_path / "j", allow="tests.tasks") as stack:
        job = stack.queue().enqueue("tests.tasks.not_yet", str(tmp_path / "effects"), "A", 1, 0, 0.1)
        stack.run()
    [enqueue] = named(spans, "hybridq.enqueue")
    runs = named(spans, "hybridq.run")
    assert [run.attributes["hybridq.outcome"] for run in runs] == ["later", "succeeded"]  # type: ignore[index]
    assert [run.attributes["hybridq.attempt"] for run in runs] == [1, 1]  # type: ignore[index]
    assert {run.parent.span_id for run in runs if run.parent} == {enqueue.get_span_context().span_id}
    assert job.envelope.id == enqueue.attributes["messaging.message.id"]  # type: ignore[index]


BIG_BAGGAGE = {f"k{n}": "x" * 1000 for n in range(5)}  # over 4,096 characters in all


def test_a_context_over_the_cap_keeps_its_traceparent_and_drops_the_baggage(
    spans: InMemorySpanExporter, journal_dir: Path
) -> None:
    """Before: the whole context was dropped, so the job's runs lost their parent."""
    from opentelemetry import baggage, context

    ctx = None
    for key, value in BIG_BAGGAGE.items():
        ctx = baggage.set_baggage(key, value, ctx)
    token = context.attach(ctx)
    try:
        Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 2)
    finally:
        context.detach(token)
    [record] = JournalReader(str(journal_dir)).records()
    [enqueue] = named(spans, "hybridq.enqueue")
    stored = json.loads(record.payload)["trace"]
    assert list(stored) == ["traceparent"]
    assert stored["traceparent"].startswith(f"00-{enqueue.get_span_context().trace_id:032x}-")


def test_a_worker_reads_a_records_context_within_the_same_cap(spans: InMemorySpanExporter) -> None:
    """Before: a record's baggage of any size was extracted into every run's context."""
    from opentelemetry import baggage

    parent = f"00-{'1' * 32}-{'2' * 16}-01"
    carrier = {"traceparent": parent, "baggage": ",".join(f"{k}={v}" for k, v in BIG_BAGGAGE.items())}
    started = tracing.start_run(carrier, job_id="a1", func="tests.tasks.add", queue="default", attempt=1)
    try:
        assert baggage.get_all() == {}
    finally:
        tracing.end_run(started, "succeeded", final=True)
    [run] = named(spans, "hybridq.run")
    assert run.parent is not None
    assert run.parent.span_id == 0x2222222222222222
    small = {"traceparent": parent, "baggage": "k=v"}
    started = tracing.start_run(small, job_id="a2", func="tests.tasks.add", queue="default", attempt=1)
    try:
        assert baggage.get_all() == {"k": "v"}  # within the cap: carried
    finally:
        tracing.end_run(started, "succeeded", final=True)


def test_with_the_api_imported_and_no_provider_the_api_is_not_asked_and_a_later_one_is_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py 8 imports the API wherever it is installed: no per-run call into it.

    Asking for the provider at every run cost a pool worker's no-op job about 5 % of its CPU
    (``hybridq.tracing.tracer``'s docstring). A provider set later is found at the next hook,
    with no wait (i26d waited up to a second); without the API's global, the API is asked.
    """
    asked = []
    provider = TracerProvider()

    def get_tracer_provider() -> object:
        asked.append(1)
        return provider

    monkeypatch.setattr(trace, "get_tracer_provider", get_tracer_provider)
    monkeypatch.setattr(tracing, "_tracer", None)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(tracing, "_NAMED", False)
    assert all(tracing.tracer() is None for _ in range(100))
    assert asked == [], "the API was asked at a hook"
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)  # what set_tracer_provider does
    assert tracing.tracer() is not None, "a provider set later was not found at once"
    monkeypatch.setattr(tracing, "_tracer", None)
    monkeypatch.delattr(trace, "_TRACER_PROVIDER")  # an API without it: asked every time
    assert tracing.tracer() is not None
    assert len(asked) == 2
    provider.shutdown()
