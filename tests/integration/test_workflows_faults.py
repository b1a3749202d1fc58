"""Workflows under faults with real processes: a forwarder, a pool worker, a private redis-server.

The tasks append a line to an effects file (fsync'd) as they start, and the callback writes its
sum: the test counts runs without trusting hybridq. The heavy scenarios (a chord of 200 and a
chain of 20, each through two FLUSHALLs, a forwarder SIGKILL and a worker SIGKILL) are in the
``workflows`` tier (about 40 s each on 2 busy cores); the default run has a cheap chord, the
failure policy and depends_on across a Redis restart (about 10 s together).
"""

from __future__ import annotations

import collections
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hybridq
import pytest
from hybridq import Queue
from hybridq.errors import JobFailed
from hybridq.journal.paths import ensure_journal_dir
from hybridq.testing.embedded import RedisServer
from hybridq.workflows import store

from tests import tasks
from tests.support.processes import ForwarderProcess, WorkerProcess, wait_until


@dataclass
class Stack:
    """One forwarder and one worker on ``redis``, restartable."""

    tmp: Path
    journal: Path
    redis: RedisServer
    env: dict[str, str]
    forwarder: ForwarderProcess | None = None
    worker: WorkerProcess | None = None
    kills: list[str] = field(default_factory=list)

    def start_forwarder(self) -> None:
        self.forwarder = ForwarderProcess(
            self.journal, self.redis.url, env=self.env, log_path=self.tmp / "fwd.log"
        )

    def start_worker(self) -> None:
        args = [sys.executable, "-m", "hybridq", "worker", "--redis", self.redis.url, "--processes", "2", "default"]  # fmt: skip
        self.worker = WorkerProcess(args, env=self.env, log_path=self.tmp / "worker.log", cwd=self.tmp)

    def kill_forwarder(self) -> None:
        assert self.forwarder is not None
        self.forwarder.kill()
        self.kills.append("forwarder")
        self.start_forwarder()

    def kill_worker(self) -> None:
        assert self.worker is not None
        self.worker.kill()
        self.kills.append("worker")
        self.start_worker()

    def close(self) -> None:
        for proc in (self.worker, self.forwarder):
            if proc is not None:
                proc.kill()


@pytest.fixture
def stack(
    tmp_path: Path, journal_dir: Path, redis_server: RedisServer, subprocess_env: dict[str, str]
) -> Iterator[Stack]:
    ensure_journal_dir(journal_dir)
    s = Stack(tmp_path, journal_dir, redis_server, subprocess_env)
    s.start_forwarder()
    s.start_worker()
    try:
        yield s
    finally:
        s.close()


def runs(path: Path) -> collections.Counter[str]:
    return collections.Counter(path.read_text().split()) if path.exists() else collections.Counter()


def through_faults(
    stack: Stack, effects: Path, tokens: dict[str, str], *, flushes: int = 2, kill: bool = True
) -> dict[str, int]:
    """FLUSHALL, SIGKILL the forwarder, SIGKILL the worker (mid-task), FLUSHALL, as the steps go.

    ``tokens``: step id -> the effects token of its task. Returns, for each step the ledger held
    finished before some fault, its runs then: it must never run again.
    """
    faults: list[Callable[[], None]] = [stack.redis.flushall]
    if kill:
        faults += [stack.kill_forwarder, stack.kill_worker]
    faults += [stack.redis.flushall] * (flushes - 1)
    finished: dict[str, int] = {}
    for n, fault in enumerate(faults, 1):
        want = n * len(tokens) // (len(faults) + 1)
        wait_until(lambda want=want: len(runs(effects)) >= want, timeout=120, what=f"fault {n}")
        ran = runs(effects)
        for step, token in tokens.items():
            if (
                token not in finished
                and getattr(hybridq.fetch_job(step, stack.journal), "status", "") == "finished"
            ):
                finished[token] = ran[token]
        fault()
    return finished


def chord_of(n: int, effects: Path, callback: Path, sleep_s: float) -> hybridq.Signature | object:
    members = [hybridq.sig(tasks.add_slow, i, i, str(effects), sleep_s) for i in range(n)]
    return hybridq.chord(members, hybridq.sig(tasks.total_once, str(callback)))


def check_chord(
    stack: Stack, n: int, sleep_s: float, figures: Callable[[str], None], **faults: bool | int
) -> None:
    effects, callback = stack.tmp / "effects", stack.tmp / "callback"
    job = Queue(journal=stack.journal).enqueue(chord_of(n, effects, callback, sleep_s))
    tokens = {f"{job.id}__{i}": f"{i}+{i}" for i in range(n)}
    finished = through_faults(stack, effects, tokens, **faults)  # type: ignore[arg-type]
    assert job.wait(timeout=180) == sum(2 * i for i in range(n))
    assert callback.read_text().split() == [str(sum(2 * i for i in range(n)))]  # the callback ran once
    ran = runs(effects)
    assert set(ran) == {f"{i}+{i}" for i in range(n)}  # every member ran
    assert {t: ran[t] for t in finished} == finished  # a ledger-finished member never ran again
    assert store.flow_steps(str(stack.journal), job.id)[0] == "succeeded"
    again = sum(c - 1 for c in ran.values())
    figures(
        f"WORKFLOW chord n={n} faults={stack.kills}+flushall: callback runs=1, member re-runs={again} "
        f"(none of the {len(finished)} ledger-finished before a fault)"
    )


