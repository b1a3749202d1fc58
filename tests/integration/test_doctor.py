"""``hybridq doctor`` against a private redis-server: what it finds, what --fix does, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridq import Queue
from hybridq.cli import EXIT_ERROR, EXIT_FINDINGS, cli
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.forwarder.loop import Forwarder
from hybridq.journal.ownerlock import take_owner_lock
from hybridq.ledger.checkpoint import LOCK_NAME
from hybridq.testing.embedded import RedisServer
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport
from hybridq.worker import run_worker
from rq import Worker
from rq.serializers import JSONSerializer


@contextlib.contextmanager
def forwarder_running(journal: Path) -> Iterator[None]:
    """The journal's forwarder lock held, as a running forwarder holds it."""
    fd = take_owner_lock(os.path.join(journal, LOCK_NAME), owner="forwarder", busy="test")
    try:
        yield
    finally:
        os.close(fd)


def doctor(journal: Path, server: RedisServer, *extra: str, running: bool = True) -> tuple[int, dict]:
    """``hybridq doctor --json``, by default while a forwarder holds the journal."""
    with forwarder_running(journal) if running else contextlib.nullcontext():
        result = CliRunner().invoke(
            cli, ["doctor", "--json", "--journal", str(journal), "--redis", server.url, *extra]
        )
    return result.exit_code, json.loads(result.stdout)


def forward(journal: Path, server: RedisServer, n: int) -> list[str]:
    queue = Queue("default", journal)
    ids = [queue.enqueue("tests.tasks.add", i, i).id for i in range(n)]
    transport = RQTransport(server.url)
    with Forwarder(journal, transport) as forwarder:
        forwarder.step()
    transport.close()
    return ids


@contextlib.contextmanager
def registered_worker(server: RedisServer, *queues: str) -> Iterator[None]:
    """An RQ worker registered in Redis for ``queues`` (as a running one is), not running."""
    conn = server.client()
    worker = Worker(list(queues), connection=conn, serializer=JSONSerializer, name=f"w-{'-'.join(queues)}")
    worker.register_birth()
    try:
        yield
    finally:
        worker.register_death()
        conn.close()


def test_a_healthy_journal_and_redis(journal_dir: Path, redis_server: RedisServer) -> None:
    forward(journal_dir, redis_server, 10)
    with registered_worker(redis_server, "default"):
        code, report = doctor(journal_dir, redis_server)
    assert code == 0
    assert report["healthy"] is True
    assert report["verdicts"] == {"queued": 10}
    assert report["forwarder"].startswith("forwarder pid ")
    assert report["unattended"] == 0


def test_unfinished_jobs_while_no_forwarder_runs_are_not_healthy(
    journal_dir: Path, redis_server: RedisServer
) -> None:
    """The forwarder stopped (or was killed): 10 jobs wait and nothing moves them on."""
    forward(journal_dir, redis_server, 10)
    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)  # and one not forwarded yet
    with registered_worker(redis_server, "default"):
        code, report = doctor(journal_dir, redis_server, running=False)
        text = CliRunner().invoke(cli, ["doctor", "--journal", str(journal_dir), "--redis", redis_server.url])
    assert code == EXIT_FINDINGS
    assert (report["forwarder"], report["unattended"], report["healthy"]) == (None, 11, False)
    assert report["verdicts"] == {"queued": 10}  # Redis still has the forwarded ones
    assert text.exit_code == EXIT_FINDINGS
    assert text.stdout.splitlines() == [
        (
            f"no forwarder holds this journal: 11 unfinished job(s) wait until one runs "
            f"(hybridq forward --journal {journal_dir}; docs/forwarder.md)"
        ),
        "checked 10 forwarded, unfinished job(s): 10 queued",  # words, not a Python repr
        "problems found",
    ]


def test_a_journal_no_forwarder_ever_ran_on(journal_dir: Path, redis_server: RedisServer) -> None:
    """No checkpoint: the jobs wait for a first forwarder (it used to be exit 1, 'no checkpoint')."""
    journal_dir.mkdir(mode=0o700)
    code, report = doctor(journal_dir, redis_server, running=False)
    assert (code, report["healthy"], report["checked"]) == (0, True, 0)  # empty: nothing waits
    Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 1)
    Queue("default", journal_dir).enqueue("tests.tasks.add", 2, 2)
    code, report = doctor(journal_dir, redis_server, running=False)
    assert (code, report["unattended"], report["checked"]) == (EXIT_FINDINGS, 2, 0)
    code, report = doctor(journal_dir, redis_server)  # a forwarder starting: fine
    assert (code, report["unattended"]) == (0, 0)


def test_it_finds_what_redis_lost_and_fix_delivers_it_again(
    journal_dir: Path, redis_server: RedisServer
) -> None:
    ids = forward(journal_dir, redis_server, 10)
    conn = redis_server.client()
    conn.delete(f"rq:job:{ids[0]}", f"rq:job:{ids[1]}")  # evicted
    conn.lrem("rq:queue:default", 0, ids[0])
    conn.lrem("rq:queue:default", 0, ids[1])
    conn.rpush("rq:queue:default", ids[2])  # queued twice
    code, report = doctor(journal_dir, redis_server)
    assert code == EXIT_FINDINGS
    assert sorted(report["missing"]) == sorted(ids[:2])
    assert report["duplicate_entries"] == {ids[2]: 2}
    assert conn.exists(f"rq:job:{ids[0]}") == 0  # a dry run wrote nothing
    code, report = doctor(journal_dir, redis_server, "--fix")
    assert report["fixed"] == 2
    assert conn.exists(f"rq:job:{ids[0]}") == 1
    assert conn.lpos("rq:queue:default", ids[1]) is not None


