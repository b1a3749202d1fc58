"""One contract, two transports: the in-memory one and RQ on a private redis-server."""

from __future__ import annotations

import json

import pytest
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.errors import TransportError
from hybridq.testing.embedded import RedisServer
from hybridq.transport import MemoryTransport, Transport
from hybridq.transport.base import Delivery, Probe
from hybridq.transport.rq import RQTransport
from rq import Queue as RQQueue
from rq import SimpleWorker
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from tests.support.rqwork import job_data


def envelope(queue: str = "default", **overrides) -> Envelope:
    fields = {
        "id": new_job_id(),
        "func": "tests.tasks.add",
        "queue": queue,
        "idempotency_key": "k",
        "created_at": 1_700_000_000.25,
        "args": (2, 3),
    }
    fields.update(overrides)
    return Envelope(**fields)


def delivery(queue: str = "default", *, attempt: int = 1, force: bool = False, **overrides) -> Delivery:
    env = overrides.pop("env", None) or envelope(queue, **overrides)
    return Delivery(env, "owner1", ("w", 0, 64), attempt=attempt, force=force)


class TransportContract:
    """Every transport must pass these. Subclasses provide the fixtures and two probes."""

    def queued(self, transport: Transport, queue: str) -> list[str]:
        raise NotImplementedError

    def take_down(self, transport: Transport) -> None:
        raise NotImplementedError

    def test_push_queues_new_jobs_in_order(self, transport: Transport) -> None:
        jobs = [delivery() for _ in range(5)]
        result = transport.push(jobs)
        assert (result.pushed, result.already_present) == (5, 0)
        assert self.queued(transport, "default") == [j.envelope.id for j in jobs]

    def test_a_repush_never_queues_a_job_twice(self, transport: Transport) -> None:
        first = [delivery() for _ in range(3)]
        transport.push(first)
        extra = delivery()
        result = transport.push([*first, extra])
        assert (result.pushed, result.already_present) == (1, 3)
        assert self.queued(transport, "default") == [*(j.envelope.id for j in first), extra.envelope.id]

    def test_jobs_go_to_their_queues(self, transport: Transport) -> None:
        a, b = delivery("alpha"), delivery("beta")
        transport.push([a, b])
        assert self.queued(transport, "alpha") == [a.envelope.id]
        assert self.queued(transport, "beta") == [b.envelope.id]

    def test_an_empty_push_does_nothing(self, transport: Transport) -> None:
        result = transport.push([])
        assert (result.pushed, result.already_present) == (0, 0)

    def test_ping_answers_while_up(self, transport: Transport) -> None:
        transport.ping()

    def test_down_means_transport_error(self, transport: Transport) -> None:
        self.take_down(transport)
        with pytest.raises(TransportError):
            transport.ping()
        with pytest.raises(TransportError):
            transport.push([delivery()])

    def test_a_forced_push_replaces_an_earlier_attempt_once(self, transport: Transport) -> None:
        first = delivery()
        transport.push([first, delivery()])
        retry = Delivery(first.envelope, "owner1", first.loc, attempt=2, force=True)
        assert transport.push([retry]).pushed == 1
        assert transport.push([retry]).pushed == 0  # the same attempt again: already there
        assert self.queued(transport, "default").count(first.envelope.id) == 1

    def test_a_large_mixed_batch_counts_and_queues_each_job_once(self, transport: Transport) -> None:
        """Hundreds of jobs (several script calls for RQ), some known, some forced, two queues."""
        known = [
            delivery("alpha" if i % 3 else "beta", result_ttl_s=60.0 * (i % 2) or None) for i in range(120)
        ]
        transport.push(known)
        fresh = [delivery("alpha" if i % 4 else "beta", timeout_s=5.0 * (i % 3) or None) for i in range(130)]
        forced = [Delivery(d.envelope, "owner1", d.loc, attempt=2, force=True) for d in known[::10]]
        batch = [job for pair in zip(known, fresh, strict=False) for job in pair] + fresh[120:] + forced
        result = transport.push(batch)
        assert (result.pushed, result.already_present) == (130 + 12, 120)
        queued = self.queued(transport, "alpha") + self.queued(transport, "beta")
        assert sorted(queued) == sorted(d.envelope.id for d in known + fresh)

    def test_epoch_and_events_round_trip(self, transport: Transport) -> None:
        assert transport.state_token("owner1").epoch is None
        transport.set_epoch("owner1", "e1")
        token = transport.state_token("owner1")
        assert token.epoch == "e1"
        assert token.run_id
        assert transport.harvest("owner1", 10) == []
        transport.ack("owner1", [])

    def test_probe_tells_missing_from_queued(self, transport: Transport) -> None:
        known = delivery()
        transport.push([known])
        gone = envelope()
        verdicts = transport.probe(
            [
                Probe(known.envelope.id, known.envelope.key_id, "default"),
                Probe(gone.id, gone.key_id, "default"),
            ],
            lease_s=10.0,
        )
        assert verdicts == ["queued", "missing"]


