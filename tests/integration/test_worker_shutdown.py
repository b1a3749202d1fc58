"""A worker's shutdown does not wait a minute for RQ's pub/sub thread (redis-py 8.2's stop()).

RQ's ``unsubscribe`` sends UNSUBSCRIBE, then ``PubSubWorkerThread.stop()``, which since redis-py
8.2 joins the thread with no time limit. When the thread handles the UNSUBSCRIBE reply before
``stop()`` clears its flag, it goes back into ``get_message(timeout=60)``, which waits the whole
60 s for a subscription that never comes: every burst or stopped worker then took a minute to
exit (seen across the suite under load). The scene is made deterministic here: the thread is
left waiting for a subscription before the worker's own ``unsubscribe`` runs.
"""

from __future__ import annotations

import time

import pytest
from hybridq.rqworker import SimpleWorker, unsubscribe_promptly
from hybridq.testing.embedded import RedisServer
from rq import Queue
from rq import SimpleWorker as RQSimpleWorker


def _thread_waiting_for_a_subscription(worker: RQSimpleWorker) -> None:
    worker.subscribe()
    worker.pubsub.unsubscribe()  # the reply leaves the thread waiting in get_message(timeout=60)
    deadline = time.monotonic() + 5
    while worker.pubsub.subscribed and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the thread loops back into get_message


@pytest.mark.parametrize("stop", ["hybridq-worker", "rq-worker-stopped-as-hybridq-does"])
def test_unsubscribe_returns_at_once_when_the_pubsub_thread_waits(
    redis_server: RedisServer, stop: str
) -> None:
    conn = redis_server.client()
    try:
        q = Queue("q", connection=conn)
        worker = (
            SimpleWorker([q], connection=conn)
            if stop == "hybridq-worker"
            else RQSimpleWorker([q], connection=conn)
        )
        _thread_waiting_for_a_subscription(worker)
        start = time.monotonic()
        if stop == "hybridq-worker":
            worker.unsubscribe()
        else:
            unsubscribe_promptly(worker)
        assert time.monotonic() - start < 5  # RQ's own: 60 s
    finally:
        conn.close()