def test_it_finds_jobs_of_this_forwarder_the_journal_does_not_know(
    journal_dir: Path, redis_server: RedisServer
) -> None:
    forward(journal_dir, redis_server, 3)
    from hybridq.ledger.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(str(journal_dir))
    assert checkpoint is not None
    stray = Envelope(new_job_id(), "tests.tasks.add", "default", "k", time.time(), args=(1, 1))
    transport = RQTransport(redis_server.url)
    transport.push([Delivery(stray, checkpoint.owner, ("gone", 0, 64))])
    transport.push(
        [
            Delivery(
                Envelope(new_job_id(), "tests.tasks.add", "default", "k2", time.time()), "other", ("x", 0, 64)
            )
        ]
    )
    transport.close()
    code, report = doctor(journal_dir, redis_server)
    assert code == EXIT_FINDINGS
    assert report["unknown"] == [stray.id]  # the other forwarder's job is not ours to judge


def test_bad_input_is_one_line(journal_dir: Path, tmp_path: Path, redis_server: RedisServer) -> None:
    runner = CliRunner()
    missing = runner.invoke(cli, ["doctor", "--journal", str(tmp_path / "nope"), "--redis", redis_server.url])
    assert missing.exit_code == EXIT_ERROR
    assert missing.output.count("\n") == 1
    forward(journal_dir, redis_server, 1)
    unreachable = runner.invoke(
        cli, ["doctor", "--journal", str(journal_dir), "--redis", "redis://127.0.0.1:1/0"]
    )
    assert unreachable.exit_code == EXIT_ERROR
    assert unreachable.output.count("\n") == 1


def test_it_reports_a_queue_no_worker_serves(journal_dir: Path, redis_server: RedisServer) -> None:
    Queue("emails", journal_dir).enqueue("tests.tasks.add", 1, 1)
    forward(journal_dir, redis_server, 2)  # two more on "default"
    with registered_worker(redis_server, "default"):
        code, report = doctor(journal_dir, redis_server)
        assert code == EXIT_FINDINGS
        assert report["unserved"] == {"emails": 1}  # "default" has a worker
        text = CliRunner().invoke(cli, ["doctor", "--journal", str(journal_dir), "--redis", redis_server.url])
        assert "queues no worker serves: emails (1 waiting)" in text.output
        with registered_worker(redis_server, "emails", "bulk"):
            code, report = doctor(journal_dir, redis_server)
    assert (code, report["unserved"]) == (0, {})


def test_it_reports_jobs_merged_into_another_with_their_id(
    journal_dir: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two different calls under one job_id: the second never runs. Not healthy, and named."""
    queue = Queue("default", journal_dir)
    first = queue.enqueue("tests.tasks.add", 1, 1, job_id="order-42")
    second = queue.enqueue("tests.tasks.add", 2, 2, job_id="order-42")
    # The same call again (a retry of an enqueue whose outcome was unknown): deduplicated, fine.
    queue.enqueue("tests.tasks.add", 5, 5, job_id="retry-7")
    queue.enqueue("tests.tasks.add", 5, 5, job_id="retry-7")
    forward(journal_dir, redis_server, 0)
    with registered_worker(redis_server, "default"):
        code, report = doctor(journal_dir, redis_server)
    assert code == EXIT_FINDINGS
    assert report["merged"] == ["order-42"]
    assert (first.get_status(), second.get_status()) == ("forwarded", "merged")
    # The first runs; the second never does, and keeps saying so.
    monkeypatch.setenv("HYBRIDQ_ALLOW", "tests.tasks")
    assert run_worker(["default"], url=redis_server.url, burst=True, simple=True) == 0
    transport = RQTransport(redis_server.url)
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()
    transport.close()
    assert (first.get_status(), second.get_status()) == ("finished", "merged")
    assert first.envelope.args == (1, 1)
    code, report = doctor(journal_dir, redis_server)
    assert (code, report["merged"]) == (EXIT_FINDINGS, ["order-42"])


def test_fix_pushes_under_the_forwarders_current_generation(
    journal_dir: Path, redis_server: RedisServer
) -> None:
    """A --fix delivery of generation 0 after the epoch moved on would be refused by every claim."""
    from hybridq.ledger.checkpoint import load_checkpoint
    from rq.job import Job as RQJob

    ids = forward(journal_dir, redis_server, 3)
    conn = redis_server.client()
    conn.flushall()  # Redis lost everything: the forwarder's next epoch check moves the generation
    transport = RQTransport(redis_server.url)
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()
    transport.close()
    checkpoint = load_checkpoint(str(journal_dir))
    assert checkpoint is not None
    assert checkpoint.generation >= 1
    conn.delete(f"rq:job:{ids[0]}")  # evicted since
    conn.lrem("rq:queue:default", 0, ids[0])
    _, report = doctor(journal_dir, redis_server, "--fix")
    assert report["fixed"] >= 1
    job = RQJob.fetch(ids[0], connection=conn, serializer=JSONSerializer)
    assert job.args[0]["gen"] == checkpoint.generation
