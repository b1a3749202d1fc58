"""Network faults between hybridq and Redis (docs/reliability.md S12, issue 6): nothing lost, nothing re-run.

A real ``hybridq forward`` and two ``hybridq worker --simple`` processes reach a private
redis-server only through a :class:`~hybridq.testing.faultproxy.FaultProxy`, which adds latency, resets
connections, blackholes them, or lets a command run in Redis and then resets the connection
instead of delivering its reply (the *unknown outcome*: the write happened, the client never
heard). Each scenario enqueues jobs while its fault is on, clears it, enqueues a few more (the
system must have recovered), and counts from the effects file the tasks append to
(``tests.tasks.traced``, ``tests.tasks.flaky``) and from RQ's own log, not from hybridq:

- **lost**: accepted and never succeeded (must be 0);
- **dup_execution**: a task started again after a run of the same job had succeeded (must be 0:
  no fault here kills a run or keeps its outcome from being stored);
- **dup_delivery**: deliveries workers took beyond one per job (two for a job that fails once),
  suppressed duplicates and stale copies included (counted, allowed).

Each scenario reports one figure line, e.g. ``NET cut-exec accepted=45 lost=0 ...``. The last
tests check the proxy itself (each fault does what it says) and pin a bug cut-finish found.
"""

from __future__ import annotations

import collections
import itertools
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from hybridq import Queue, Retry
from hybridq.envelope.model import Envelope, new_job_id
from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer
from hybridq.testing.faultproxy import FaultProxy, parse_command, reply_end, script_call
from hybridq.transport.base import Delivery
from hybridq.transport.rq import _PUSH_IF_NEW, RQTransport
from hybridq.worker import _CLAIM, _FINISH
from rq.job import Job as RQJob
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from tests.support.processes import ForwarderProcess, WorkerProcess, wait_for_status, wait_until

#: Jobs enqueued while a fault is on, and after it was cleared (the recovery check).
DURING, AFTER = 40, 5
#: The forwarder's lease: short, so a job whose claim reply was cut is delivered again quickly.
LEASE_S = 2.0


@dataclass
class Net:
    """One scenario's processes: Redis, the proxy in front of it, a forwarder and two workers."""

    tmp_path: Path
    journal: Path
    env: dict[str, str]
    redis: RedisServer
    proxy: FaultProxy
    forwarder: ForwarderProcess | None = None
    workers: tuple[WorkerProcess, ...] = ()
    reset_started: float | None = None

    @property
    def effects(self) -> Path:
        return self.tmp_path / "effects.txt"

    def start(self, *, lease_s: float = LEASE_S) -> None:
        ensure_journal_dir(self.journal)
        self.forwarder = ForwarderProcess(
            self.journal,
            self.proxy.url,
            env=self.env,
            log_path=self.tmp_path / "forwarder.log",
            extra_args=("--lease", str(lease_s)),
        )
        args = [sys.executable, "-m", "hybridq", "worker", "--redis", self.proxy.url, "--simple", "default"]
        self.workers = tuple(
            WorkerProcess(args, env=self.env, log_path=self.tmp_path / f"worker-{i}.log", cwd=self.tmp_path)
            for i in range(2)
        )
        forwarder = self.forwarder
        # Ready before any fault: a fault must meet a running system, not one still starting.
        wait_until(lambda: "forwarding to" in forwarder.log(), what="the forwarder to start")
        wait_until(lambda: all("Listening on" in w.log() for w in self.workers), what="workers to listen")

    def alive(self) -> None:
        for proc in (self.forwarder, *self.workers):
            if proc is not None:
                proc.assert_alive()

    def logs(self) -> str:
        return "\n".join(p.log() for p in (self.forwarder, *self.workers) if p is not None)

    def close(self) -> None:
        for proc in (*self.workers, self.forwarder):
            if proc is not None:
                proc.kill()


@pytest.fixture
def net(
    tmp_path: Path, journal_dir: Path, subprocess_env: dict[str, str], redis_server: RedisServer
) -> Iterator[Net]:
    assert redis_server.port is not None
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        n = Net(tmp_path, journal_dir, subprocess_env, redis_server, proxy)
        try:
            yield n
        finally:
            n.close()


# -- counting -----------------------------------------------------------------------------------

#: What ``tests.tasks.traced`` and ``tests.tasks.flaky`` write when a run starts, and when one succeeds.
STARTS, ENDS = ("start", "run"), ("done", "ok")
#: RQ's log line for every job a worker takes (the description names the token last).
DELIVERY = re.compile(r": default: tests\.tasks\.\w+\(.*?'([\w-]+)'(?:, \d+)?\) \(")


