"""Running a queue's jobs in this process, with RQ's SimpleWorker or hybridq's (pipelined)."""

from __future__ import annotations

from collections.abc import Callable

from hybridq.transport.rq import RQTransport
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