class TestMemoryTransport(TransportContract):
    @pytest.fixture
    def transport(self) -> MemoryTransport:
        return MemoryTransport()

    def queued(self, transport, queue):
        return list(transport.queues.get(queue, []))

    def take_down(self, transport):
        transport.down = True


class TestRQTransport(TransportContract):
    @pytest.fixture
    def transport(self, redis_server: RedisServer):
        transport = RQTransport(redis_server.url, socket_timeout_s=1.0)
        transport.server = redis_server
        yield transport
        transport.close()

    def queued(self, transport, queue):
        return [raw.decode() for raw in transport.connection.lrange(f"rq:queue:{queue}", 0, -1)]

    def take_down(self, transport):
        transport.server.kill()

    def test_pushed_jobs_run_under_a_plain_rq_worker_with_the_json_serializer(self, transport) -> None:
        env = envelope(args=(20, 22), timeout_s=30.0, description="answer", meta={"team": "x"})
        transport.push([delivery(env=env)])
        queue = RQQueue("default", connection=transport.connection, serializer=JSONSerializer)
        worker = SimpleWorker([queue], connection=transport.connection, serializer=JSONSerializer)
        assert worker.work(burst=True)
        job = RQJob.fetch(env.id, connection=transport.connection, serializer=JSONSerializer)
        assert job.is_finished
        assert job.return_value() == 42
        assert job.timeout == 30
        assert job.description == "answer"
        assert job.meta["team"] == "x"
        assert job.meta["hybridq"]["key"] == "k"
        assert job.meta["hybridq"]["func"] == "tests.tasks.add"
        [event] = transport.harvest("owner1", 10)
        assert event.body is not None
        assert (event.body["id"], event.body["outcome"], event.body["dup"]) == (env.id, "succeeded", False)
        assert job.created_at.timestamp() == pytest.approx(env.created_at, abs=0.001)  # accepted, not pushed

    def test_each_job_of_a_large_batch_gets_its_own_fields(self, transport) -> None:
        """Jobs with different numbers of hash fields, over several script calls: none shifted."""
        jobs = [
            delivery(
                "alpha" if i % 2 else "beta",
                result_ttl_s=float(i + 1) if i % 3 else None,
                description=f"d{i}",
            )
            for i in range(230)
        ]
        assert transport.push(jobs).pushed == 230
        for d in jobs:
            job = RQJob.fetch(d.envelope.id, connection=transport.connection, serializer=JSONSerializer)
            assert (job.origin, job.description, job.get_status()) == (
                d.envelope.queue,
                d.envelope.description,
                "queued",
            )
            assert job.result_ttl == (
                None if d.envelope.result_ttl_s is None else int(d.envelope.result_ttl_s)
            )
            assert job.args[0]["job"]["id"] == d.envelope.id

    def test_no_pickle_reaches_redis(self, transport) -> None:
        d = delivery()
        transport.push([d])
        func, _, args, _ = job_data(transport.connection.hget(f"rq:job:{d.envelope.id}", "data"))  # JSON
        assert func == "hybridq.worker.execute"
        assert args[0]["job"]["func"] == "tests.tasks.add"


