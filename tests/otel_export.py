"""A worker's OpenTelemetry set-up for tests: ``hybridq worker --import tests.otel_export``.

Configures the global tracer provider with an exporter that appends each finished span, as one
JSON line, to the file ``$HYBRIDQ_TEST_SPANS`` (synchronously: nothing is lost when the worker
is stopped), so a test reads what the worker process recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class FileExporter(SpanExporter):
    """One JSON line per span: names, ids, parent, kind, attributes, status, links."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            context, parent = span.get_span_context(), span.parent
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "trace_id": f"{context.trace_id:032x}" if context else None,
                        "span_id": f"{context.span_id:016x}" if context else None,
                        "parent_id": f"{parent.span_id:016x}" if parent else None,
                        "kind": span.kind.name,
                        "attributes": dict(span.attributes or {}),
                        "status": span.status.status_code.name,
                        "pid": os.getpid(),
                    }
                )
            )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, "".join(line + "\n" for line in lines).encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["HYBRIDQ_TEST_SPANS"])))
trace.set_tracer_provider(provider)
