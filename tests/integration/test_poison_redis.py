"""One poison record or event must not stop forwarding (issue 13.2), against a real redis-server.

Each test plants what an older version, a bug or an attacker could leave in the journal or in
the forwarder's event stream, next to an ordinary job, and runs the real forwarder (in process,
RQ transport): the poison is recorded as invalid (a record) or dropped and counted (an event),
and the ordinary job is forwarded. Before the fix, the first stalled the whole journal behind a
"transport unavailable" retried forever, the other two made the forwarder raise on every start.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.errors import UnencodableJobs
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport

from tests.support.processes import ForwarderProcess, run_status, wait_until

QUEUE_KEY = "rq:queue:default"
VALID = {"v": 1, "func": "tests.tasks.add", "queue": "default", "args": [1, 2], "created_at": 1.7e9}


def plant(journal: Path, **fields: object) -> None:
    """Append a record the producer API would refuse (written as an old version or attacker would)."""
    body = {**VALID, "id": "planted", "key": "planted", **fields}
    with JournalWriter(journal) as writer:
        writer.append(json.dumps(body).encode())


@pytest.fixture
def forwarder(redis_server: RedisServer, journal_dir: Path) -> Iterator[Forwarder]:
    Queue("default", journal_dir)  # creates the journal directory
    transport = RQTransport(redis_server.url)
    fwd = Forwarder(journal_dir, transport, backoff_initial_s=0.01, backoff_max_s=0.05)
    yield fwd
    fwd.close()
    transport.close()


def queued(server: RedisServer) -> list[str]:
    with contextlib.closing(server.client(socket_timeout=30)) as client:
        return [raw.decode() for raw in client.lrange(QUEUE_KEY, 0, -1)]


def run_until(forwarder: Forwarder, done: object, timeout: float = 5.0) -> None:
    """Run the forwarder loop in a thread until ``done()`` or ``timeout``; then stop it."""
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            forwarder.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and thread.is_alive() and not done():  # type: ignore[operator]
        time.sleep(0.02)
    forwarder.stop()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the forwarder did not stop"
    if errors:
        raise errors[0]


@pytest.mark.parametrize(
    "fields",
    [
        {"description": {"a": 1}},  # redis-py DataError: was "transport unavailable", forever
        {"description": ["x"]},
        {"created_at": 1e18},  # datetime.fromtimestamp raised ValueError: the forwarder exited
        {"created_at": -1e15},
        {"kwargs": [["a", 1]]},
        {"requeue": 10**30},
    ],
    ids=[
        "description-object",
        "description-list",
        "created_at-1e18",
        "created_at-negative",
        "kwargs-pairs",
        "requeue-huge",
    ],
)
def test_a_poison_record_is_invalid_and_the_next_job_is_forwarded(
    forwarder: Forwarder, redis_server: RedisServer, journal_dir: Path, fields: dict[str, object]
) -> None:
    plant(journal_dir, **fields)
    good = Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    forwarder.open()
    run_until(forwarder, lambda: good.id in queued(redis_server))
    assert queued(redis_server) == [good.id]
    assert forwarder.stats.transport_failures == 0
    assert forwarder.checkpoint.invalid == 1
    assert good.get_status() == "forwarded"


def test_a_delivery_redis_cannot_encode_is_refused_before_anything_is_sent(
    redis_server: RedisServer,
) -> None:
    """Defence in depth behind the envelope's checks: the transport names the jobs, not an outage."""
    good = Envelope("good", "tests.tasks.add", "default", "k1", 1.7e9)
    bad = Envelope("bad", "tests.tasks.add", "default", "k2", 1.7e9, description={"a": 1})  # type: ignore[arg-type]
    transport = RQTransport(redis_server.url)
    try:
        with pytest.raises(UnencodableJobs) as caught:
            transport.push([Delivery(good, "o", ("w", 0, 64)), Delivery(bad, "o", ("w", 0, 128))])
        assert [d.envelope.id for d, _ in caught.value.rejected] == ["bad"]
        assert queued(redis_server) == []
    finally:
        transport.close()


def add_event(server: RedisServer, owner: str, text: str) -> None:
    with contextlib.closing(server.client(socket_timeout=30)) as client:
        client.xadd(keys.events(owner), {"e": text})