def test_a_small_chord_sums_once_through_a_flush(stack: Stack, figures: Callable[[str], None]) -> None:
    check_chord(stack, 30, 0.02, figures, flushes=1, kill=False)


@pytest.mark.workflows
def test_a_chord_of_200_sums_once_through_two_flushes_and_two_kills(
    stack: Stack, figures: Callable[[str], None]
) -> None:
    check_chord(stack, 200, 0.05, figures)


@pytest.mark.workflows
def test_a_chain_of_20_ends_right_through_two_flushes_and_two_kills(
    stack: Stack, figures: Callable[[str], None]
) -> None:
    effects = stack.tmp / "effects"
    steps = [hybridq.sig(tasks.add_slow, 0, 1, str(effects), 0.2)]
    steps += [hybridq.sig(tasks.add_slow, 1, str(effects), 0.2) for _ in range(19)]
    job = Queue(journal=stack.journal).enqueue(hybridq.chain(*steps))
    finished = through_faults(stack, effects, {f"{job.id}__{k}": f"{k}+1" for k in range(20)})
    assert job.wait(timeout=180) == 20
    ran = runs(effects)
    assert set(ran) == {f"{k}+1" for k in range(20)}
    assert {t: ran[t] for t in finished} == finished  # a ledger-finished step never ran again
    figures(f"WORKFLOW chain n=20 faults={stack.kills}+flushall: re-runs={sum(c - 1 for c in ran.values())}")


def test_a_failing_member_fails_the_chord_the_callback_never_runs_on_error_once(stack: Stack) -> None:
    effects, callback, errors = stack.tmp / "effects", stack.tmp / "callback", stack.tmp / "errors"
    members = [hybridq.sig(tasks.add_slow, i, i, str(effects)) for i in range(10)] + [hybridq.sig(tasks.fail)]
    job = Queue(journal=stack.journal).enqueue(
        hybridq.chord(members, hybridq.sig(tasks.total_once, str(callback))),
        on_error=hybridq.sig(tasks.record, str(errors), "on_error", immutable=True),
    )
    with pytest.raises(JobFailed, match="step 10"):
        job.wait(timeout=60)
    err_id = f"{job.id}__err"
    wait_until(
        lambda: getattr(hybridq.fetch_job(err_id, stack.journal), "status", None) == "finished",
        what="on_error",
    )
    # Redis loses everything, the forwarder is killed: a ledger-finished on_error never runs again,
    # and the callback never runs.
    stack.redis.flushall()
    stack.kill_forwarder()
    wait_until(lambda: "re-forwarding" in stack.forwarder.log(), timeout=60, what="the refill")  # type: ignore[union-attr]
    assert store.counts(str(stack.journal)).get("failed") == 1
    assert errors.read_text().split() == ["on_error"]
    assert not callback.exists()


def test_depends_on_works_across_a_redis_restart(stack: Stack) -> None:
    effects = stack.tmp / "effects"
    queue = Queue(journal=stack.journal)
    stack.forwarder.kill()  # type: ignore[union-attr]
    first = queue.enqueue(tasks.add_slow, 1, 1, str(effects), 1.0)
    after = queue.enqueue(tasks.add_slow, 2, 2, str(effects), depends_on=[first])
    stack.start_forwarder()
    wait_until(lambda: "1+1" in runs(effects), what="the dependency started")
    stack.redis.restart()  # empty: the dependency's run is lost; the dependent waits on disk
    assert after.wait(timeout=90) == 4
    ran = runs(effects)
    assert ran["2+2"] == 1
    assert list(ran).index("1+1") < list(ran).index("2+2")


@pytest.mark.parametrize("point", ["flows_after_release:2", "flows_after_end"])
def test_a_forwarder_killed_inside_a_release_or_an_end_runs_each_step_once(
    tmp_path: Path, journal_dir: Path, redis_server: RedisServer, subprocess_env: dict[str, str], point: str
) -> None:
    effects = tmp_path / "effects"
    ensure_journal_dir(journal_dir)
    stack = Stack(tmp_path, journal_dir, redis_server, {**subprocess_env, "HYBRIDQ_CRASH_POINT": point})
    steps = [hybridq.sig(tasks.add_slow, 0, 1, str(effects))]
    steps += [hybridq.sig(tasks.add_slow, 1, str(effects)) for _ in range(3)]
    job = Queue(journal=journal_dir).enqueue(hybridq.chain(*steps))
    stack.start_forwarder()
    stack.start_worker()
    try:
        assert stack.forwarder is not None
        assert stack.forwarder.wait(60) == -signal.SIGKILL, stack.forwarder.log()[-3000:]
        stack.env = subprocess_env  # disarmed
        stack.start_forwarder()
        assert job.wait(timeout=60) == 4
    finally:
        stack.close()
    assert runs(effects) == collections.Counter({f"{k}+1": 1 for k in range(4)})
