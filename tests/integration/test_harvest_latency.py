"""The forwarder harvests a completion event as it arrives, not on its next idle wake-up.

A finished job runs again if Redis loses its completion event before the forwarder moves it into
the ledger (docs/guarantees.md, "When a task can run more than once"): the shorter that window,
the fewer re-runs. The forwarder here sleeps up to 5 s without a producer's nudge, so a harvest
that waited for the idle wake-up would take seconds.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport

from tests.support.processes import wait_until


def test_a_completion_event_is_harvested_within_milliseconds(
    journal_dir: Path, redis_server: RedisServer
) -> None:
    queue = Queue("default", journal_dir)
    transport = RQTransport(redis_server.url)
    forwarder = Forwarder(journal_dir, transport, idle_timeout_s=5.0)
    forwarder.open()
    loop = threading.Thread(target=forwarder.run)
    loop.start()
    try:
        job = queue.enqueue("tests.tasks.add", 1, 2)
        conn = transport.connection
        wait_until(lambda: conn.llen("rq:queue:default") == 1, what="the job pushed")
        time.sleep(0.3)  # the loop is asleep again, with no nudge coming
        stream = keys.events(forwarder.checkpoint.owner)
        latencies = []
        for _ in range(3):
            event = {
                "id": job.id,
                "loc": [job.record.writer_id, job.record.segment, job.record.offset],
                "queue": "default",
                "outcome": "succeeded",
                "final": True,
                "retry_delay": None,
                "attempt": 1,
                "dup": False,
                "error": None,
                "at": time.time(),
            }
            started = time.monotonic()
            conn.xadd(stream, {"e": json.dumps(event)})
            wait_until(lambda: conn.xlen(stream) == 0, timeout=10, interval=0.002, what="the harvest")
            latencies.append(time.monotonic() - started)
            time.sleep(0.3)
        print(f"harvest latency: {', '.join(f'{x * 1000:.0f} ms' for x in latencies)}")
        assert max(latencies) < 0.5, latencies
    finally:
        forwarder.stop()
        loop.join(10)
        forwarder.close()
        transport.close()
