"""RQ job-hash features that make a worker reach out are dropped by the guarded job class (13.4).

RQ 3 sends a job hash's ``webhooks`` (an HTTP request with chosen URL, method, headers and
timeout, and the traceback of a failed job) when the job ends: whoever can write to Redis gets
blind SSRF, and a tarpit URL holds the worker. hybridq never writes webhooks, so
``hybridq.worker.Job`` drops them, and ``repeats_left`` (RQ runs the job again: a replay), when
it loads a job hash. A listener on localhost counts the requests: none may arrive, through a
hybridq delivery or a hand-written job hash, under ``hybridq worker``'s class or ``rq worker
--job-class hybridq.worker.Job``.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, ClassVar

import pytest
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.protocol import keys
from hybridq.rqworker import SimpleWorker as HybridqSimpleWorker
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.worker import Job
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer
from rq.utils import utcformat

OWNER = "owner1"


class _Listener(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def _hit(self) -> None:
        type(self).hits.append(f"{self.command} {self.path}")
        self.send_response(204)
        self.end_headers()

    do_GET = _hit  # noqa: N815 - http.server's names
    do_POST = _hit  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass


@pytest.fixture
def listener() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server; yields its base URL and the requests it received."""
    hits: ClassVar[list[str]] = []
    handler = type("Handler", (_Listener,), {"hits": hits})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def webhooks(base: str) -> str:
    return json.dumps(
        [
            {
                "url": f"{base}/{status}",
                "job_status": status,
                "method": "POST",
                "headers": {"X-A": "b"},
                "timeout": 2,
            }
            for status in ("finished", "failed")
        ]
    )


def deliver(transport: RQTransport, func: str, args: tuple[Any, ...]) -> Envelope:
    env = Envelope(
        id=new_job_id(),
        func=func,
        queue="default",
        idempotency_key=new_job_id(),
        created_at=time.time(),
        args=args,
    )
    transport.push([Delivery(env, OWNER, ("w", 0, 64))])
    return env


def plant(conn: Any, func: str, args: list[Any], **fields: str) -> str:
    job_id = new_job_id()
    now = utcformat(datetime.now(UTC))
    conn.hset(
        keys.rq_job(job_id),
        mapping={
            "data": zlib.compress(json.dumps([func, None, args, {}]).encode()),
            "created_at": now,
            "enqueued_at": now,
            "origin": "default",
            "description": func,
            "status": "queued",
            "timeout": "60",
            **fields,
        },
    )
    conn.rpush(keys.rq_queue("default"), job_id)
    conn.sadd(keys.rq_queues(), keys.rq_queue("default"))
    return job_id


def work(conn: Any, worker_class: type[SimpleWorker]) -> None:
    queue = RQQueue("default", connection=conn, serializer=JSONSerializer, job_class=Job)
    worker_class([queue], connection=conn, serializer=JSONSerializer, job_class=Job).work(
        burst=True, logging_level="WARNING"
    )


@pytest.mark.parametrize(
    "worker_class", [SimpleWorker, HybridqSimpleWorker], ids=["rq-worker", "hybridq-worker"]
)
@pytest.mark.parametrize("func", ["tests.tasks.add", "tests.tasks.fail"], ids=["succeeds", "fails"])
def test_webhooks_written_into_a_hybridq_job_hash_are_never_sent(
    transport: RQTransport, listener: tuple[str, list[str]], worker_class: type[SimpleWorker], func: str
) -> None:
    base, hits = listener
    env = deliver(transport, func, (1, 2) if func == "tests.tasks.add" else ())
    transport.connection.hset(keys.rq_job(env.id), "webhooks", webhooks(base))
    work(transport.connection, worker_class)
    [event] = [e.body for e in transport.harvest(OWNER, 10)]
    assert event is not None
    assert event["outcome"] == ("succeeded" if func == "tests.tasks.add" else "failed")
    time.sleep(0.2)  # a request in flight would have arrived
    assert hits == []


def test_webhooks_of_a_refused_job_hash_are_never_sent(
    transport: RQTransport, listener: tuple[str, list[str]]
) -> None:
    base, hits = listener
    plant(transport.connection, "os.system", ["true"], webhooks=webhooks(base))
    work(transport.connection, SimpleWorker)
    time.sleep(0.2)
    assert hits == []


def test_a_repeat_written_into_a_job_hash_does_not_run_the_job_again(
    transport: RQTransport, tmp_path: Any
) -> None:
    effects = tmp_path / "effects"
    plant(
        transport.connection,
        "tests.tasks.record",
        [str(effects), "once"],
        repeats_left="3",
        repeat_intervals="[0]",
    )
    work(transport.connection, SimpleWorker)
    assert effects.read_text(encoding="utf-8").splitlines() == ["once"]
