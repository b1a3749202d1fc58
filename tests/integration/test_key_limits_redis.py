"""Per-key limits end to end: ``hybridq forward --limit``, ``hybridq worker`` pools, a private Redis.

Each task appends ``start``/``done`` lines (token, attempt, pid, time) to an effects file: what
ran at once is counted from the tasks themselves, not from hybridq's view. The cheap test runs
in the default run; the faults (a pool SIGKILLed mid-run, a ``FLUSHALL``) and the minute-long
rate run are the ``limits`` tier (``scripts/test -m limits tests/integration/test_key_limits_redis.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq import Queue, cancel
from hybridq.protocol import keys
from hybridq.testing.embedded import RedisServer

from tests.integration.test_worker_pool import pool
from tests.integration.test_worker_redis import (
    Line,
    Stack,
    alive,
    all_succeeded,
    queue_length,
    read_effects,
    redis_client,
    stack,
    wait_line,
    wait_status,
)
from tests.support.processes import run_status, wait_until

__all__ = ["stack"]  # the fixture, used by this module's tests


def runs_of(
    lines: list[Line], prefix: str, *, killed: dict[int, float], now: float
) -> list[tuple[float, float]]:
    """Each run of a task whose token starts with ``prefix``: (start, end), from its own lines.

    A start ends at the next ``done`` line of its (token, attempt, pid) after it: a job whose
    outcome a FLUSHALL raced runs again, same attempt, often in the same process (a run ended by
    the last ``done`` instead would span everything between the two). A run with no ``done``
    line after it ended when its process was killed (``killed``: pid -> when), or is taken as
    running until ``now``.
    """
    # One process never runs one token's attempt twice at once (a claim is made again only before
    # its task starts), so the next ``done`` of the same key after a start is that run's end.
    next_done: dict[tuple[str, int, int], float] = {}
    out = []
    for x in reversed(lines):  # (the file is in the order the tasks wrote it)
        key = (x.token, x.attempt, x.pid)
        if x.kind == "done":
            next_done[key] = x.at
        elif x.kind == "start" and x.token.startswith(prefix):
            out.append((x.at, next_done.get(key, killed.get(x.pid, now))))
    out.reverse()
    return out


def most_at_once(runs: list[tuple[float, float]]) -> int:
    """The most runs under way at any one moment (each start is a moment the count can peak)."""
    return max((sum(1 for s, e in runs if s <= at < e) for at, _ in runs), default=0)


def most_started_within(starts: list[float], window_s: float) -> int:
    """The most starts in any half-open window of ``window_s`` (each start opens one)."""
    starts = sorted(starts)
    best, j = 0, 0
    for i, s in enumerate(starts):
        while starts[j] <= s - window_s:
            j += 1
        best = max(best, i - j + 1)
    return best


def test_a_concurrency_2_key_runs_2_at_once_and_does_not_hold_up_another_key(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    forwarder = stack.forwarder(redis_server.url, "--limit", "tenant:*=concurrency:2")
    worker = pool(stack, redis_server.url, "--processes", "1", "--threads", "8")
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    for i in range(6):
        queue.enqueue("tests.tasks.traced", str(effects), f"lim-{i}", 0.25, limit_key="tenant:1")
    for i in range(3):
        queue.enqueue("tests.tasks.traced", str(effects), f"free-{i}", 0.0, limit_key="other")
    wait_status(journal_dir, subprocess_env, all_succeeded(9), what="9 jobs", alive=alive(forwarder, worker))
    lines = read_effects(effects)
    runs = runs_of(lines, "lim-", killed={}, now=time.time())
    assert len(runs) == 6
    assert most_at_once(runs) == 2, "the key ran at its limit, never over it"
    free_done = max(x.at for x in lines if x.kind == "done" and x.token.startswith("free-"))
    lim_done = max(x.at for x in lines if x.kind == "done" and x.token.startswith("lim-"))
    assert free_done < lim_done - 0.25, "the unlimited jobs behind the limited ones did not wait for them"
    shown = run_status(journal_dir, subprocess_env)["limit_keys"]  # stats() per limit key
    assert shown["tenant:1"]["policy"] == "concurrency:2"
    assert shown["tenant:1"]["waiting"] == 0


@pytest.mark.limits
def test_a_job_refused_at_claim_starts_a_step_after_its_key_has_room_and_the_count_stays_exact(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    # The key's queued count expires two leases (2 s each) after the forwarder's last add while
    # no worker runs, so the gate pushes the second job too, and the pool's claim refuses one.
    forwarder = stack.forwarder(redis_server.url, "--limit", "k=concurrency:1")
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    for name in ("a", "b"):
        queue.enqueue("tests.tasks.traced", str(effects), name, 0.3, limit_key="k")
    with redis_client(redis_server) as conn:
        # (a's +1 expired with the count while no worker ran: the count's backstop; b's is in)
        wait_until(
            lambda: queue_length(redis_server) == 2 and conn.get("hybridq:limit:k:queued") == b"1",
            timeout=20,
            what="both jobs in Redis, b counted",
        )
    worker = pool(stack, redis_server.url, "--processes", "1", "--threads", "4")
    wait_status(journal_dir, subprocess_env, all_succeeded(2), what="2 jobs", alive=alive(forwarder, worker))
    lines = read_effects(effects)
    runs = sorted(runs_of(lines, "", killed={}, now=time.time()))
    assert len(runs) == 2, "each job ran once"
    assert "(limited: concurrency" in worker.log(), "the second job was refused at its claim"
    # Before: the refused job came back through the stranded path, two leases (4 s) and more later.
    delay = runs[1][0] - runs[0][1]
    figures(f"LIMITS refused-at-claim concurrency:1 lease=2s started_after_room_s={delay:.2f}")
    assert delay < 1.5, f"the refused job started {delay:.2f} s after its key had room"
    with redis_client(redis_server) as conn:
        # Each of the two copies left its queue once (-2); b's second push was counted (+1) and
        # its claim took it off (-1). (Before, b's redelivery was not counted, but the count had
        # expired by then, as it went below zero: the scripts' tests show that drift.)
        assert int(conn.get("hybridq:limit:k:queued") or 0) == 1 - 2


def queued_count(server: RedisServer, key: str) -> int | None:
    """The key's queued count in Redis (``None``: no such key)."""
    with redis_client(server) as conn:
        raw = conn.get(f"hybridq:limit:{key}:queued")
    return None if raw is None else int(raw)


