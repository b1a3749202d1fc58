"""An allowed prefix allows what its modules define, not everything they import (issue 13.1).

``HYBRIDQ_ALLOW=tests.guarded_tasks`` must not make ``tests.guarded_tasks.os.system`` runnable:
the allowlist once checked the text of the path and RQ's ``import_attribute`` walked
``getattr(getattr(module, "os"), "system")``. Each attack is tried through ``execute()`` (a job
the forwarder pushed, under RQ's worker and hybridq's) and through a job hash naming the path
directly, under the guarded job class (``rq worker --job-class hybridq.worker.Job``): refused,
with no effect. What the module defines still runs both ways.
"""

from __future__ import annotations

import builtins
import json
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer
from rq.utils import utcformat

OWNER = "owner1"
MODULE = "tests.guarded_tasks"
#: A name the ``__builtins__`` attack would add to the builtins of this process.
PLANTED = "hybridq_guard_test_planted"

#: name -> (dotted path, its arguments given the effect file's path).
ATTACKS: dict[str, tuple[str, Callable[[str], list[Any]]]] = {
    "module-os-system": (f"{MODULE}.os.system", lambda p: [f"touch {p}"]),
    "module-subprocess-run": (f"{MODULE}.subprocess.run", lambda p: [["touch", p]]),
    "module-builtins": (f"{MODULE}.__builtins__.__setitem__", lambda p: [PLANTED, p]),
    "class-held-os-system": (f"{MODULE}.Tools.shell", lambda p: [f"touch {p}"]),
    "class-held-subprocess-run": (f"{MODULE}.Tools.run", lambda p: [["touch", p]]),
    "private-function": (f"{MODULE}._private", lambda p: [p]),
    # Issue 27 (HIGH): a class of the module whose call runs the standard library's constructor.
    "inherited-popen": (f"{MODULE}.Proc", lambda p: [["touch", p]]),
    "inherited-file-handler": (f"{MODULE}.Log", lambda p: [p]),
    "inherited-zipfile": (f"{MODULE}.Archive", lambda p: [p, "w"]),
}
ALLOWED = [
    f"{MODULE}.touch",
    f"{MODULE}.Tools.touch",
    f"{MODULE}.Tools.touch_cls",
    f"{MODULE}.registered_touch",
    f"{MODULE}.Note",  # classes whose constructor is defined in the allowed module
    f"{MODULE}.Record",
]


@pytest.fixture(autouse=True)
def _allow_the_task_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HYBRIDQ_ALLOW", MODULE)
    monkeypatch.delenv("HYBRIDQ_SIGNING_KEY", raising=False)
    monkeypatch.delenv("HYBRIDQ_SIGNING_KEY_FILE", raising=False)
    yield
    if hasattr(builtins, PLANTED):
        delattr(builtins, PLANTED)


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def deliver(transport: RQTransport, func: str, args: list[Any]) -> Envelope:
    env = Envelope(
        id=new_job_id(),
        func=func,
        queue="default",
        idempotency_key=new_job_id(),
        created_at=time.time(),
        args=tuple(args),
    )
    transport.push([Delivery(env, OWNER, ("w", 0, 64))])
    return env


def plant(conn: Any, func: str, args: list[Any]) -> str:
    """Write an RQ job hash naming ``func`` directly, as whoever can write to Redis can."""
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
        },
    )
    conn.rpush(keys.rq_queue("default"), job_id)
    conn.sadd(keys.rq_queues(), keys.rq_queue("default"))
    return job_id


def work(conn: Any, worker_class: type[SimpleWorker], job_class: type[RQJob] | None = None) -> None:
    options: dict[str, Any] = {} if job_class is None else {"job_class": job_class}
    queue = RQQueue("default", connection=conn, serializer=JSONSerializer, **options)
    worker_class([queue], connection=conn, serializer=JSONSerializer, **options).work(
        burst=True, logging_level="WARNING"
    )


def events(transport: RQTransport) -> list[dict[str, Any]]:
    return [dict(e.body) for e in transport.harvest(OWNER, 100) if e.body is not None]


def no_effect(effect: Path) -> bool:
    time.sleep(0.2)  # a spawned process (Popen) has had time to create its file
    return not effect.exists() and not hasattr(builtins, PLANTED)


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize(
    "worker_class", [SimpleWorker, HybridqSimpleWorker], ids=["rq-worker", "hybridq-worker"]
)
def test_execute_refuses_what_the_allowed_module_merely_imports(
    transport: RQTransport, tmp_path: Path, attack: str, worker_class: type[SimpleWorker]
) -> None:
    effect = tmp_path / "effect"
    func, args = ATTACKS[attack]
    env = deliver(transport, func, args(str(effect)))
    work(transport.connection, worker_class)
    assert no_effect(effect), f"{func} ran"
    [event] = events(transport)
    assert (event["outcome"], event["final"]) == ("failed", True)
    assert "is not allowed to run on this worker" in str(event["error"])
    assert transport.connection.get(keys.result(env.key_id)) is None  # refused before the claim


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_guarded_job_class_refuses_a_job_hash_naming_what_the_module_imports(
    transport: RQTransport, tmp_path: Path, attack: str
) -> None:
    effect = tmp_path / "effect"
    func, args = ATTACKS[attack]
    job_id = plant(transport.connection, func, args(str(effect)))
    work(transport.connection, SimpleWorker, Job)  # rq worker --job-class hybridq.worker.Job
    assert no_effect(effect), f"{func} ran"
    job = RQJob.fetch(job_id, connection=transport.connection, serializer=JSONSerializer)
    result = job.latest_result()
    assert job.get_status().value == "failed"
    assert result is not None
    assert "NotAllowed" in (result.exc_string or "")


@pytest.mark.parametrize("func", ALLOWED)
def test_what_the_allowed_module_defines_still_runs_both_ways(
    transport: RQTransport, tmp_path: Path, func: str
) -> None:
    through_execute = tmp_path / "through-execute"
    deliver(transport, func, [str(through_execute)])
    work(transport.connection, HybridqSimpleWorker)
    [event] = events(transport)
    assert event["outcome"] == "succeeded", event
    assert through_execute.exists()
    directly = tmp_path / "directly"
    job_id = plant(transport.connection, func, [str(directly)])
    work(transport.connection, SimpleWorker, Job)
    job = RQJob.fetch(job_id, connection=transport.connection, serializer=JSONSerializer)
    assert job.get_status().value == "finished"
    assert directly.exists()
