"""The lease outlives the task until its outcome is stored (issue 12.2).

A task has returned, and storing its outcome fails for longer than the lease (a refused write, a
blip's backoff) while Redis is otherwise reachable: the lease must still be renewed, or a second
delivery of the key claims it and runs the finished task again.

A cut reply cannot make this fault (the outcome script ran: the outcome is stored), so the
outcome call is made to fail in the worker itself, while the renewals go to Redis as usual.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq import rqworker
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.rqworker import SimpleWorker as HybridqSimpleWorker
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.worker import scripts as worker
from redis.exceptions import ConnectionError as RedisConnectionError
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from tests.support.processes import WorkerProcess, wait_until

#: The lease: the outcome call fails for several leases.
LEASE_S = 1.0
#: How long the outcome call fails after the task returned.
FAIL_S = 6.0


@pytest.fixture
def transport(redis_server: RedisServer) -> Iterator[RQTransport]:
    transport = RQTransport(redis_server.url)
    yield transport
    transport.close()


def failing_outcome_for(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every outcome call fails (without running) until ``seconds`` after the first one."""
    real = worker._script
    first: list[float] = []

    def script(conn: Any, source: str) -> Any:
        call = real(conn, source)
        if source != worker._FINISH:
            return call

        def failing(**kwargs: Any) -> Any:
            if not first:
                first.append(time.monotonic())
            if time.monotonic() - first[0] < seconds:
                raise RedisConnectionError("outcome call refused (test)")
            return call(**kwargs)

        return failing

    monkeypatch.setattr(worker, "_script", script)
    # hybridq's worker sends the script by its SHA in RQ's pipeline first: an unknown SHA makes
    # it fall back to the call above (a NOSCRIPT reply means the script did not run).
    monkeypatch.setattr(rqworker, "_FINISH_SHA", "0" * 40)


@pytest.mark.parametrize(
    "worker_class", [SimpleWorker, HybridqSimpleWorker], ids=["rq-worker", "hybridq-worker"]
)
def test_a_finished_task_runs_once_when_storing_its_outcome_outlasts_the_lease(
    transport: RQTransport,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    worker_class: type[SimpleWorker],
) -> None:
    effects = tmp_path / "effects.txt"
    key = new_job_id()

    def envelope(queue: str) -> Envelope:
        return Envelope(
            id=new_job_id(),
            func="tests.tasks.traced",
            queue=queue,
            idempotency_key=key,
            created_at=time.time(),
            args=(str(effects), "t"),
        )

    transport.push([Delivery(envelope("default"), "owner1", ("w", 0, 64), lease_s=LEASE_S)])
    failing_outcome_for(monkeypatch, FAIL_S)
    rivals: list[WorkerProcess] = []

    def rival() -> None:
        """Once the task returned: a second job of the same key, on another queue and worker."""
        wait_until(lambda: effects.exists() and "done" in effects.read_text(), what="the task to return")
        transport.push([Delivery(envelope("rival"), "owner1", ("w", 0, 128), lease_s=LEASE_S)])
        args = [
            sys.executable,
            "-m",
            "hybridq",
            "worker",
            "--redis",
            redis_server.url,
            "--simple",
            "--burst",
            "rival",
        ]
        rivals.append(WorkerProcess(args, env=subprocess_env, log_path=tmp_path / "rival.log", cwd=tmp_path))

    thread = threading.Thread(target=rival)
    thread.start()
    conn = transport.connection
    queue = RQQueue("default", connection=conn, serializer=JSONSerializer)
    worker_class([queue], connection=conn, serializer=JSONSerializer).work(
        burst=True, logging_level="WARNING"
    )
    thread.join()
    [proc] = rivals
    wait_until(lambda: not proc.alive, timeout=30.0, what="the rival worker to finish")
    starts = [line for line in effects.read_text().splitlines() if line.startswith("start")]
    assert len(starts) == 1, f"the finished task ran {len(starts)} times:\n{proc.log()[-2000:]}"
    assert "not running it again" in proc.log()  # the rival found the stored outcome
