"""Running a queue's jobs in this process, with RQ's SimpleWorker or hybridq's (pipelined)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hybridq.transport.rq import RQTransport
from hybridq.transport.rq_codec import plain_data
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer

#: Runs every job queued on "default" in one burst.
Work = Callable[[RQTransport], None]


def burst_runner(worker_class: type[SimpleWorker]) -> Work:
    """A :data:`Work` that drains the "default" queue with ``worker_class``."""

    def run(transport: RQTransport) -> None:
        conn = transport.connection
        queue = RQQueue("default", connection=conn, serializer=JSONSerializer)
        worker_class([queue], connection=conn, serializer=JSONSerializer).work(
            burst=True, logging_level="WARNING"
        )

    return run


def job_data(raw: bytes) -> Any:
    """A job hash's ``data``, decoded as RQ reads it: zlib-compressed JSON, or plain JSON."""
    return json.loads(plain_data(raw))
