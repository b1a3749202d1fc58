"""No pickle anywhere: every value hybridq and RQ leave in Redis for hybridq jobs is JSON.

Runs successes, a failure and a suppressed duplicate through a real redis-server, an in-process
forwarder and RQ's SimpleWorker, then reads every key Redis holds and checks each value: job
payloads and metadata, results, hybridq's stored outcomes and completion events are JSON (RQ
compresses a job's ``data`` with zlib, and base64-encodes results in its result streams);
nothing anywhere starts like a pickle.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from tests.support.rqwork import job_data

#: Pickle protocol 2 and later start with PROTO (0x80); protocols 0/1 with "(" or "c" ... but
#: those are never JSON either, and every value below is checked to be JSON or a plain scalar.
PICKLE_PROTO = b"\x80"


def run_jobs(journal: Path, server: RedisServer) -> None:
    queue = Queue("default", journal)
    queue.enqueue("tests.tasks.add", 1, 2)
    queue.enqueue("tests.tasks.add", 3, 4, idempotency_key="same")
    queue.enqueue("tests.tasks.add", 3, 4, idempotency_key="same")  # a suppressed duplicate
    queue.enqueue("tests.tasks.fail")
    transport = RQTransport(server.url)
    with Forwarder(journal, transport) as forwarder:
        forwarder.step()
        conn = server.client()
        rq_queue = RQQueue("default", connection=conn, serializer=JSONSerializer)
        SimpleWorker([rq_queue], connection=conn, serializer=JSONSerializer).work(
            burst=True, logging_level="WARNING"
        )
    transport.close()


def values(conn) -> list[tuple[str, str, bytes]]:
    """(key, field, value) for every value in Redis (hash fields, strings, list items, streams)."""
    out: list[tuple[str, str, bytes]] = []
    for raw_key in conn.scan_iter(count=1000):
        key = raw_key.decode()
        kind = conn.type(raw_key).decode()
        if kind == "hash":
            out += [(key, f.decode(), v) for f, v in conn.hgetall(raw_key).items()]
        elif kind == "string":
            out.append((key, "", conn.get(raw_key)))
        elif kind == "list":
            out += [(key, str(i), v) for i, v in enumerate(conn.lrange(raw_key, 0, -1))]
        elif kind == "stream":
            out += [(key, f.decode(), v) for _, fields in conn.xrange(raw_key) for f, v in fields.items()]
        elif kind in ("set", "zset"):
            members = conn.smembers(raw_key) if kind == "set" else conn.zrange(raw_key, 0, -1)
            out += [(key, "member", m) for m in members]
    return out


def test_no_pickle_anywhere_in_redis(journal_dir: Path, redis_server: RedisServer) -> None:
    run_jobs(journal_dir, redis_server)
    conn = redis_server.client()
    seen = values(conn)
    assert any(k.startswith("hybridq:result:") for k, _, _ in seen)
    assert any(k.startswith("rq:results:") for k, _, _ in seen)
    checked_json = 0
    for key, field, raw in seen:
        value = raw
        if key.startswith("rq:job:") and field == "exc_info":
            continue  # a traceback's text (RQ compresses it)
        if key.startswith("rq:job:") and field == "data":
            value = json.dumps(job_data(raw)).encode()  # RQ compresses it; hybridq when it is large
        if key.startswith("rq:results:") and field == "return_value":
            value = base64.b64decode(raw)  # RQ's result stream: base64 of the serializer's bytes
        assert not value.startswith(PICKLE_PROTO), (key, field)
        is_payload = (
            (key.startswith("rq:job:") and field in ("data", "meta"))
            or key.startswith(("hybridq:result:", "hybridq:events:"))
            or (key.startswith("rq:results:") and field == "return_value")
        )
        if is_payload:
            json.loads(value)  # raises if it is not JSON
            checked_json += 1
    assert checked_json >= 10