def effects(path: Path) -> list[tuple[str, str, int]]:
    """(kind, token, attempt) of every line the tasks wrote, in order."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [(parts[0], parts[1], int(parts[2])) for parts in (line.split() for line in text.splitlines())]


def duplicate_executions(lines: list[tuple[str, str, int]]) -> int:
    """Runs that started after a run of the same job had succeeded."""
    finished: set[str] = set()
    dups = 0
    for kind, token, _ in lines:
        if kind in STARTS and token in finished:
            dups += 1
        elif kind in ENDS:
            finished.add(token)
    return dups


def wait_all_succeeded(net: Net, n: int, *, timeout: float) -> dict[str, Any]:
    try:
        return wait_for_status(
            net.journal,
            net.env,
            lambda s: s["accepted"] == n and s["succeeded"] == n and s["pending"] == 0,
            what=f"all {n} jobs to succeed",
            timeout=timeout,
            alive=net.alive,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{net.logs()[-6000:]}") from None


@dataclass
class Scenario:
    """A fault: ``inject`` switches it on; it is cleared once ``until`` holds (polled)."""

    name: str
    inject: Callable[[Net], None]
    until: Callable[[Net], bool]
    #: Jobs among the first DURING that fail their first run (``tests.tasks.flaky``, 3 attempts).
    flaky: int = 0
    #: What else must hold afterwards, given the processes, ``hybridq status`` and the effects lines.
    check: Callable[[Net, dict[str, Any], list[tuple[str, str, int]]], None] = lambda *_: None


def run_scenario(net: Net, sc: Scenario, figures: Callable[[str], None], *, timeout: float = 40.0) -> None:
    """Enqueue DURING jobs with the fault on, clear it, enqueue AFTER more; count and check."""
    queue = Queue("default", net.journal)
    tokens = [f"{sc.name}-{i}" for i in range(DURING + AFTER)]
    sc.inject(net)
    for i, token in enumerate(tokens):
        if i == DURING:
            wait_until(lambda: sc.until(net), timeout=timeout, interval=0.05, what=f"the end of {sc.name}")
            net.proxy.clear()
            cleared = time.monotonic()
        if i < sc.flaky:
            queue.enqueue("tests.tasks.flaky", str(net.effects), token, 1, retry=Retry(3, backoff_s=0.1))
        else:
            queue.enqueue("tests.tasks.traced", str(net.effects), token)
        time.sleep(0.02)  # a stream, not one batch: the fault meets pushes, claims and results
    status = wait_all_succeeded(net, len(tokens), timeout=timeout)
    recovery_s = time.monotonic() - cleared
    lines = effects(net.effects)
    succeeded = collections.Counter(t for kind, t, _ in lines if kind in ENDS)
    lost = [t for t in tokens if succeeded[t] == 0]
    dup_execution = duplicate_executions(lines)
    # Every delivery a worker took, from RQ's own log; a flaky job needs two.
    deliveries = collections.Counter(m[1] for w in net.workers for m in DELIVERY.finditer(w.log()))
    assert set(deliveries) == set(tokens), "the delivery count does not see every job"
    dup_delivery = deliveries.total() - len(tokens) - sc.flaky
    stats = net.proxy.stats
    figures(
        f"NET {sc.name} accepted={len(tokens)} lost={len(lost)} dup_delivery={dup_delivery} "
        f"dup_execution={dup_execution} suppressed={status['duplicates_suppressed']} "
        f"duplicate_pushes={status['duplicate_pushes']} cuts={stats.cuts} resets={stats.resets} "
        f"connections={stats.connections} recovery_s={recovery_s:.1f}"
    )
    assert not lost, f"accepted jobs that never succeeded: {lost}"
    assert dup_execution == 0, f"tasks ran again after they had succeeded: {lines}"
    assert status["failed"] == 0
    sc.check(net, status, lines)


# -- the scenarios ------------------------------------------------------------------------------


def cuts_done(net: Net) -> bool:
    return net.proxy.cuts_left == 0


def some_ran(net: Net) -> bool:
    """16 jobs have succeeded since the fault was switched on (it was on while they ran)."""
    return sum(kind in ENDS for kind, _, _ in effects(net.effects)) >= 16


def finish_of_failure_or_every_fifth() -> Callable[[Sequence[bytes]], bool]:
    """The worker's record-the-outcome script: every failed run's, and every fifth success's."""
    is_finish = script_call(_FINISH)
    seen = itertools.count(1)

    def match(command: Sequence[bytes]) -> bool:
        if not is_finish(command):
            return False
        return any(b'"outcome": "failed"' in arg for arg in command) or next(seen) % 5 == 0

    return match


def keep_resetting(net: Net) -> bool:
    """Reset every connection now; refuse new ones in the first second. True after 2.5 s."""
    if net.reset_started is None:
        net.reset_started = time.monotonic()
    started = net.reset_started
    net.proxy.refuse(time.monotonic() - started < 1.0)
    net.proxy.reset()
    time.sleep(0.2)
    return time.monotonic() - started > 2.5


