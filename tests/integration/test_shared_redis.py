"""Two forwarders (two hosts' journals) sharing one Redis: each gets back only its own outcomes.

Completion events are routed to the stream of the forwarder that owns the job
(``hybridq:events:<owner>``), and each forwarder's epoch key is its own, so a FLUSHALL makes
both re-forward their own unfinished jobs and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.ops.status import collect_status
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from tests import tasks


def run_worker(server: RedisServer, queues: list[str]) -> None:
    conn = server.client()
    rq_queues = [RQQueue(q, connection=conn, serializer=JSONSerializer) for q in queues]
    SimpleWorker(rq_queues, connection=conn, serializer=JSONSerializer).work(
        burst=True, logging_level="WARNING"
    )


def test_two_hosts_share_one_redis_and_keep_their_own_ledgers(
    tmp_path: Path, redis_server: RedisServer, figures: Callable[[str], None]
) -> None:
    effects = tmp_path / "effects"
    hosts = {name: tmp_path / name for name in ("a", "b")}
    counts = {"a": 12, "b": 7}
    for name, journal in hosts.items():
        queue = Queue("shared", journal=journal)
        for i in range(counts[name]):
            queue.enqueue(tasks.record, str(effects), f"{name}{i}")
    forwarders = {name: Forwarder(journal, RQTransport(redis_server.url)) for name, journal in hosts.items()}
    for forwarder in forwarders.values():
        forwarder.open()
    try:
        assert forwarders["a"].checkpoint.owner != forwarders["b"].checkpoint.owner
        for forwarder in forwarders.values():
            forwarder.step()
        run_worker(redis_server, ["shared"])  # one worker runs both hosts' jobs, interleaved
        for forwarder in forwarders.values():
            forwarder.step()
        for name, journal in hosts.items():
            out = collect_status(str(journal))
            assert (out["accepted"], out["succeeded"], out["pending"]) == (counts[name], counts[name], 0)
        # Redis forgets everything: each forwarder notices through its own epoch key.
        redis_server.flushall()
        b_more = Queue("shared", journal=hosts["b"]).enqueue(tasks.record, str(effects), "b-late")
        for forwarder in forwarders.values():
            forwarder.maintenance.next_epoch_check = 0.0
            forwarder.step()
        run_worker(redis_server, ["shared"])
        for forwarder in forwarders.values():
            forwarder.step()
    finally:
        for forwarder in forwarders.values():
            forwarder.close()
            forwarder.transport.close()
    tokens = effects.read_text().split()
    expected = [f"a{i}" for i in range(12)] + [f"b{i}" for i in range(7)] + ["b-late"]
    assert sorted(tokens) == sorted(expected)  # each ran once: finished jobs were not re-run
    final = {name: collect_status(str(journal)) for name, journal in hosts.items()}
    assert (final["a"]["succeeded"], final["b"]["succeeded"]) == (12, 8)  # no outcome went astray
    assert b_more.get_status() == "finished"
    accepted = sum(out["accepted"] for out in final.values())
    figures(
        f"SHARED two-forwarders-one-redis hosts=2 accepted={accepted} "
        f"lost={accepted - sum(out['succeeded'] for out in final.values())} "
        f"dup_execution={len(tokens) - len(set(tokens))}"
    )
