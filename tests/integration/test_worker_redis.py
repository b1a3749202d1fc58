"""Workers against a private redis-server: killed workers and work-horses, Redis lost, duplicates.

Every process is real: ``python -m hybridq forward --lease 2``, ``python -m hybridq worker``
(RQ's forking ``Worker``, or ``--simple``), a plain ``rq worker``, and a private redis-server.
Tasks (``tests.tasks``) append fsync'd lines to an effects file, so what ran is counted without
trusting hybridq; ``hybridq status --json`` must agree. Scenarios report one figure line each
(docs/reliability.md S9, S10, S11, and the worker-side guarantees).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue, Retry, failed_jobs
from hybridq.journal.paths import ensure_journal_dir
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.store import load_index, read_ledger
from hybridq.testing.embedded import RedisServer
from hybridq.testing.rq_cli import RQ
from rq.job import Job
from rq.serializers import JSONSerializer

from tests.support.processes import ForwarderProcess, WorkerProcess, run_status, wait_for_status, wait_until

#: The forwarder's lease (seconds): short, so killed workers are noticed quickly.
LEASE_S = 2.0
#: A killed worker's job must start again within this long (lease + reconcile + slack).
REDELIVERY_BOUND_S = LEASE_S * 3 + 5
QUEUE_KEY = "rq:queue:default"


# -- processes ----------------------------------------------------------------------------------


class Stack:
    """Starts the forwarder and workers of one test; everything still running is killed at teardown."""

    def __init__(self, tmp_path: Path, journal: Path, env: dict[str, str]) -> None:
        self.tmp_path, self.journal, self.env = tmp_path, journal, env
        self.forwarders: list[ForwarderProcess] = []
        self.workers: list[WorkerProcess] = []

    def forwarder(self, redis_url: str, *extra_args: str, journal: Path | None = None) -> ForwarderProcess:
        """``hybridq forward`` on the test's journal (or on ``journal``: another producer's)."""
        journal = journal or self.journal
        ensure_journal_dir(journal)  # what the first Queue(...) does; forward needs it to exist
        proc = ForwarderProcess(
            journal,
            redis_url,
            env=self.env,
            log_path=self.tmp_path / f"forwarder-{len(self.forwarders)}.log",
            extra_args=("--lease", str(LEASE_S), *extra_args),
        )
        self.forwarders.append(proc)
        return proc

    def worker(self, redis_url: str, *, simple: bool = False, rq: bool = False) -> WorkerProcess:
        """``python -m hybridq worker [--simple | --rq] default`` (the pool by default)."""
        args = [sys.executable, "-m", "hybridq", "worker", "--redis", redis_url]
        mode = ["--simple"] if simple else ["--rq"] if rq else []
        return self._start([*args, *mode, "default"])

    def rq_worker(self, redis_url: str, *extra_args: str) -> WorkerProcess:
        """A plain ``rq worker --serializer rq.serializers.JSONSerializer default`` (forking)."""
        args = [*RQ, "worker", "--serializer", "rq.serializers.JSONSerializer", "-u", redis_url]
        return self._start([*args, *extra_args, "default"])

    def _start(self, args: list[str]) -> WorkerProcess:
        proc = WorkerProcess(
            args, env=self.env, log_path=self.tmp_path / f"worker-{len(self.workers)}.log", cwd=self.tmp_path
        )
        self.workers.append(proc)
        return proc

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        for forwarder in self.forwarders:
            forwarder.kill()


@pytest.fixture
def stack(tmp_path: Path, journal_dir: Path, subprocess_env: dict[str, str]) -> Iterator[Stack]:
    s = Stack(tmp_path, journal_dir, subprocess_env)
    try:
        yield s
    finally:
        s.close()


# -- the effects file ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One effects line (see tests.tasks): ``start|done token attempt pid time``,
    ``run token attempt [run number]`` or ``ok token attempt``."""

    kind: str
    token: str
    attempt: int
    pid: int = 0
    at: float = 0.0
    run: int = 0


def read_effects(path: Path) -> list[Line]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for raw in text.splitlines():
        parts = raw.split()
        kind, token, attempt = parts[0], parts[1], int(parts[2])
        if len(parts) == 5:
            out.append(Line(kind, token, attempt, pid=int(parts[3]), at=float(parts[4])))
        elif len(parts) == 4:
            out.append(Line(kind, token, attempt, run=int(parts[3])))
        else:
            out.append(Line(kind, token, attempt))
    return out