@pytest.mark.parametrize(
    "event",
    [
        '{{"id":"{id}","loc":{loc},"outcome":"succeeded","at":1{zeros}}}',  # float(10**400) overflows
        '{{"id":"{id}","loc":[{w},Infinity,{o}],"outcome":"succeeded"}}',  # int(inf) overflows
        '{{"id":"{id}","loc":{loc},"outcome":"failed","final":false,"attempt":Infinity}}',
        '{{"id":"{id}","loc":{loc},"outcome":"failed","final":false,"retry_delay":1{zeros}}}',
        '{{"id":"{id}","loc":{loc},"outcome":"succeeded","at":NaN}}',
        '{{"id":"{id}","loc":{loc},"outcome":"failed","error":{{"a":1}}}}',
        "[" * 100_000,  # json.loads raised RecursionError, uncaught in harvest
    ],
    ids=["at-10**400", "loc-inf", "attempt-inf", "retry_delay-10**400", "at-NaN", "error-object", "deep"],
)
def test_a_poison_event_is_dropped_and_counted(
    forwarder: Forwarder, redis_server: RedisServer, journal_dir: Path, event: str
) -> None:
    first = Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    forwarder.open()
    forwarder.step()
    loc = [first.record.writer_id, first.record.segment, first.record.offset]
    text = event.format(id=first.id, loc=json.dumps(loc), w=json.dumps(loc[0]), o=loc[2], zeros="0" * 400)
    add_event(redis_server, forwarder.checkpoint.owner, text)
    second = Queue("default", journal_dir).enqueue("tests.tasks.add", 2, 2)
    forwarder.step()  # raised OverflowError (the forwarder exited, and again on every restart)
    assert queued(redis_server) == [first.id, second.id]
    completions = forwarder.completions
    assert completions is not None
    assert completions.dropped_events == 1
    assert first.get_status() == "forwarded"  # the forged outcome was not recorded
    with contextlib.closing(redis_server.client(socket_timeout=30)) as client:
        assert client.xlen(keys.events(forwarder.checkpoint.owner)) == 0  # not harvested again


def test_the_forward_command_keeps_running_over_poison_and_restarts_cleanly(
    redis_server: RedisServer,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    """``hybridq forward`` itself: before the fix it exited 1 at each start (created_at=1e18, an
    event at 10**400) or reported Redis down forever (a description Redis cannot hold)."""
    queue = Queue("default", journal_dir)
    plant(journal_dir, description={"a": 1})
    plant(journal_dir, created_at=1e18)
    first = queue.enqueue("tests.tasks.add", 1, 1)
    ids = [first.id]
    for run in range(2):  # the second start reads the same journal, ledger and stream again
        forwarder = ForwarderProcess(
            journal_dir, redis_server.url, env=subprocess_env, log_path=tmp_path / f"forwarder-{run}.log"
        )
        try:
            wait_until(lambda: set(ids) <= set(queued(redis_server)), what="the ordinary jobs to be queued")
            checkpoint = wait_until(lambda: load_checkpoint(str(journal_dir)), what="a checkpoint")
            add_event(
                redis_server,
                checkpoint.owner,
                '{"id":"x","loc":["w",0,64],"outcome":"succeeded","at":1' + "0" * 400 + "}",
            )
            ids.append(queue.enqueue("tests.tasks.add", 2, run).id)
            wait_until(lambda: set(ids) <= set(queued(redis_server)), what="the job enqueued after the event")
            forwarder.assert_alive()
            assert "transport unavailable" not in forwarder.log()
            rc, _ = forwarder.terminate()
            assert rc == 0, forwarder.log()[-3000:]
        finally:
            forwarder.kill()
    status = run_status(journal_dir, subprocess_env)
    assert status["invalid_records"] == 2
    assert status["failed"] == 2  # the invalid records are terminal
    assert sorted(queued(redis_server)) == sorted(ids)
    figures(
        f"13.2 poison: 2 poison records and 2 poison events, forwarder restarted once: queued={len(ids)} "
        f"invalid_records={status['invalid_records']} exits=0,0"
    )


def test_a_lone_surrogate_in_a_description_or_argument_name_is_forwarded(
    forwarder: Forwarder, redis_server: RedisServer, journal_dir: Path
) -> None:
    """JSON holds "\\ud800", redis-py's UTF-8 encoding did not: UnicodeEncodeError (not a RedisError)
    came out of the push and stopped the forwarder, at every restart. Found by test_fuzz.py."""
    queue = Queue("default", journal_dir)
    jobs = [
        queue.enqueue("tests.tasks.add", 1, 2, description="\ud800"),
        queue.enqueue_call("tests.tasks.add", (), {"\udfff": 1}),
    ]
    forwarder.open()
    forwarder.step()
    assert queued(redis_server) == [job.id for job in jobs]
    with contextlib.closing(redis_server.client(socket_timeout=30)) as client:
        assert client.hget(f"rq:job:{jobs[0].id}", "description") == b"\\ud800"