def test_retries_are_hybridqs_not_rqs(redis_server) -> None:
    from hybridq.envelope.model import Retry

    transport = RQTransport(redis_server.url)
    try:
        env = envelope(func="tests.tasks.add", retry=Retry(max_attempts=3, backoff_s=0))
        transport.push([delivery(env=env)])
        job = RQJob.fetch(env.id, connection=transport.connection, serializer=JSONSerializer)
        assert not job.retries_left  # RQ would keep the count in Redis; hybridq keeps it in its ledger
    finally:
        transport.close()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"timeout_s": 30.0, "result_ttl_s": 600.0, "description": "answer", "meta": {"team": "x"}}],
)
def test_job_hash_is_what_rq_writes(redis_server, overrides) -> None:
    """The job hash a push writes (the fast path's fields and the script's) is RQ's own Job.to_dict.

    Less the fields to_dict writes as empty strings for a job not yet run (its callbacks,
    started_at, worker_name...): RQ's Job.restore reads an empty one and an absent one alike, so
    the job RQ fetches is the same (below), and the push writes none of them (rq_push).
    """
    transport = RQTransport(redis_server.url)
    try:
        d = delivery(**overrides)
        transport.push([d])
        stored = transport.connection.hgetall(f"rq:job:{d.envelope.id}")
        mine = {k.decode(): v if k == b"data" else v.decode() for k, v in stored.items()}
        for name in ("hybridq_run", "failure_ttl", "enqueued_at"):  # hybridq's own, and the push time
            mine.pop(name)
        job = transport.to_rq_job(d)
        theirs = {
            k: v if isinstance(v, bytes | str) else str(v)
            for k, v in job.to_dict().items()
            if v is not None and v != ""
        }
        theirs.pop("enqueued_at")
        for name in ("data",):  # JSON (RQ's compressed): compare what it holds
            assert job_data(mine.pop(name)) == job_data(theirs.pop(name))
        assert json.loads(mine.pop("meta")) == json.loads(theirs.pop("meta"))
        assert mine == theirs
        fetched = RQJob.fetch(d.envelope.id, connection=transport.connection, serializer=JSONSerializer)
        fields = ("worker_name", "started_at", "ended_at", "last_heartbeat", "group_id", "origin", "_status")
        callbacks = ("success_callback", "failure_callback", "stopped_callback")
        assert [getattr(fetched, name) for name in fields] == [getattr(job, name) for name in fields]
        assert [getattr(fetched, name) for name in callbacks] == [None, None, None]
    finally:
        transport.close()


class TestShardedTransport(TransportContract):
    """Two private redis-servers: "beta" lives on the second, every other queue on the first."""

    @pytest.fixture
    def transport(self, make_redis_server):
        from hybridq.transport.routes import Routes
        from hybridq.transport.sharded import ShardedTransport

        first, second = make_redis_server(), make_redis_server()
        transport = ShardedTransport(
            Routes(first.url, {"beta": second.url}),
            make=lambda url: RQTransport(url, socket_timeout_s=1.0),
        )
        transport.servers = (first, second)
        yield transport
        transport.close()

    def queued(self, transport, queue):
        shard = transport.shards[transport.shard_of(queue)]
        return [raw.decode() for raw in shard.connection.lrange(f"rq:queue:{queue}", 0, -1)]

    def take_down(self, transport):
        transport.servers[0].kill()

    def test_each_queue_lands_on_its_own_redis_only(self, transport) -> None:
        a, b = delivery("alpha"), delivery("beta")
        transport.push([a, b])
        first, second = transport.shards
        assert first.connection.lrange("rq:queue:beta", 0, -1) == []
        assert second.connection.lrange("rq:queue:alpha", 0, -1) == []
        assert second.connection.exists(f"rq:job:{b.envelope.id}")
        assert not first.connection.exists(f"rq:job:{b.envelope.id}")

    def test_one_redis_down_is_a_transport_error_naming_it(self, transport) -> None:
        transport.servers[1].kill()
        with pytest.raises(TransportError, match=transport.servers[1].url.split("//")[1]):
            transport.ping()
        with pytest.raises(TransportError):
            transport.state_token("owner1")

    def test_events_of_every_redis_wake_the_watcher_and_are_harvested(self, transport) -> None:
        import threading
        import time

        from hybridq.protocol import keys

        first, second = transport.shards
        assert transport.wait_events("owner1", "0-0", 0.2) is False
        timer = threading.Timer(0.3, lambda: second.connection.xadd(keys.events("owner1"), {"e": "{}"}))
        timer.start()
        started = time.monotonic()
        assert transport.wait_events("owner1", "0-0", 5.0) is True
        woke = time.monotonic() - started
        timer.join()
        assert woke < 2.0, woke  # not the whole block time: its own Redis's waiter returned
        first.connection.xadd(keys.events("owner1"), {"e": "{}"})
        events = transport.harvest("owner1", 10)
        assert sorted(e.event_id.split("/")[0] for e in events) == ["0", "1"]
        transport.ack("owner1", [e.event_id for e in events])
        assert first.connection.xlen(keys.events("owner1")) == 0
        assert second.connection.xlen(keys.events("owner1")) == 0
        assert transport.wait_events("owner1", "0-0", 0.2) is False  # nothing newer than the acked