@pytest.mark.limits
def test_a_cancelled_queued_job_leaves_its_keys_queued_count(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, subprocess_env: dict[str, str]
) -> None:
    # A 5 s lease: the count expires 10 s after the forwarder's last add (or a take below zero),
    # long after what is checked here.
    forwarder = stack.forwarder(redis_server.url, "--lease", "5", "--limit", "k=concurrency:5")
    queue = Queue("default", journal_dir)
    job = queue.enqueue("tests.tasks.traced", "/dev/null", "c", 0.0, limit_key="k")
    wait_until(lambda: queued_count(redis_server, "k") == 1, timeout=20, what="the job pushed and counted")
    cancel([job.id], journal_dir)
    wait_until(lambda: job.status == "cancelled", timeout=20, what="the job cancelled")
    assert queue_length(redis_server) == 0
    forwarder.assert_alive()
    assert queued_count(redis_server, "k") == 0  # before: 1, until the count expired


@pytest.mark.limits
def test_after_a_flushall_the_refilled_jobs_are_counted_on_their_keys_queued_count(
    redis_server: RedisServer, stack: Stack, journal_dir: Path
) -> None:
    stack.forwarder(redis_server.url, "--lease", "5", "--limit", "k=concurrency:5")
    queue = Queue("default", journal_dir)
    for i in range(3):
        queue.enqueue("tests.tasks.traced", "/dev/null", f"f-{i}", 0.0, limit_key="k")
    wait_until(lambda: queued_count(redis_server, "k") == 3, timeout=20, what="3 jobs pushed and counted")
    with redis_client(redis_server) as conn:
        conn.flushall()
    wait_until(lambda: queue_length(redis_server) == 3, timeout=20, what="the refill")
    # Before: not counted (the count stayed gone, and the claims took it below zero).
    wait_until(lambda: queued_count(redis_server, "k") == 3, timeout=5, what="the refilled jobs counted")


