"""Redis Sentinel: a failover to a lagging replica mid-stream loses nothing and re-runs nothing finished.

Every process is real: a master, a replica and three Sentinels (``redis-server --sentinel``, see
tests/support/sentinel.py), ``python -m hybridq forward`` and ``python -m hybridq worker`` (the
pool), both given only the ``redis+sentinel://`` URL. Jobs run ``tests.tasks.traced``, which
appends fsync'd ``start``/``done`` lines to an effects file, so runs are counted without trusting
hybridq.

How the replica is made to lag: it is frozen (SIGSTOP, as a VM pause or a stalled host would)
and the master drops its replication link (``CLIENT KILL TYPE replica``), so the replica holds the
master's state of that moment and nothing after; jobs keep running and being harvested on the
master for :data:`LAG_S`; then the master is SIGKILLed and the replica thawed at once. It is
frozen for less than the Sentinels' ``down-after-milliseconds``, so they still count it healthy
and promote it: the new master brings back queue entries of jobs that finished since, and lacks
their results. The fencing (docs/guarantees.md) must keep those from running again.

Figure line: ``S18 sentinel-failover jobs=N ... lost=0 reran_finished=0`` with the delays.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridq import Queue
from hybridq.testing.embedded import RedisServer

from tests.integration.test_worker_pool import pool
from tests.integration.test_worker_redis import (
    Line,
    Stack,
    alive,
    all_succeeded,
    ledger_succeeded_ids,
    read_effects,
    stack,
    wait_line,
    wait_status,
)
from tests.support.processes import wait_until
from tests.support.sentinel import SentinelTopology

__all__ = ["stack"]  # the fixture, used by this module's tests

#: Seconds the master runs on while the replica no longer follows it (below down-after-milliseconds).
LAG_S = 1.0
#: Jobs enqueued at once just before the replica stops following: the master holds them queued
#: at that moment, so the replica brings back entries of jobs that finish during the lag.
BURST = 60
#: Seconds each job of the burst takes: the pool must not have run half of it before it is seen queued.
BURST_JOB_S = 0.03
#: Jobs running across the failover (seconds each): their lease is renewed through it.
LONG, LONG_S = 2, 5.0
#: The forwarder's --lease (hybridq's default).
LEASE_S = 10.0


class Producer:
    """Enqueues ``tests.tasks.traced`` jobs at a steady pace on a thread until stopped."""

    def __init__(self, queue: Queue, effects: Path, per_s: float = 25.0) -> None:
        self.queue, self.effects, self.period = queue, effects, 1.0 / per_s
        self.tokens: list[str] = []
        #: Job id -> token, of every accepted job.
        self.token_of: dict[str, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.enqueue(1)
            time.sleep(self.period)

    def enqueue(self, n: int, *, prefix: str = "j", sleep_s: float = 0.0) -> list[str]:
        with self._lock:
            tokens = [f"{prefix}{len(self.tokens) + i}" for i in range(n)]
            args = [(str(self.effects), t, sleep_s) for t in tokens]
            jobs = self.queue.enqueue_many([self.queue.prepare("tests.tasks.traced", a) for a in args])
            self.tokens.extend(tokens)
            self.token_of.update((job.id, t) for job, t in zip(jobs, tokens, strict=True))
        return tokens

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@dataclass
class Failover:
    """One failover of :func:`fail_over`: what was finished at the kill, and when things happened."""

    killed_at: float  # wall clock, as the effects file's
    finished: set[str]  # job ids the ledger held as succeeded when the master died
    promoted_s: float
    stale: int  # of those, how many the promoted replica still held queued or taken


def fail_over(
    topo: SentinelTopology, producer: Producer, journal: Path, old: RedisServer, new: RedisServer
) -> Failover:
    """A burst queued on ``old``; ``new`` made to lag it; ``old`` SIGKILLed; ``new`` promoted by the Sentinels."""
    producer.enqueue(BURST, sleep_s=BURST_JOB_S)
    wait_until(lambda: _queued(old) >= BURST // 2, timeout=30, interval=0.01, what="the burst queued")
    # The lag: the replica stops following (frozen, its link dropped by the master).
    new.pause()
    with contextlib.closing(old.client()) as client:
        client.execute_command("CLIENT", "KILL", "TYPE", "replica")
    time.sleep(LAG_S)
    killed_at = time.time()
    old.kill()
    new.resume()
    finished = ledger_succeeded_ids(journal)  # nothing more can be harvested from the dead master
    killed_mono = time.monotonic()
    promoted_s = topo.wait_promoted(new) - killed_mono
    # What the promoted replica brought back: queue entries of jobs the ledger holds as finished.
    return Failover(killed_at, finished, promoted_s, _stale(new, finished))


def delays(
    lines: list[Line], failover: Failover, ignore: frozenset[str] = frozenset()
) -> tuple[float, float]:
    """(kill to the first ``done`` of a run started after the promotion, the stall around it).

    The stall: from the last ``done`` before that one to it (the pool had taken some jobs from
    Redis before the kill, and runs them meanwhile). Jobs in ``ignore`` (running across the
    failover) are left out of it.
    """
    promoted_at = failover.killed_at + failover.promoted_s
    first = min(x.at for x in lines if x.kind == "done" and _started(lines, x) > promoted_at)
    before = [x.at for x in lines if x.kind == "done" and x.at < first and x.token not in ignore]
    return first - failover.killed_at, first - max(before)


def test_s18_sentinel_failover_to_a_lagging_replica_loses_nothing_and_reruns_nothing_finished(
    sentinel_topology: SentinelTopology,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    topo = sentinel_topology
    effects = tmp_path / "effects.txt"
    # The default lease (10 s), longer than the failover's stall: a job running across the
    # failover keeps it, and runs once (with a lease shorter than the stall it may run twice:
    # docs/guarantees.md, "Redis down or hung").
    forwarder = stack.forwarder(topo.url, "--lease", str(LEASE_S))
    worker = pool(stack, topo.url, "--processes", "1", "--threads", "4")
    producer = Producer(Queue("default", journal_dir), effects)
    try:
        wait_until(lambda: len(ledger_succeeded_ids(journal_dir)) >= 30, timeout=60, what="30 jobs harvested")
        # Jobs still running when the master dies: their lease renewals and outcomes cross the failover.
        long = producer.enqueue(LONG, prefix="long", sleep_s=LONG_S)
        for token in long:
            wait_line(effects, "start", token, timeout=30)
        failover = fail_over(topo, producer, journal_dir, topo.master, topo.replica)
        time.sleep(2.0)  # jobs keep coming after the failover
    finally:
        producer.stop()
    stopped_at = time.monotonic()
    n = len(producer.tokens)
    status = wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(n),
        what=f"all {n} jobs",
        timeout=120,
        alive=alive(forwarder, worker),
    )
    assert status["failed"] == 0
    # Where the time goes after the failover (31 s once in a loaded run of the suite, 9.5-14.4 s
    # alone even at load average 8-10): the drain to all succeeded, then the pool's exit.
    settle_s = time.monotonic() - stopped_at

    lines = read_effects(effects)
    starts = collections.Counter(x.token for x in lines if x.kind == "start")
    done = {x.token for x in lines if x.kind == "done"}
    lost = [t for t in producer.tokens if t not in done]
    reran_finished = ran_after(lines, failover, producer.token_of)
    reruns = sum(c - 1 for c in starts.values())  # finished on the dead master, never harvested
    first_job_s, stall_s = delays(lines, failover, frozenset(long))
    fenced, purged = fencing(worker.log(), forwarder.log())
    figures(
        f"S18 sentinel-failover jobs={n} harvested_at_kill={len(failover.finished)} "
        f"stale_entries={failover.stale} fenced={fenced} purged={purged} promoted_s={failover.promoted_s:.2f} "
        f"first_job_s={first_job_s:.2f} stall_s={stall_s:.2f} long_runs={sum(starts[t] for t in long)}/{LONG} "
        f"lost={len(lost)} reran_finished={len(reran_finished)} reruns_unharvested={reruns} settle_s={settle_s:.1f}"
    )
    assert not lost, f"{len(lost)} accepted jobs never ran, e.g. {lost[:5]}"
    assert all(x.at > failover.killed_at for x in lines if x.kind == "done" and x.token in long), (
        "ran across it"
    )
    # The pool's supervisor subscribed again (RQ's pub/sub commands) on the new master: it obeys.
    with contextlib.closing(topo.replica.client()) as client:
        channels = wait_until(lambda: client.pubsub_channels("rq:pubsub:*"), what="the pool subscribed again")
        for channel in channels:
            client.publish(channel, json.dumps({"command": "shutdown"}))
    shutdown_at = time.monotonic()
    assert worker.proc.wait(30) == 0
    figures(f"S18 sentinel-failover pool_exit_s={time.monotonic() - shutdown_at:.1f}")
    assert "RQ shutdown command received" in worker.log()
    assert not reran_finished, f"finished jobs ran again: {reran_finished[:5]}"
    assert failover.stale > 0, "the replica did not lag: nothing finished was queued on it"


def ran_after(lines: list[Line], failover: Failover, token_of: dict[str, str]) -> list[str]:
    """Jobs the ledger held as finished when the master died that started a run after that."""
    finished = {token_of[job_id] for job_id in failover.finished}
    return sorted(
        {x.token for x in lines if x.kind == "start" and x.token in finished and x.at > failover.killed_at}
    )


def fencing(worker_log: str, forwarder_log: str) -> tuple[int, int]:
    """The fencing at work: (deliveries workers refused, queued copies the refill deleted)."""
    fenced = worker_log.count("delivery from before the forwarder's current epoch")
    purged = sum(int(m) for m in re.findall(r"refill: deleted (\d+) queued copies", forwarder_log))
    return fenced, purged


def _queued(server: RedisServer) -> int:
    with contextlib.closing(server.client()) as client:
        reserved = client.llen("rq:queue:default:intermediate")  # a pool's, not yet started
        return int(client.llen("rq:queue:default")) + int(reserved) + int(client.zcard("rq:wip:default"))


def _stale(server: RedisServer, finished: set[str]) -> int:
    """Jobs of ``finished`` ``server`` holds queued (or taken by a worker)."""
    with contextlib.closing(server.client()) as client:
        held = {e.decode() for e in client.lrange("rq:queue:default", 0, -1)}
        held |= {e.decode() for e in client.lrange("rq:queue:default:intermediate", 0, -1)}
        held |= {e.decode() for e in client.zrange("rq:wip:default", 0, -1)}
    return len(held & finished)


def _started(lines: list[Line], done: Line) -> float:
    """When the run that wrote ``done`` started (its token's last start before it)."""
    return max(x.at for x in lines if x.kind == "start" and x.token == done.token and x.at <= done.at)