def pushed_again(status: dict[str, Any]) -> None:
    assert status["duplicate_pushes"] > 0, "no push was sent again after its reply was cut"


def no_attempt_used(lines: list[tuple[str, str, int]]) -> None:
    """A claim the worker never heard of was retried with its token, and found to be its own."""
    later = {token: attempt for kind, token, attempt in lines if kind in STARTS and attempt > 1}
    assert later == {}, f"unheard claims used up attempts: {later}"


def no_false_alarm(net: Net) -> None:
    """An outcome script retried after its reply was lost found its own outcome, said nothing."""
    for worker in net.workers:
        assert "ran twice for one key" not in worker.log(), worker.log()[-3000:]


SCENARIOS = [
    # 10 ms each way: a hybridq job under RQ costs about 20 round trips.
    Scenario("latency", lambda net: net.proxy.latency(0.01), some_ran),
    Scenario("resets", lambda net: None, keep_resetting),
    # EXEC: RQ's MULTI/EXEC transactions (a worker taking a job, finishing it, its heartbeat).
    Scenario("cut-exec", lambda net: net.proxy.cut_replies(3, b"EXEC", every=5), cuts_done),
    # The forwarder's push script (a pipeline of EVALSHA: the whole batch ran, no reply came).
    # Pushed again, and found already there: nothing queued twice.
    Scenario(
        "cut-push",
        lambda net: net.proxy.cut_replies(3, script_call(_PUSH_IF_NEW), every=3),
        cuts_done,
        check=lambda _net, status, _lines: pushed_again(status),
    ),
    # The worker's claim: the lease was taken and the run marked started, the worker never knew.
    # It claims again with the same token, finds the lease its own, and runs the task: no
    # attempt is used up.
    Scenario(
        "cut-claim",
        lambda net: net.proxy.cut_replies(3, script_call(_CLAIM), every=5),
        cuts_done,
        check=lambda _net, _status, lines: no_attempt_used(lines),
    ),
    # The worker's record-the-outcome script: the outcome and its event were stored.
    Scenario(
        "cut-finish",
        lambda net: net.proxy.cut_replies(5, finish_of_failure_or_every_fifth()),
        cuts_done,
        flaky=3,
        check=lambda net, _status, _lines: no_false_alarm(net),
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda sc: sc.name)
def test_network_fault(scenario: Scenario, net: Net, figures: Callable[[str], None]) -> None:
    net.start()
    run_scenario(net, scenario, figures)


def test_blackhole_times_out_and_recovers(net: Net, figures: Callable[[str], None]) -> None:
    """Nothing moves for longer than the forwarder's 5 s socket timeout; then the partition heals.

    The forwarder must notice (a timeout, not a hang); the bytes held meanwhile are delivered
    late, after their senders gave up on them, as TCP would after a partition. The lease is
    longer than the blackhole, so no running job loses its lease.
    """
    net.start(lease_s=15.0)
    assert net.forwarder is not None
    forwarder = net.forwarder
    started = [0.0]

    def inject(net: Net) -> None:
        started[0] = time.monotonic()
        net.proxy.blackhole()

    def forwarder_timed_out(net: Net) -> bool:
        return "transport unavailable" in forwarder.log() and time.monotonic() - started[0] > 3.0

    run_scenario(net, Scenario("blackhole", inject, forwarder_timed_out), figures)
    assert "Timeout" in forwarder.log(), forwarder.log()


# -- a retry overwritten by the previous run's late RQ bookkeeping -------------------------------


def test_a_retry_overwritten_by_the_previous_runs_late_rq_write_is_queued_again(
    redis_server: RedisServer,
) -> None:
    """Found by cut-finish: a worker whose reply to the outcome script was lost retries it, and
    records the failure in RQ only then, after the forwarder harvested it and pushed attempt 2.
    RQ saves the whole job hash, so the hash holds attempt 1's arguments under attempt 2's run:
    the retry's queue entry delivers attempt 1 again, which only reports its failure again. The
    forwarder's next push of attempt 2 must queue it, not count it as already there."""
    transport = RQTransport(redis_server.url)
    try:
        env = Envelope(
            id=new_job_id(),
            func="tests.tasks.add",
            queue="default",
            idempotency_key="k",
            created_at=time.time(),
            args=(1, 2),
        )
        first = Delivery(env, "owner1", ("w", 0, 64), attempt=1)
        retry = Delivery(env, "owner1", ("w", 0, 64), attempt=2, force=True)
        conn = transport.connection
        assert transport.push([first]).pushed == 1
        late = RQJob.fetch(env.id, connection=conn, serializer=JSONSerializer)  # worker A takes attempt 1
        conn.delete("rq:queue:default")
        assert transport.push([retry]).pushed == 1  # its failure harvested: the forwarder pushes attempt 2
        late.set_status(JobStatus.FAILED)  # then worker A records attempt 1's failure, as RQ does
        late.save()

        def attempt_in_redis() -> int:
            job = RQJob.fetch(env.id, connection=conn, serializer=JSONSerializer)
            return int(job.args[0]["attempt"])

        assert attempt_in_redis() == 1  # the hash is attempt 1's again
        assert transport.push([retry]).pushed == 1  # so attempt 2 is queued again
        assert attempt_in_redis() == 2
        assert conn.lrange("rq:queue:default", 0, -1) == [env.id.encode()]
        # Once claimed (the task started), or while queued, attempt 2 is left alone.
        assert transport.push([retry]).pushed == 0
        conn.hset(f"rq:job:{env.id}", mapping={"status": "failed", "hybridq_started": "2"})
        assert transport.push([retry]).pushed == 0
    finally:
        transport.close()


# -- the proxy itself: it injects what it says it does ---------------------------------------------


def test_the_proxy_injects_each_fault(redis_server: RedisServer) -> None:
    assert redis_server.port is not None
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        client = redis.Redis.from_url(proxy.url, socket_timeout=1.0)
        try:
            assert client.ping()
            proxy.latency(0.1, 0.05)
            started = time.monotonic()
            client.ping()
            assert time.monotonic() - started >= 0.15

            # A cut EXEC ran: the client hears nothing, Redis has the write.
            proxy.clear()
            proxy.cut_replies(1, b"exec")
            pipe = client.pipeline(transaction=True)
            pipe.incr("n")
            pipe.incr("n")
            with pytest.raises(redis.ConnectionError):
                pipe.execute()
            assert client.get("n") == b"2"
            assert (proxy.stats.cuts, proxy.cuts_left) == (1, 0)

            # NOSCRIPT (the script did not run) is delivered; the run that follows is cut.
            source = "return redis.call('INCR', KEYS[1])"
            proxy.cut_replies(1, script_call(source))
            with pytest.raises(redis.ConnectionError):
                client.register_script(source)(keys=["s"])
            assert client.get("s") == b"1"

            # Blackhole: the client times out instead of hanging. When the partition heals, the
            # command it gave up on still reaches Redis, as TCP would deliver it.
            proxy.blackhole()
            with pytest.raises(redis.TimeoutError):
                client.incr("late")
            proxy.blackhole(on=False)
            wait_until(lambda: client.get("late") == b"1", timeout=5, what="the late INCR")

            assert proxy.reset() >= 1
            proxy.refuse()
            with pytest.raises(redis.ConnectionError):
                client.ping()
            proxy.clear()
            assert client.ping()
            assert proxy.stats.resets >= 2
        finally:
            client.close()


def test_a_reply_is_complete_only_when_its_last_byte_is_there() -> None:
    """RESP2 and RESP3 replies as Redis sends them: no prefix parses as a whole reply."""
    replies = [
        b"+OK\r\n",
        b"-ERR no\r\n",
        b":42\r\n",
        b"$-1\r\n",
        b"*-1\r\n",
        b"$5\r\nhe\r\no\r\n",
        b"*2\r\n*1\r\n$1\r\na\r\n%1\r\n+k\r\n:1\r\n",
        b"|1\r\n+ttl\r\n:3\r\n$1\r\nv\r\n",
        b"~2\r\n_\r\n,1.5\r\n",
        b">3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$1\r\nm\r\n",
        b"=8\r\ntxt:abcd\r\n",
    ]
    for reply in replies:
        buf = bytearray(reply + b"+NEXT\r\n")
        assert reply_end(buf, 0) == len(reply), reply
        for cut in range(len(reply)):
            assert reply_end(bytearray(reply[:cut]), 0) is None, (reply, cut)
    command = b"*3\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n0\r\n"
    assert parse_command(bytearray(command), 0) == ([b"EVALSHA", b"ab", b"0"], len(command))
    assert all(parse_command(bytearray(command[:cut]), 0) is None for cut in range(len(command)))


def test_a_workers_own_calls_time_out_on_a_blackholed_redis(redis_server: RedisServer) -> None:
    """RQ sets its connection's socket timeout to 415 s; a claim or an outcome must not wait that."""
    from hybridq import worker

    assert redis_server.port is not None
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        rq_connection = redis.Redis.from_url(proxy.url, socket_timeout=415)
        client = worker._client(rq_connection)
        assert client.ping()
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            client.ping()
        assert time.monotonic() - started < worker.CALL_TIMEOUT_S + 3
        proxy.clear()
        client.close()
        rq_connection.close()