@pytest.mark.limits
def test_the_next_attempt_of_a_job_whose_worker_was_killed_is_counted_on_its_keys_queued_count(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    forwarder = stack.forwarder(redis_server.url, "--limit", "k=concurrency:1")
    doomed = pool(stack, redis_server.url, "--processes", "1", "--threads", "2")
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    queue.enqueue("tests.tasks.traced", str(effects), "o", 2.0, limit_key="k")
    wait_line(effects, "start", "o", timeout=30)
    doomed.kill()
    survivor = pool(stack, redis_server.url, "--processes", "1", "--threads", "2")
    wait_status(
        journal_dir, subprocess_env, all_succeeded(1), what="the job", alive=alive(forwarder, survivor)
    )
    # Pushed (+1), claimed (-1), its next attempt pushed (+1) and claimed (-1). Before: -1, the
    # next attempt was not counted.
    assert queued_count(redis_server, "k") in (0, None)


@pytest.mark.limits
def test_a_concurrency_2_key_never_runs_3_across_a_pool_killed_and_a_flushall(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    forwarder = stack.forwarder(redis_server.url, "--limit", "tenant:*=concurrency:2")
    doomed = pool(stack, redis_server.url, "--processes", "1", "--threads", "4")
    survivor = pool(stack, redis_server.url, "--processes", "1", "--threads", "4")
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    n = 16
    for i in range(n):
        queue.enqueue("tests.tasks.traced", str(effects), f"lim-{i}", 1.0, limit_key="tenant:1")
    for i in range(4):
        queue.enqueue("tests.tasks.traced", str(effects), f"free-{i}", 0.0)
    for i in range(4):
        wait_line(effects, "done", f"free-{i}", timeout=30)
    # SIGKILL the pool running a limited job: its slot frees when its lease lapses, not before.
    victims = set(wait_until(doomed.children, what="the pool's process"))
    wait_until(
        lambda: any(
            x.kind == "start" and x.pid in victims and x.token.startswith("lim-")
            for x in read_effects(effects)
        ),
        timeout=60,
        what="a limited job on the doomed pool",
    )
    killed_at = time.time()
    doomed.kill()
    replacement = pool(stack, redis_server.url, "--processes", "1", "--threads", "4")
    wait_until(
        lambda: sum(x.kind == "done" for x in read_effects(effects)) >= 4 + 6, timeout=60, what="6 done"
    )
    with redis_client(redis_server) as conn:
        conn.flushall()
    wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(n + 4),
        what=f"{n + 4} jobs",
        timeout=180,
        alive=alive(forwarder, survivor, replacement),
    )
    runs = runs_of(read_effects(effects), "lim-", killed=dict.fromkeys(victims, killed_at), now=time.time())
    assert len(runs) >= n
    assert most_at_once(runs) <= 2, f"{most_at_once(runs)} runs of a concurrency:2 key at once"
    refused = sum(w.log().count("(limited: ") for w in (doomed, survivor, replacement))
    figures(
        f"LIMITS concurrency:2 kill+flushall jobs={n} runs={len(runs)} most_at_once={most_at_once(runs)} refused_claims={refused}"
    )


@pytest.mark.limits
def test_two_forwarders_on_one_redis_share_a_keys_limit(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    other = tmp_path / "other-journal"
    forwarders = [
        stack.forwarder(redis_server.url, "--limit", "shared=concurrency:2"),
        stack.forwarder(redis_server.url, "--limit", "shared=concurrency:2", journal=other),
    ]
    worker = pool(stack, redis_server.url, "--processes", "1", "--threads", "8")
    effects = tmp_path / "effects.txt"
    for journal, name in ((journal_dir, "a"), (other, "b")):
        queue = Queue("default", journal)
        for i in range(6):
            queue.enqueue("tests.tasks.traced", str(effects), f"lim-{name}{i}", 0.5, limit_key="shared")
    for journal in (journal_dir, other):
        wait_status(
            journal, subprocess_env, all_succeeded(6), what="6 jobs", alive=alive(*forwarders, worker)
        )
    runs = runs_of(read_effects(effects), "lim-", killed={}, now=time.time())
    assert len(runs) == 12
    assert most_at_once(runs) == 2, (
        f"{most_at_once(runs)} runs of a concurrency:2 key at once, two forwarders"
    )
    refused = worker.log().count("(limited: ")
    figures(
        f"LIMITS two-forwarders concurrency:2 jobs=12 most_at_once={most_at_once(runs)} refused_claims={refused}"
    )


class ClaimLog:
    """Samples a rate key's ``starts`` log (the claims' admissions, in Redis's clock) in a thread.

    The log keeps a period of starts, so a sample every 0.2 s sees each one (its member is the
    claim's token, unique per claim).
    """

    def __init__(self, server: RedisServer, key: str) -> None:
        self.claims: dict[bytes, float] = {}
        self._name = f"{keys.LIMIT_PREFIX}{key}:starts"
        self._server, self._stop = server, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        with redis_client(self._server) as client:
            while not self._stop.is_set():
                for member, ms in client.zrange(self._name, 0, -1, withscores=True):
                    self.claims[member] = ms / 1000
                self._stop.wait(0.2)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(timeout=10)
        return list(self.claims.values())


@pytest.mark.limits
def test_a_rate_50_per_second_key_starts_at_most_50_in_any_second_over_a_minute(
    redis_server: RedisServer,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    """A start is the claim Redis admits (docs/forwarder.md, "Limits per key"): at most 50 in any
    second of Redis's clock. The tasks' own clocks see a start when their thread gets to run, which
    on a loaded machine (another process's burst on 2 cores) may come a second late: bunched, 67
    of them fell in one second once while the claims stayed at 50. So the tasks' starts are held
    to twice the rate in any second, and to the rate over the minute."""
    claim_log = ClaimLog(redis_server, "api")
    forwarder = stack.forwarder(redis_server.url, "--limit", "api=rate:50/s")
    worker = pool(stack, redis_server.url, "--processes", "2", "--threads", "16")
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    n = 3100  # a minute at the rate, and some
    queue.enqueue_many(
        [queue.prepare("tests.tasks.traced", (str(effects), f"r-{i}"), limit_key="api") for i in range(n)]
    )
    try:
        wait_status(
            journal_dir,
            subprocess_env,
            all_succeeded(n),
            what=f"{n} jobs",
            timeout=240,
            alive=alive(forwarder, worker),
        )
    finally:
        claims = claim_log.stop()
    assert len(claims) >= n, f"{len(claims)} claims sampled of {n}"
    most_claims = most_started_within(claims, 1.0)
    assert most_claims <= 50, f"{most_claims} claims admitted in one second of a rate:50/s key"
    starts = [x.at for x in read_effects(effects) if x.kind == "start"]
    assert len(starts) >= n
    most = most_started_within(starts, 1.0)
    assert most <= 2 * 50, f"{most} tasks started in one second of their own clocks"
    took = max(starts) - min(starts)
    assert took >= (n - 50) / 50 - 1, f"{n} starts at 50 a second took {took:.1f} s"
    figures(
        f"LIMITS rate:50/s jobs={n} most_claims_in_any_1s={most_claims} most_task_starts_in_any_1s={most}"
        f" took_s={took:.1f} ({n / took:.1f}/s)"
    )


@pytest.mark.limits
def test_single_job_workers_enforce_the_limit_too(
    redis_server: RedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    forwarder = stack.forwarder(redis_server.url, "--limit", "one=concurrency:1")
    workers = [stack.worker(redis_server.url, simple=True) for _ in range(3)]
    effects, queue = tmp_path / "effects.txt", Queue("default", journal_dir)
    for i in range(5):
        queue.enqueue("tests.tasks.traced", str(effects), f"lim-{i}", 0.3, limit_key="one")
    wait_status(
        journal_dir, subprocess_env, all_succeeded(5), what="5 jobs", alive=alive(forwarder, *workers)
    )
    runs = runs_of(read_effects(effects), "lim-", killed={}, now=time.time())
    assert len(runs) == 5
    assert most_at_once(runs) == 1
