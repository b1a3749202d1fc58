"""The ``hybridq forward`` process against a private redis-server: outages, kills, signals, workers.

Every forwarder here is the real CLI in a child process (``python -m hybridq forward``); counts
come from ``hybridq status --json`` and from Redis itself (``LRANGE rq:queue:default``). Each
scenario reports one figure line (docs/reliability.md S8, S12, F2). No assertion depends on timing
except the documented "SIGTERM exits within 5 s"; latencies are measured and reported only.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.journal.format import FILE_HEADER_SIZE, RECORD_HEADER_SIZE
from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer
from hybridq.testing.rq_cli import RQ

from tests.support.processes import ForwarderProcess, run_status, wait_for_status, wait_until
from tests.support.tiers import skip_unless_asked

QUEUE_KEY = "rq:queue:default"

StartForwarder = Callable[..., ForwarderProcess]

#: A producer process: ten jobs, then a normal exit (which seals its segment).
PRODUCE_10 = (
    "import sys; from hybridq import Queue; q = Queue('default', sys.argv[1]);"
    " [q.enqueue('tests.tasks.add', i, i) for i in range(10)]"
)


# -- fixtures and helpers ---------------------------------------------------------------------

#: A window no test here fills: the forwarder pushes every job as it reads it (as before issue 29).
WIDE_WINDOW = ("--window-min", "1000000", "--window-max", "1000000")


@pytest.fixture
def start_forwarder(
    tmp_path: Path, journal_dir: Path, subprocess_env: dict[str, str]
) -> Iterator[StartForwarder]:
    """Start ``hybridq forward`` children on ``journal_dir``; any still running are killed at teardown."""
    started: list[ForwarderProcess] = []

    def start(redis_url: str, *extra_args: str) -> ForwarderProcess:
        ensure_journal_dir(journal_dir)  # what the first Queue(...) does; forward needs it to exist
        proc = ForwarderProcess(
            journal_dir,
            redis_url,
            env=subprocess_env,
            log_path=tmp_path / f"forwarder-{len(started)}.log",
            # These tests check the push path itself with no worker running: every accepted job
            # must reach Redis, so the window (docs/forwarder.md) is opened wide. The window's
            # own faults are tests/integration/test_backlog_window.py's.
            extra_args=(*WIDE_WINDOW, *extra_args),
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def queued(server: RedisServer, key: str = QUEUE_KEY) -> list[str]:
    """Every id on an RQ queue list, in order (a fresh client, closed again)."""
    with contextlib.closing(server.client(socket_timeout=30)) as client:
        return [raw.decode() for raw in client.lrange(key, 0, -1)]


def queue_length(server: RedisServer) -> int:
    with contextlib.closing(server.client(socket_timeout=30)) as client:
        return int(client.llen(QUEUE_KEY))


def job_hashes_present(server: RedisServer, ids: list[str]) -> int:
    """How many of ``ids`` have their RQ job hash ``rq:job:<id>``."""
    with contextlib.closing(server.client(socket_timeout=30)) as client:
        pipe = client.pipeline(transaction=False)
        for job_id in ids:
            pipe.exists(f"rq:job:{job_id}")
        return sum(pipe.execute())


def check_exactly_once(server: RedisServer, ids: list[str]) -> int:
    """Assert that the queue holds exactly ``ids``, each once; return how many were queued twice."""
    listed = queued(server)
    counts = collections.Counter(listed)
    twice = sorted(i for i, n in counts.items() if n > 1)
    missing = sorted(set(ids) - set(counts))
    extra = sorted(set(counts) - set(ids))
    assert not missing, f"{len(missing)} accepted jobs never reached Redis, e.g. {missing[:5]}"
    assert not twice, f"{len(twice)} jobs queued more than once, e.g. {twice[:5]}"
    assert not extra, f"{len(extra)} unknown ids in the queue, e.g. {extra[:5]}"
    assert len(listed) == len(ids)
    assert job_hashes_present(server, ids) == len(ids)
    return len(twice)


def wait_for_all(
    server: RedisServer, n: int, forwarder: ForwarderProcess | None = None, timeout: float = 60.0
) -> None:
    """Wait until the queue holds at least ``n`` ids (the forwarder must stay alive meanwhile)."""

    def arrived() -> bool:
        if forwarder is not None:
            forwarder.assert_alive()
        return queue_length(server) >= n

    wait_until(arrived, timeout=timeout, interval=0.1, what=f"{n} jobs in {QUEUE_KEY}")


def wait_forwarding(forwarder: ForwarderProcess, timeout: float = 30.0) -> None:
    """Wait until the forwarder has opened the journal and entered its loop."""

    def ready() -> bool:
        forwarder.assert_alive()
        return "forwarding to " in forwarder.log()

    wait_until(ready, timeout=timeout, what=f"forwarder pid {forwarder.pid} to start")


def wait_caught_up(
    journal: Path, env: dict[str, str], forwarder: ForwarderProcess, timeout: float = 60.0
) -> dict[str, Any]:
    """Wait until ``status`` shows nothing left to forward; return that status."""

    return wait_for_status(
        journal,
        env,
        lambda status: status["not_yet_forwarded"] == 0,
        what="the checkpoint to cover every job",
        timeout=timeout,
        alive=forwarder.assert_alive,
    )


def enqueue(queue: Queue, n: int) -> list[str]:
    return [queue.enqueue("tests.tasks.add", i, 1).id for i in range(n)]


# -- Redis down before and while jobs are enqueued ----------------------------------------------


def test_jobs_enqueued_while_redis_is_down_arrive_once_it_is_up(
    make_redis_server: Callable[..., RedisServer],
    start_forwarder: StartForwarder,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    server = make_redis_server(start=False)  # its port is chosen, nothing listens on it yet
    redis_url = server.url
    forwarder = start_forwarder(redis_url)
    wait_forwarding(forwarder)
    queue = Queue("default", journal_dir)
    ids = enqueue(queue, 1000)  # every enqueue returned with Redis down
    wait_until(
        lambda: "transport unavailable" in forwarder.log(), what="the forwarder to notice Redis is down"
    )
    time.sleep(2.0)  # let it retry a few times: the log must still say it only once
    forwarder.assert_alive()
    assert run_status(journal_dir, subprocess_env)["forwarded"] == 0

    server.start()
    assert server.url == redis_url, "redis-server moved to another port"
    wait_for_all(server, 1000, forwarder)
    queued_twice = check_exactly_once(server, ids)
    status = wait_caught_up(journal_dir, subprocess_env, forwarder)
    assert status["accepted"] == 1000
    assert status["forwarded"] == 1000
    rc, _ = forwarder.terminate()
    assert rc == 0
    log = forwarder.log()
    down, up = log.count("transport unavailable"), log.count("available again")
    assert (down, up) == (1, 1), log
    figures(
        f"S12 redis-down-at-enqueue accepted={status['accepted']} forwarded={status['forwarded']} "
        f"lost=0 queued_twice={queued_twice} down_logs={down} up_logs={up}"
    )


# -- S8: the forwarder SIGKILLed at random ------------------------------------------------------


class Producer(threading.Thread):
    """Enqueues small bursts continuously until stopped; keeps every acknowledged id."""

    def __init__(self, journal: Path, seed: int) -> None:
        super().__init__(name="producer", daemon=True)
        self.queue = Queue("default", journal)
        self.rng = random.Random(seed)
        self.ids: list[str] = []
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                burst = self.rng.randint(1, 25)
                if burst > 20:
                    envs = [self.queue.prepare("tests.tasks.add", (i, 2)) for i in range(burst * 4)]
                    self.ids.extend(job.id for job in self.queue.enqueue_many(envs))
                else:
                    self.ids.extend(self.queue.enqueue("tests.tasks.add", i, 2).id for i in range(burst))
                self.halt.wait(self.rng.uniform(0.0, 0.03))
        except BaseException as exc:
            self.error = exc

    def finish(self) -> list[str]:
        self.halt.set()
        self.join(timeout=30)
        assert not self.is_alive(), "the producer thread did not stop"
        if self.error is not None:
            raise self.error
        return self.ids


@pytest.mark.parametrize("cycles", [10, pytest.param(16, marks=pytest.mark.slow)])
def test_s8_forwarder_killed_at_random_loses_nothing_and_queues_nothing_twice(
    redis_server: RedisServer,
    start_forwarder: StartForwarder,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
    request: pytest.FixtureRequest,
    cycles: int,
) -> None:
    """10 kills in the default run (about 1 s each); the slow tier's 16 (``-m slow``)."""
    skip_unless_asked(request, "pytest -m slow tests/integration/test_forwarder_redis.py -k s8")
    seed = int(os.environ.get("HYBRIDQ_S8_SEED", random.SystemRandom().randrange(1 << 32)))
    print(f"S8 seed={seed} (rerun with HYBRIDQ_S8_SEED={seed})")
    rng = random.Random(seed)
    producer = Producer(journal_dir, seed + 1)
    producer.start()
    productive = 0
    try:
        for cycle in range(cycles):
            before = queue_length(redis_server)
            forwarder = start_forwarder(redis_server.url, "--batch-size", str(rng.choice([1, 7, 50, 500])))
            if cycle % 4 == 3:
                # Every fourth kill waits for the loop first: on a loaded machine (or with no
                # bytecode cached) Python's start can outlast every random delay, and then no
                # kill lands while it pushes and the test proves nothing.
                wait_forwarding(forwarder)
            # Python starts in about half a second here: some kills land during start-up and
            # recovery, most while it pushes batches and saves checkpoints.
            time.sleep(rng.uniform(0.2, 1.2))
            assert forwarder.alive, forwarder.log()
            forwarder.kill()
            productive += queue_length(redis_server) > before
            time.sleep(rng.uniform(0.0, 0.3))  # jobs pile up with no forwarder
    finally:
        ids = producer.finish()
    assert productive >= 1, "no forwarder lived long enough to push anything: the test proved nothing"

    final = start_forwarder(redis_server.url)
    status = wait_caught_up(journal_dir, subprocess_env, final)
    assert status["accepted"] == len(ids)
    queued_twice = check_exactly_once(redis_server, ids)
    rc, _ = final.terminate()
    assert rc == 0
    status = run_status(journal_dir, subprocess_env)
    figures(
        f"S8 forwarder-kill seed={seed} cycles={cycles} productive_kills={productive} "
        f"accepted={status['accepted']} lost=0 dup_delivery={status['duplicate_pushes']} "
        f"queued_twice={queued_twice}"
    )