def lines_of(path: Path, kind: str, token: str | None = None) -> list[Line]:
    return [x for x in read_effects(path) if x.kind == kind and (token is None or x.token == token)]


def wait_line(
    path: Path, kind: str, token: str, *, attempt: int | None = None, timeout: float = 60.0
) -> Line:
    def found() -> list[Line]:
        return [x for x in lines_of(path, kind, token) if attempt is None or x.attempt == attempt]

    return wait_until(found, timeout=timeout, what=f"effects line {kind} {token} attempt={attempt}")[0]


def duplicate_executions(lines: list[Line]) -> int:
    """Runs that started after a run of the same token had finished (must never happen)."""
    finished: set[str] = set()
    dups = 0
    for line in lines:
        if line.kind == "start" and line.token in finished:
            dups += 1
        elif line.kind == "done":
            finished.add(line.token)
    return dups


# -- status and Redis ---------------------------------------------------------------------------


def wait_status(
    journal: Path,
    env: dict[str, str],
    predicate: Callable[[dict[str, Any]], bool],
    *,
    what: str,
    timeout: float = 60.0,
    alive: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Poll ``hybridq status --json`` until ``predicate`` holds; return that status."""
    return wait_for_status(journal, env, predicate, what=what, timeout=timeout, interval=0.25, alive=alive)


def all_succeeded(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda s: s["accepted"] == n and s["succeeded"] == n and s["pending"] == 0


def redis_client(server: RedisServer) -> contextlib.closing[Any]:
    return contextlib.closing(server.client(socket_timeout=30))


def queue_length(server: RedisServer) -> int:
    with redis_client(server) as client:
        return int(client.llen(QUEUE_KEY))


def in_flight(server: RedisServer) -> int:
    """Jobs Redis holds queued, reserved or running (a pool worker takes a burst from the queue
    at once, into the intermediate list; RQ's started registry lists only runs 0.25 s old)."""
    with redis_client(server) as client:
        reserved = client.llen(QUEUE_KEY + ":intermediate")
        return int(client.llen(QUEUE_KEY)) + int(reserved) + int(client.zcard("rq:wip:default"))


def rq_job(server: RedisServer, job_id: str) -> Job:
    with redis_client(server) as client:
        job = Job.fetch(job_id, connection=client, serializer=JSONSerializer)
        job.get_status()  # read while the connection is open
        return job


def alive(*procs: ForwarderProcess | WorkerProcess) -> Callable[[], None]:
    def check() -> None:
        for proc in procs:
            proc.assert_alive()

    return check


def ledger_succeeded_ids(journal: Path) -> set[str]:
    """Job ids with a (non-duplicate) success durable in the ledger right now."""
    return {
        e.job_id
        for _, e in read_ledger(str(journal))
        if e.kind == "done" and e.outcome == "succeeded" and not e.dup
    }


def retry_scheduled(journal: Path, attempt: int) -> bool:
    """Whether the ledger schedules a retry after failed attempt ``attempt`` (and no later one)."""
    index = load_index(str(journal), load_compacted(str(journal)))
    return max((n for _, n in index.retries.values()), default=0) == attempt


def listening(worker: WorkerProcess) -> bool:
    worker.assert_alive()
    return "Listening on" in worker.log()


# -- S9: a worker or its work-horse SIGKILLed mid-job -------------------------------------------


@pytest.mark.parametrize("victim", ["simple-worker", "work-horse", "pool-process"])
def test_s9_worker_killed_mid_job_is_delivered_again(
    victim: str,
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    effects = tmp_path / "effects.txt"
    simple = victim == "simple-worker"
    rq = victim == "work-horse"  # RQ's forking worker: a work-horse per job
    forwarder = stack.forwarder(redis_server.url)
    first = stack.worker(redis_server.url, simple=simple, rq=rq)
    queue = Queue("default", journal_dir)
    queue.enqueue("tests.tasks.traced", str(effects), "slow", 3.0)

    started = wait_line(effects, "start", "slow", attempt=1)
    if simple:
        assert started.pid == first.pid, "a --simple worker must run the job in its own process"
    else:
        assert started.pid != first.pid, "the worker ran the job in its main process"
        assert started.pid in first.children(), "the job does not run in the worker's child process"
    # A second worker takes the redelivery (a killed --simple worker cannot); started only now,
    # so it could not take the first delivery.
    stack.worker(redis_server.url, simple=simple, rq=rq)
    assert not lines_of(effects, "done", "slow"), "the job finished before it could be killed"
    os.kill(started.pid, signal.SIGKILL)
    killed_at = time.time()
    if simple:
        assert first.proc.wait(timeout=10) == -signal.SIGKILL
    else:
        first.assert_alive()  # only its work-horse, or one process of the pool, died
    tokens = ["slow"] + [f"fast-{i}" for i in range(8)]
    for token in tokens[1:]:
        queue.enqueue("tests.tasks.traced", str(effects), token)

    rerun = wait_line(effects, "start", "slow", attempt=2, timeout=REDELIVERY_BOUND_S + 30)
    redelivery_s = rerun.at - killed_at
    assert rerun.pid != started.pid
    assert redelivery_s < REDELIVERY_BOUND_S, f"redelivered {redelivery_s:.1f} s after the kill"
    status = wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(len(tokens)),
        what="every job to succeed",
        alive=alive(forwarder),
    )
    assert status["failed"] == 0

    lines = read_effects(effects)
    done = collections.Counter(x.token for x in lines if x.kind == "done")
    starts = collections.Counter(x.token for x in lines if x.kind == "start")
    lost = [t for t in tokens if done[t] == 0]
    assert not lost, f"jobs that never finished: {lost}"
    assert all(done[t] == 1 for t in tokens), f"jobs that finished more than once: {done}"
    assert [x.attempt for x in lines if x.kind == "start" and x.token == "slow"] == [1, 2]
    assert all(starts[t] == 1 for t in tokens[1:]), starts
    dup_execution = duplicate_executions(lines)
    assert dup_execution == 0
    dup_delivery = sum(starts.values()) - len(tokens)
    assert dup_delivery == 1  # the killed run, and only it, started twice
    figures(
        f"S9 worker-kill victim={victim} accepted={status['accepted']} lost={len(lost)} "
        f"dup_delivery={dup_delivery} dup_execution={dup_execution} redelivery_s={redelivery_s:.1f} "
        f"bound_s={REDELIVERY_BOUND_S:g}"
    )


# -- S10: Redis SIGKILLed and restarted empty while jobs flow --------------------------------


def test_s10_redis_restarted_empty_mid_stream_loses_nothing(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    effects = tmp_path / "effects.txt"
    n = 300
    restarts_at = (100, 200)
    forwarder = stack.forwarder(redis_server.url)
    workers = [stack.worker(redis_server.url, simple=True), stack.worker(redis_server.url)]
    queue = Queue("default", journal_dir)
    tokens = [f"s10-{i}" for i in range(n)]
    in_redis_at_kill: list[int] = []
    i = 0
    while i < n:
        if i in restarts_at:
            # A burst, so that Redis surely holds jobs in flight when it dies: some queued, some
            # running, some done with their completion not harvested yet.
            burst = tokens[i : i + 50]
            queue.enqueue_many([queue.prepare("tests.tasks.record", (str(effects), t)) for t in burst])
            i += len(burst)
            queued = wait_until(
                lambda: in_flight(redis_server),
                timeout=30,
                interval=0.01,
                what="jobs queued or running in Redis",
            )
            in_redis_at_kill.append(queued)
            redis_server.restart()  # SIGKILL, then the same port with no data
            continue
        queue.enqueue("tests.tasks.record", str(effects), tokens[i])
        i += 1
        time.sleep(0.01)
    status = wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(n),
        what=f"all {n} jobs to succeed",
        timeout=120,
        alive=alive(forwarder, *workers),
    )
    assert status["failed"] == 0
    ran = collections.Counter(read_effects_tokens(effects))
    lost = [t for t in tokens if ran[t] == 0]
    assert not lost, f"{len(lost)} accepted jobs never ran, e.g. {lost[:5]}"
    assert set(ran) == set(tokens)
    reruns = sum(ran.values()) - n  # jobs whose completion Redis forgot before it was harvested
    # How often `hybridq worker` had to start RQ's loop again (RQ quits on some Redis errors).
    loop_restarts = sum(
        w.log().count("starting it again") + w.log().count("Redis unavailable") for w in workers
    )
    figures(
        f"S10 redis-restart-empty accepted={status['accepted']} restarts={len(restarts_at)} "
        f"queued_at_kill={in_redis_at_kill} succeeded={status['succeeded']} pending={status['pending']} "
        f"lost={len(lost)} reruns={reruns} rq_loop_restarts={loop_restarts}"
    )


def read_effects_tokens(path: Path) -> list[str]:
    """Tokens written by ``tests.tasks.record`` (one per line)."""
    return path.read_text(encoding="utf-8").split()


# -- S11: FLUSHALL after some completions -------------------------------------------------------


def test_s11_flushall_does_not_rerun_jobs_the_ledger_has(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    effects = tmp_path / "effects.txt"
    n = 40
    forwarder = stack.forwarder(redis_server.url)
    worker = stack.worker(redis_server.url, simple=True)
    queue = Queue("default", journal_dir)
    tokens = [f"s11-{i}" for i in range(n)]
    envs = [queue.prepare("tests.tasks.traced", (str(effects), t, 0.1)) for t in tokens]
    token_of = {job.id: t for job, t in zip(queue.enqueue_many(envs), tokens, strict=True)}
    wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["succeeded"] >= 12,
        what="12 successes in the ledger",
        alive=alive(forwarder, worker),
    )
    # Whatever the ledger holds now is durable: FLUSHALL must not make it run again.
    in_ledger = {token_of[i] for i in ledger_succeeded_ids(journal_dir)}
    redis_server.flushall()
    pending_at_flush = n - len(in_ledger)
    assert pending_at_flush > 0, "every job had finished before FLUSHALL: the test proved nothing"
    status = wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(n),
        what=f"all {n} jobs to succeed after FLUSHALL",
        timeout=90,
        alive=alive(forwarder, worker),
    )
    lines = read_effects(effects)
    starts = collections.Counter(x.token for x in lines if x.kind == "start")
    done = collections.Counter(x.token for x in lines if x.kind == "done")
    lost = [t for t in tokens if done[t] == 0]
    assert not lost, f"jobs that never finished: {lost}"
    rerun = sorted(t for t in in_ledger if starts[t] != 1)
    assert not rerun, f"jobs durably succeeded before FLUSHALL ran again: {rerun}"
    # Jobs that finished while their completion event was still in Redis may run again.
    rerun_unharvested = sum(1 for t in tokens if t not in in_ledger and done[t] > 1)
    figures(
        f"S11 flushall accepted={status['accepted']} in_ledger_at_flush={len(in_ledger)} "
        f"pending_at_flush={pending_at_flush} rerun_from_ledger={len(rerun)} "
        f"rerun_unharvested={rerun_unharvested} lost={len(lost)} succeeded={status['succeeded']}"
    )


# -- idempotency keys ---------------------------------------------------------------------------


def test_same_idempotency_key_from_two_journals_runs_once_under_a_plain_rq_worker(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    """Two producers' journals, two forwarders, one Redis: neither forwarder knows the other's
    keys (each pushes its job), so the worker's claim is what runs the key once."""
    effects = tmp_path / "effects.txt"
    journals = [journal_dir, tmp_path / "journal-b"]
    forwarders = [stack.forwarder(redis_server.url, journal=j) for j in journals]
    ids = [
        Queue("default", j).enqueue("tests.tasks.traced", str(effects), "K", idempotency_key="K").id
        for j in journals
    ]
    assert ids[0] != ids[1]
    wait_until(lambda: queue_length(redis_server) == 2, what="both jobs in Redis")

    worker = stack.rq_worker(redis_server.url, "--burst")
    assert worker.proc.wait(timeout=120) == 0, worker.log()
    statuses = [
        wait_status(j, subprocess_env, all_succeeded(1), what="the job to succeed", alive=alive(*forwarders))
        for j in journals
    ]
    assert [x.attempt for x in lines_of(effects, "start", "K")] == [1], "the task ran more than once"
    assert len(lines_of(effects, "done", "K")) == 1
    assert sum(s["failed"] for s in statuses) == 0
    suppressed = sum(s["duplicates_suppressed"] for s in statuses)
    assert suppressed >= 1
    for job_id in ids:  # the suppressed duplicate returns the stored result, like the run did
        job = rq_job(redis_server, job_id)
        assert job.get_status(refresh=False) == "finished"
        assert job.return_value() == "K"
    figures(
        f"IDEM same-key-twice journals=2 jobs=2 executions=1 "
        f"succeeded={sum(s['succeeded'] for s in statuses)} duplicates_suppressed={suppressed}"
    )


def test_a_finished_key_enqueued_again_after_flushall_is_not_pushed_and_does_not_run(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    """Enqueue-if-absent (docs/enqueue.md): the forwarder's ledger, not Redis, knows the key."""
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(redis_server.url)
    worker = stack.worker(redis_server.url)
    queue = Queue("default", journal_dir)
    first = queue.enqueue("tests.tasks.traced", str(effects), "A", idempotency_key="upload:a")
    pending = queue.enqueue("tests.tasks.traced", str(effects), "A", idempotency_key="upload:a")
    wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(2),
        what="the job and its duplicate to succeed",
        alive=alive(forwarder, worker),
    )
    redis_server.flushall()  # the stored outcome under the key is gone with everything else
    again = queue.enqueue("tests.tasks.traced", str(effects), "A", idempotency_key="upload:a")
    status = wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(3),
        what="the enqueue after FLUSHALL to finish",
        alive=alive(forwarder, worker),
    )
    time.sleep(1.0)  # a run, had there been one, has time to write its effects line
    executions = len(lines_of(effects, "start", "A"))
    assert executions == 1, read_effects(effects)
    assert (pending.duplicate_of, again.duplicate_of) == (first.id, first.id)
    assert again.get_status() == "finished"
    with redis_client(redis_server) as client:
        assert not client.exists(f"rq:job:{again.id}"), "the duplicate was pushed"
    assert status["duplicates_suppressed"] == 2
    figures(
        f"IDEM finished-key-after-flushall jobs=3 executions={executions} pushed=1 "
        f"succeeded={status['succeeded']} duplicates_suppressed={status['duplicates_suppressed']}"
    )


def test_concurrent_deliveries_of_one_key_run_it_once(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    """One key from two journals (one journal pushes it once): both deliveries in workers at once."""
    effects = tmp_path / "effects.txt"
    journals = [journal_dir, tmp_path / "journal-b"]
    forwarders = [stack.forwarder(redis_server.url, journal=j) for j in journals]
    workers = [stack.worker(redis_server.url, simple=True), stack.rq_worker(redis_server.url)]
    for worker in workers:  # both wait for work (else one would run both jobs, one after the other)
        wait_until(functools.partial(listening, worker), what=f"worker {worker.pid} to listen")
    queues = [Queue("default", j) for j in journals]
    ids = [q.enqueue("tests.tasks.traced", str(effects), "C", 1.0, idempotency_key="C").id for q in queues]
    statuses = [
        wait_status(
            j,
            subprocess_env,
            all_succeeded(1),
            what="the job to succeed",
            alive=alive(*forwarders, *workers),
        )
        for j in journals
    ]
    executions = len(lines_of(effects, "start", "C"))
    assert executions == 1, read_effects(effects)
    assert len(lines_of(effects, "done", "C")) == 1
    suppressed = sum(s["duplicates_suppressed"] for s in statuses)
    assert suppressed >= 1
    jobs = [rq_job(redis_server, job_id) for job_id in ids]
    # Both deliveries were in workers at the same time (else this test proves nothing).
    assert jobs[0].worker_name != jobs[1].worker_name
    started = [j.started_at for j in jobs]
    ended = [j.ended_at for j in jobs]
    assert None not in started
    assert None not in ended
    overlap = min(e for e in ended if e) - max(s for s in started if s)
    assert overlap.total_seconds() > 0, "the two deliveries did not overlap in time"
    figures(
        f"IDEM concurrent-same-key workers=2 journals=2 jobs=2 executions={executions} "
        f"overlap_s={overlap.total_seconds():.2f} duplicates_suppressed={suppressed}"
    )


# -- retries and failed jobs --------------------------------------------------------------------


def test_retries_with_backoff_survive_redis_restarts(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(redis_server.url)
    worker = stack.worker(redis_server.url)
    queue = Queue("default", journal_dir)
    retry = Retry(max_attempts=3, backoff_s=2.0, jitter=False)  # attempt 2 after 2 s, 3 after 4 s
    queue.enqueue("tests.tasks.flaky", str(effects), "R", 2, retry=retry)
    for failed_attempt in (1, 2):
        # The failure is durable in the ledger (retry scheduled): now Redis forgets everything.
        wait_until(
            functools.partial(retry_scheduled, journal_dir, failed_attempt),
            timeout=60,
            what=f"attempt {failed_attempt}'s failure in the ledger",
        )
        assert not lines_of(effects, "ok", "R")
        redis_server.restart()
    status = wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(1),
        what="the job to succeed on its third attempt",
        alive=alive(forwarder, worker),
    )
    runs = [(x.attempt, x.run) for x in lines_of(effects, "run", "R")]
    assert runs == [(1, 1), (2, 2), (3, 3)], runs
    assert [x.attempt for x in lines_of(effects, "ok", "R")] == [3]
    assert status["failed"] == 0
    assert status["retrying"] == 0
    figures(f"RETRY across-redis-restarts max_attempts=3 restarts=2 attempts_run={len(runs)} succeeded_on=3")


def test_a_job_out_of_attempts_is_listed_and_requeued(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    effects = tmp_path / "effects.txt"
    switch = tmp_path / "switch"
    forwarder = stack.forwarder(redis_server.url)
    worker = stack.worker(redis_server.url, simple=True)
    queue = Queue("default", journal_dir)
    retry = Retry(max_attempts=2, backoff_s=0.5, jitter=False)
    # Keyed: the forwarder knows the key as finished (failed), and the requeue must run it all the same.
    job = queue.enqueue(
        "tests.tasks.fail_unless", str(effects), "F", str(switch), retry=retry, idempotency_key="report:F"
    )

    def hybridq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hybridq", *args],
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def listed() -> list[dict[str, Any]]:
        alive(forwarder, worker)()
        out = hybridq("failed", "list", "--json", "--journal", str(journal_dir))
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    (failed,) = wait_until(listed, timeout=60, interval=0.25, what="the job in `hybridq failed list`")
    assert failed["id"] == job.id
    assert failed["attempts"] == 2
    assert failed["func"] == "tests.tasks.fail_unless"
    assert "does not exist" in (failed["error"] or "")
    assert [x.attempt for x in lines_of(effects, "run", "F")] == [1, 2]
    status = run_status(journal_dir, subprocess_env)
    assert (status["failed"], status["pending"], status["succeeded"]) == (1, 0, 0)

    switch.touch()
    out = hybridq("failed", "requeue", "--journal", str(journal_dir), job.id)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [job.id]
    ok = wait_line(effects, "ok", "F")
    assert ok.attempt == 1  # a requeued job starts its attempts over
    wait_until(lambda: not listed(), timeout=60, interval=0.25, what="the failed list to empty")
    status = wait_status(
        journal_dir,
        subprocess_env,
        lambda s: s["succeeded"] == 1 and s["pending"] == 0,
        what="the requeued job to succeed",
        alive=alive(forwarder, worker),
    )
    assert [x.attempt for x in lines_of(effects, "run", "F")] == [1, 2, 1]
    figures(
        f"FAILED out-of-attempts attempts=2 listed=1 requeued=1 runs_after_requeue=1 "
        f"accepted={status['accepted']} succeeded={status['succeeded']} failed={status['failed']} "
        f"failed_listed={status['failed_listed']}"
    )


# -- the worker process across a Redis restart --------------------------------------------------


def test_hybridq_worker_keeps_serving_across_redis_restarts(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(redis_server.url)
    worker = stack.worker(redis_server.url)
    queue = Queue("default", journal_dir)
    redis_url = redis_server.url
    expected: list[str] = []
    served_after_s: list[float] = []

    def enqueue_and_wait(prefix: str, n: int) -> dict[str, Any]:
        started = time.monotonic()
        for i in range(n):
            expected.append(f"{prefix}-{i}")
            queue.enqueue("tests.tasks.traced", str(effects), expected[-1])
        status = wait_status(
            journal_dir,
            subprocess_env,
            all_succeeded(len(expected)),
            what=f"the {prefix} jobs to succeed",
            alive=alive(forwarder, worker),
        )
        served_after_s.append(time.monotonic() - started)
        return status

    enqueue_and_wait("before", 5)
    # 1. Restarted while the worker waits for work.
    redis_server.restart()
    assert redis_server.url == redis_url, "redis-server moved to another port"
    enqueue_and_wait("after-idle", 5)
    # 2. Restarted while its work-horse runs a job.
    expected.append("mid")
    queue.enqueue("tests.tasks.traced", str(effects), "mid", 1.5)
    wait_line(effects, "start", "mid")
    redis_server.restart()
    status = enqueue_and_wait("after-busy", 5)

    worker.assert_alive()  # the same process throughout
    done = collections.Counter(x.token for x in read_effects(effects) if x.kind == "done")
    assert set(done) == set(expected)
    # Jobs finished before a restart are durable and never run again; "mid" was running when
    # Redis lost it, so it may have run twice (at-least-once).
    assert all(n == 1 for token, n in done.items() if token != "mid"), done
    log = worker.log()
    loop_restarts = log.count("starting it again") + log.count("Redis unavailable")
    figures(
        f"WORKER redis-restarts restarts=2 worker_pid_unchanged=1 jobs={status['accepted']} "
        f"succeeded={status['succeeded']} mid_job_runs={done['mid']} rq_loop_restarts={loop_restarts} "
        f"served_after_restart_s={max(served_after_s[1:]):.1f}"
    )


@pytest.mark.parametrize("mode", ["simple", "rq", "pool"])
def test_hybridq_worker_stops_on_sigterm(redis_server: RedisServer, stack: Stack, mode: str) -> None:
    """A supervisor's SIGTERM ends ``hybridq worker`` (exit 0), rather than restarting RQ's loop."""
    worker = stack.worker(redis_server.url, simple=mode == "simple", rq=mode == "rq")
    wait_until(lambda: "Listening on" in worker.log(), timeout=30, what="the worker to listen")
    started = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    rc = worker.proc.wait(timeout=15)
    assert rc == 0, worker.log()[-2000:]
    assert time.monotonic() - started < 5
    assert "starting it again" not in worker.log()


def test_hybridq_worker_runs_registered_tasks_and_refuses_the_rest(
    redis_server: RedisServer, tmp_path: Path, journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    """No HYBRIDQ_ALLOW: the worker runs only the @hybridq.task functions of the modules it imports."""
    effects = tmp_path / "effects.txt"
    env = {k: v for k, v in subprocess_env.items() if k != "HYBRIDQ_ALLOW"}
    ensure_journal_dir(journal_dir)
    forwarder = ForwarderProcess(journal_dir, redis_server.url, env=env, log_path=tmp_path / "forwarder.log")
    worker = WorkerProcess(
        [
            *(sys.executable, "-m", "hybridq", "worker", "--simple", "--import", "tests.registered_tasks"),
            *("--redis", redis_server.url, "default"),
        ],
        env=env,
        log_path=tmp_path / "worker.log",
        cwd=tmp_path,
    )
    try:
        queue = Queue("default", journal_dir)
        queue.enqueue("tests.registered_tasks.record", str(effects), "registered")
        refused = queue.enqueue("tests.tasks.record", str(effects), "not-allowed")
        status = wait_until(
            lambda: (s := run_status(journal_dir, env))["succeeded"] == 1 and s,
            timeout=60,
            what="the registered task to succeed",
        )
        wait_until(lambda: refused.id in worker.log(), timeout=60, what="the refusal")
    finally:
        worker.kill()
        forwarder.kill()
    assert effects.read_text().split() == ["registered"]
    # The refused job is left for a worker that allows it (issue 12.11), not failed for good.
    assert "is not allowed to run on this worker" in worker.log()
    assert "left for a worker that can run it" in worker.log()
    assert (status["succeeded"], status["failed"]) == (1, 0)
    assert failed_jobs(str(journal_dir)) == []
