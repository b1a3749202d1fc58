"""A trace from the enqueue to a real worker process's run (issue 33).

The producer (this process) records its enqueue span with the SDK's in-memory exporter; a
``hybridq worker --import tests.otel_export`` process configures its own provider and appends
each span it ends to a file. The run span read from that file must be a child of the enqueue
span: same trace id, its parent the enqueue span's id (W3C ``traceparent`` in the envelope).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hybridq import Queue, tracing
from hybridq.testing.embedded import RedisServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.integration.test_worker_redis import Stack, stack
from tests.support.processes import wait_until

__all__ = ["stack"]  # the fixture, used by this module's tests


@pytest.mark.parametrize("mode", ["pool", "simple"])
def test_the_run_in_a_worker_process_is_a_child_of_the_enqueue(
    mode: str,
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("hybridq"))
    spans_file = tmp_path / "worker-spans.jsonl"
    stack.forwarder(redis_server.url)
    stack.env = {**stack.env, "HYBRIDQ_TEST_SPANS": str(spans_file)}
    mode_args = ["--simple"] if mode == "simple" else ["--processes", "1"]
    args = [sys.executable, "-m", "hybridq", "worker", "--redis", redis_server.url, *mode_args]
    stack._start([*args, "--import", "tests.otel_export", "default"])
    queue = Queue("default", journal_dir)
    ok, bad = queue.enqueue("tests.tasks.traced_task"), queue.enqueue("tests.tasks.traced_task", fail=True)
    assert ok.wait(timeout=60) == "traced"
    wait_until(lambda: bad.status == "failed", timeout=60, what="the failing job failed")

    def runs() -> dict[str, dict[str, object]]:
        lines = spans_file.read_text().splitlines() if spans_file.exists() else []
        spans = [json.loads(line) for line in lines]
        return {s["attributes"]["messaging.message.id"]: s for s in spans if s["name"] == "hybridq.run"}

    found = wait_until(lambda: len(runs()) == 2 and runs(), timeout=30, what="two run spans in the file")
    enqueues = {s.attributes["messaging.message.id"]: s for s in exporter.get_finished_spans()}  # type: ignore[index]
    for job, outcome, status in ((ok, "succeeded", "UNSET"), (bad, "failed", "ERROR")):
        run, context = found[job.id], enqueues[job.id].get_span_context()
        assert run["trace_id"] == f"{context.trace_id:032x}"
        assert run["parent_id"] == f"{context.span_id:016x}"
        assert run["kind"] == "CONSUMER"
        assert run["status"] == status
        assert run["attributes"] == {
            "messaging.system": "hybridq",
            "messaging.operation.type": "process",
            "messaging.destination.name": "default",
            "messaging.message.id": job.id,
            "hybridq.task": "tests.tasks.traced_task",
            "hybridq.attempt": 1,
            "hybridq.outcome": outcome,
            "hybridq.final": True,
        }