def test_moving_a_queue_between_two_kept_redis_changes_the_epoch_and_the_refill_moves_it(
    make_redis_server,
) -> None:
    """{beta: second, gamma: second} -> {gamma: second}: beta moves to the first Redis.

    The composed epoch changes (the forwarder refills); the refill queues beta's unfinished jobs
    on the first Redis and removes every copy of beta's jobs from the second, except a job whose
    worker still holds its lease there (it runs there; its outcome is harvested from there).
    """
    from hybridq.protocol import keys
    from hybridq.transport.routes import Routes
    from hybridq.transport.sharded import ShardedTransport

    first, second = make_redis_server(), make_redis_server()
    make = lambda url: RQTransport(url, socket_timeout_s=1.0)  # noqa: E731
    old = ShardedTransport(Routes(first.url, {"beta": second.url, "gamma": second.url}), make=make)
    new = ShardedTransport(Routes(first.url, {"gamma": second.url}), make=make)
    try:
        token = old.state_token("owner1")
        epoch = f"5:{token.run_id}:cafe"
        old.set_epoch("owner1", epoch)
        assert old.state_token("owner1") == type(token)(epoch, token.run_id)
        done, waiting, running = (
            [delivery("beta", idempotency_key=f"{name}{i}") for i in range(3)]
            for name in ("done", "waiting", "running")
        )
        other = [delivery("gamma", idempotency_key=f"g{i}") for i in range(3)]
        old.push(done + waiting + running + other)
        b = old.shards[1].connection
        b.set(keys.lease(running[0].envelope.key_id), "a-worker", px=60_000)
        # A gamma job runs on the second Redis; a beta job not yet pushed shares its key: moved.
        b.set(keys.lease(other[0].envelope.key_id), "a-worker", px=60_000)
        shared = delivery("beta", idempotency_key="g0")

        moved = new.state_token("owner1")
        assert (moved.epoch, moved.run_id) != (epoch, token.run_id)  # the forwarder refills

        new.set_epoch("owner1", f"6:{moved.run_id}:beef")
        terminal = [Probe(d.envelope.id, d.envelope.key_id, "beta") for d in done]
        result = new.refill(terminal, [*waiting, *running, shared])
        a = new.shards[0].connection
        on_first = [raw.decode() for raw in a.lrange("rq:queue:beta", 0, -1)]
        assert on_first == [d.envelope.id for d in [*waiting, *running[1:], shared]]
        assert [raw.decode() for raw in b.lrange("rq:queue:beta", 0, -1)] == [running[0].envelope.id]
        for d in done + waiting + running[1:]:
            assert not b.exists(keys.rq_job(d.envelope.id))
        assert result.requeued == 6
        assert len(b.lrange("rq:queue:gamma", 0, -1)) == 3  # the queue that stays is untouched
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("size", [10, 5000])
def test_a_small_jobs_data_is_stored_uncompressed_and_rq_reads_either(redis_server, size) -> None:
    """Compressing a few hundred bytes cost the forwarder more per job than the rest of the hash.

    RQ falls back to the raw bytes when ``zlib.decompress`` refuses them; large data stays
    compressed (what Redis holds per job, docs/benchmarks.md).
    """
    transport = RQTransport(redis_server.url)
    try:
        d = delivery(args=("x" * size,))
        transport.push([d])
        raw = transport.connection.hget(f"rq:job:{d.envelope.id}", "data")
        assert raw.startswith(b"[") == (size < 1000)
        assert len(raw) < size or size < 1000
        job = RQJob.fetch(d.envelope.id, connection=transport.connection, serializer=JSONSerializer)
        assert job.args[0]["job"]["args"] == ["x" * size]
        assert job_data(raw)[2][0]["job"]["id"] == d.envelope.id
    finally:
        transport.close()