# -- S12: Redis paused, hung, unreachable -------------------------------------------------------


def test_s12_client_pause(
    redis_server: RedisServer,
    start_forwarder: StartForwarder,
    journal_dir: Path,
    figures: Callable[[str], None],
) -> None:
    forwarder = start_forwarder(redis_server.url)
    queue = Queue("default", journal_dir)
    ids = enqueue(queue, 50)
    wait_for_all(redis_server, 50, forwarder)

    redis_server.client_pause(3.0)
    paused_at = time.monotonic()
    while time.monotonic() - paused_at < 2.0:  # enqueue all through the pause
        ids += enqueue(queue, 20)
        forwarder.assert_alive()
        time.sleep(0.1)
    wait_for_all(redis_server, len(ids), forwarder)
    arrived_after = time.monotonic() - paused_at
    check_exactly_once(redis_server, ids)
    forwarder.assert_alive()
    figures(
        f"S12 client-pause pause_s=3 accepted={len(ids)} lost=0 queued_twice=0 "
        f"all_arrived_after_s={arrived_after:.1f}"
    )


def test_s12_redis_sigstopped(
    redis_server: RedisServer,
    start_forwarder: StartForwarder,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    forwarder = start_forwarder(redis_server.url)
    queue = Queue("default", journal_dir)
    ids = enqueue(queue, 50)
    wait_for_all(redis_server, 50, forwarder)

    redis_server.pause()
    stopped_at = time.monotonic()
    try:
        while time.monotonic() - stopped_at < 5.0:  # jobs keep coming while Redis is frozen
            ids += enqueue(queue, 20)
            forwarder.assert_alive()
            time.sleep(0.25)
    finally:
        redis_server.resume()
    resumed_at = time.monotonic()
    wait_for_all(redis_server, len(ids), forwarder)  # nobody tells the forwarder: it resumes itself
    caught_up = time.monotonic() - resumed_at
    check_exactly_once(redis_server, ids)
    forwarder.assert_alive()
    status = wait_caught_up(journal_dir, subprocess_env, forwarder)
    assert status["accepted"] == len(ids)
    figures(
        f"S12 sigstop stop_s=5 accepted={len(ids)} lost=0 queued_twice=0 "
        f"dup_delivery={status['duplicate_pushes']} caught_up_after_resume_s={caught_up:.1f}"
    )


#: Seconds S12's Redis stays down: the forwarder's backoff (50 ms doubling to 5 s, each wait drawn
#: from half to all of it: docs/forwarder.md) is at its ceiling after at most 6.35 s of waits, and
#: 17 s hold at least two retries at it (one line logged for them all). 30 s (more retries at the
#: same ceiling, proving nothing more) cost 13 s more of the default run.
OUTAGE_S = 17.0


def test_s12_redis_unreachable_for_17_seconds(
    make_redis_server: Callable[..., RedisServer],
    start_forwarder: StartForwarder,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    # Persistence on: this is Redis *unreachable* (S12); Redis restarted empty is S10.
    server = make_redis_server(extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    forwarder = start_forwarder(server.url)
    queue = Queue("default", journal_dir)
    ids = enqueue(queue, 100)
    wait_for_all(server, 100, forwarder)

    server.stop()
    down_at = time.monotonic()
    during = 0
    while time.monotonic() - down_at < OUTAGE_S:
        batch = enqueue(queue, 25)
        ids += batch
        during += len(batch)
        forwarder.assert_alive()
        time.sleep(1.0)
    assert "transport unavailable" in forwarder.log()
    server.start()  # same port; the data written before the outage is reloaded from the AOF
    up_at = time.monotonic()
    wait_for_all(server, len(ids), forwarder, timeout=90)
    caught_up = time.monotonic() - up_at
    queued_twice = check_exactly_once(server, ids)
    status = wait_caught_up(journal_dir, subprocess_env, forwarder)
    assert status["accepted"] == status["forwarded"] == len(ids)
    rc, _ = forwarder.terminate()
    assert rc == 0
    log = forwarder.log()
    down, up = log.count("transport unavailable"), log.count("available again")
    assert (down, up) == (1, 1), log
    figures(
        f"S12 redis-down outage_s={OUTAGE_S:g} accepted={len(ids)} enqueued_during_outage={during} lost=0 "
        f"queued_twice={queued_twice} caught_up_after_restart_s={caught_up:.1f} "
        f"down_logs={down} up_logs={up}"
    )


# -- signals and the lock -----------------------------------------------------------------------


def test_sigterm_exits_0_promptly_with_its_checkpoint_saved(
    redis_server: RedisServer,
    start_forwarder: StartForwarder,
    journal_dir: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    queue = Queue("default", journal_dir)
    ids: list[str] = []
    for _ in range(20):  # a backlog that takes several seconds to forward in batches of 10
        envs = [queue.prepare("tests.tasks.add", (i, 3)) for i in range(1000)]
        ids += [job.id for job in queue.enqueue_many(envs)]
    forwarder = start_forwarder(redis_server.url, "--batch-size", "10")
    wait_for_all(redis_server, 1, forwarder)
    rc, took = forwarder.terminate(timeout=60)
    assert rc == 0, forwarder.log()
    assert took < 5.0, f"SIGTERM took {took:.1f} s"
    assert "checkpoint saved" in forwarder.log()
    in_redis = queue_length(redis_server)
    status = run_status(journal_dir, subprocess_env)
    assert status["forwarder"] is None  # the lock is released
    assert status["forwarded"] == in_redis
    assert status["not_yet_forwarded"] == len(ids) - in_redis

    # A clean stop leaves nothing to re-push: the next forwarder carries on where it stopped.
    successor = start_forwarder(redis_server.url)
    status = wait_caught_up(journal_dir, subprocess_env, successor)
    check_exactly_once(redis_server, ids)
    assert status["forwarded"] == len(ids)
    assert status["duplicate_pushes"] == 0
    assert successor.terminate()[0] == 0
    figures(
        f"SIGTERM exit_s={took:.2f} forwarded_at_stop={in_redis} backlog={len(ids)} "
        f"dup_delivery={status['duplicate_pushes']}"
    )


def test_sigterm_while_redis_is_down_exits_0_and_forwards_nothing(
    make_redis_server: Callable[..., RedisServer],
    start_forwarder: StartForwarder,
    journal_dir: Path,
    subprocess_env: dict[str, str],
) -> None:
    server = make_redis_server(start=False)
    queue = Queue("default", journal_dir)
    ids = enqueue(queue, 20)
    forwarder = start_forwarder(server.url)
    wait_until(lambda: "transport unavailable" in forwarder.log(), what="the forwarder to find Redis down")
    rc, took = forwarder.terminate()
    assert rc == 0, forwarder.log()
    assert took < 5.0, f"SIGTERM took {took:.1f} s"
    status = run_status(journal_dir, subprocess_env)
    assert (status["forwarded"], status["not_yet_forwarded"]) == (0, 20)  # nothing claimed

    redis_url = server.url
    server.start()
    assert server.url == redis_url, "redis-server moved to another port"
    successor = start_forwarder(server.url)
    wait_caught_up(journal_dir, subprocess_env, successor)
    check_exactly_once(server, ids)
    assert successor.terminate()[0] == 0


def test_a_second_forwarder_on_the_same_journal_is_refused(
    redis_server: RedisServer,
    start_forwarder: StartForwarder,
    journal_dir: Path,
    subprocess_env: dict[str, str],
) -> None:
    queue = Queue("default", journal_dir)
    first = start_forwarder(redis_server.url)
    wait_forwarding(first)
    assert run_status(journal_dir, subprocess_env)["forwarder"].startswith(f"forwarder pid {first.pid} ")

    second = start_forwarder(redis_server.url)
    rc = second.wait(timeout=30)
    assert rc != 0
    assert f"forwarder pid {first.pid}" in second.log()
    # The holder is untouched and still forwarding.
    ids = enqueue(queue, 5)
    wait_for_all(redis_server, 5, first)
    check_exactly_once(redis_server, ids)
    assert first.terminate()[0] == 0


# -- end to end ---------------------------------------------------------------------------------


def test_jobs_run_under_a_plain_rq_worker(
    redis_server: RedisServer,
    start_forwarder: StartForwarder,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    out = tmp_path / "tokens.txt"
    queue = Queue("default", journal_dir)
    tokens = [f"token-{i}" for i in range(20)]
    ids = [queue.enqueue("tests.tasks.record", str(out), token).id for token in tokens]
    forwarder = start_forwarder(redis_server.url)
    wait_for_all(redis_server, len(ids), forwarder)
    check_exactly_once(redis_server, ids)

    worker = subprocess.run(
        [
            *RQ,
            "worker",
            "--burst",
            "--serializer",
            "rq.serializers.JSONSerializer",
            "-u",
            redis_server.url,
            "default",
        ],
        env=subprocess_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert worker.returncode == 0, worker.stderr + worker.stdout
    ran = out.read_text().splitlines()
    assert collections.Counter(ran) == collections.Counter(tokens)
    assert queue_length(redis_server) == 0
    assert forwarder.terminate()[0] == 0
    figures(f"E2E rq-worker jobs={len(ids)} ran={len(ran)} lost=0 ran_twice=0")


# -- a corrupt journal --------------------------------------------------------------------------


def test_forward_refuses_a_corrupt_sealed_segment_with_exit_3(
    redis_server: RedisServer,
    start_forwarder: StartForwarder,
    journal_dir: Path,
    subprocess_env: dict[str, str],
) -> None:
    # A producer process that exits normally seals its segment (its writer closes at exit).
    subprocess.run(
        [
            sys.executable,
            "-c",
            PRODUCE_10,
            str(journal_dir),
        ],
        env=subprocess_env,
        check=True,
        timeout=60,
    )
    (segment,) = sorted(journal_dir.glob("*.wal"))
    assert segment.stat().st_mode & 0o777 == 0o400, "the producer's segment was not sealed"
    raw = bytearray(segment.read_bytes())
    start = FILE_HEADER_SIZE
    for _ in range(4):  # skip to the fifth record: four good records come before the damage
        start += RECORD_HEADER_SIZE + int.from_bytes(raw[start + 4 : start + 8], "little")
    length = int.from_bytes(raw[start + 4 : start + 8], "little")
    flipped = start + RECORD_HEADER_SIZE + length // 2
    raw[flipped] ^= 0x40
    segment.chmod(0o600)
    segment.write_bytes(bytes(raw))
    segment.chmod(0o400)

    forwarder = start_forwarder(redis_server.url)
    rc = forwarder.wait(timeout=30)
    log = forwarder.log()
    assert rc == 3, log
    assert segment.name in log
    assert str(segment) in log or os.path.realpath(segment) in log
    offset = re.search(r"at offset (\d+)", log)
    assert offset is not None, log
    assert start <= int(offset.group(1)) <= flipped, log
    assert queue_length(redis_server) == 0  # refused before anything was forwarded


# -- F2: enqueue to RQ latency (measured, not asserted) -----------------------------------------


def test_f2_enqueue_to_rq_latency(
    redis_server: RedisServer,
    start_forwarder: StartForwarder,
    journal_dir: Path,
    figures: Callable[[str], None],
) -> None:
    queue = Queue("default", journal_dir)
    forwarder = start_forwarder(redis_server.url)
    ids = enqueue(queue, 1)  # warm-up: the forwarder is up and idle after this one arrives
    wait_for_all(redis_server, 1, forwarder)
    latencies: list[float] = []
    with contextlib.closing(redis_server.client(socket_timeout=30)) as client:
        for _ in range(50):
            time.sleep(0.02)  # the forwarder is idle, waiting for a nudge
            start = time.perf_counter()
            ids.append(queue.enqueue("tests.tasks.add", 1, 1).id)
            deadline = time.monotonic() + 30
            while client.llen(QUEUE_KEY) < len(ids):
                assert time.monotonic() < deadline, "a job never arrived"
                time.sleep(0.0005)
            latencies.append((time.perf_counter() - start) * 1000)
    check_exactly_once(redis_server, ids)
    forwarder.assert_alive()
    p50 = statistics.median(latencies)
    p95 = statistics.quantiles(latencies, n=20)[-1]
    figures(
        f"F2 enqueue-to-rq n={len(latencies)} p50_ms={p50:.1f} p95_ms={p95:.1f} max_ms={max(latencies):.1f}"
    )
