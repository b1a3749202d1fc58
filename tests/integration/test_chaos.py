"""The CI tier of ``hybridq chaos`` (S1, S2, S8-S12 over real processes), and the harness's own test.

The default run's schedule (45 s, faults 1 s apart on average) runs every fault class once or more
with a fixed seed; the chaos tier (``-m chaos``) is the 70-second schedule (1.5 s apart) whose
figures docs/reliability.md shows, and the soak tier is the same harness for longer
(``scripts/chaos --duration 1800``, docs/reliability.md). The harness
is tested against broken forwarders (a ``sitecustomize`` that patches hybridq in every child
process): a harness that cannot see a loss or a re-execution proves nothing.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from hybridq.testing.chaos import FAULTS, ChaosConfig, ChaosResult, run_chaos
from hybridq.testing.chaos_check import read_runs
from hybridq.testing.topology import QUEUE, Fault, Topology

pytestmark = pytest.mark.timeout(400)


def _run(tmp_path: Path, **options: object) -> ChaosResult:
    options = {"gap_s": 1.5, "drain_s": 60.0, "rate": 6.0, **options}
    cfg = ChaosConfig(directory=str(tmp_path / "chaos"), **options)  # type: ignore[arg-type]
    return run_chaos(cfg, say=lambda _line: None)


#: The default run's schedule: the same seed, its gaps two thirds of the tier's. Its first round
#: of all 15 fault classes has begun its last fault by about 35 s (34.5 s measured while the S18
#: test ran beside it, load average 2.7): 45 s leaves a fourth of that to spare. The tier's
#: 1.5 s gaps need about 42 s for the same round.
DEFAULT = {"duration_s": 45.0, "gap_s": 1.0}
#: The chaos tier (``-m chaos``): the 70-second schedule docs/reliability.md reports.
TIER = {"duration_s": 70.0, "gap_s": 1.5}


def test_every_fault_class_loses_nothing_and_reruns_no_finished_job(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    _every_fault_class(tmp_path, figures, **DEFAULT)


@pytest.mark.chaos
def test_the_tiers_70_second_schedule_loses_nothing_and_reruns_no_finished_job(
    tmp_path: Path, figures: Callable[[str], None]
) -> None:
    _every_fault_class(tmp_path, figures, **TIER)


def _every_fault_class(tmp_path: Path, figures: Callable[[str], None], **schedule: float) -> None:
    result = _run(tmp_path, seed=20261130, **schedule)
    for stats in result.per_fault.values():
        figures(f"chaos seed={result.seed} {stats.line()}")
    figures(f"chaos seed={result.seed} {result.total_line()}")
    assert result.violations == []
    assert result.lost_tokens == []
    assert result.failed == {}
    assert result.ok
    assert result.accepted > 300
    missing = [name for name in FAULTS if result.per_fault[name].injected == 0]
    assert missing == [], f"fault classes never injected: {missing}"
    assert result.status["pending"] == 0
    assert result.status["failed"] == 0


def test_the_harness_plain_rq_workers_stop_at_once_on_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The topology's close waited its 10 s for about one plain `rq worker` in 5, then killed it:
    # not a signal ignored, but RQ's exit, which sends UNSUBSCRIBE and then stops redis-py 8.2's
    # pub/sub thread with an unbounded join; a thread that got the reply first is back waiting a
    # minute for a message (hybridq.rqworker.unsubscribe_promptly). The stop is made 0.3 s late
    # here, so that the thread always gets there first (without it, 1 of 6 idle workers hung in
    # 1 run of 3, 4 of 10 when started one by one).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LATE_PUBSUB_STOP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    topo = Topology(ChaosConfig(directory=str(tmp_path), workers=4, producers=0), str(tmp_path), say=print)
    try:
        topo.server.start()
        plain = (1, 3)  # the odd ones: plain `rq worker` processes
        for n in plain:
            topo.start_worker(n)
        with contextlib.closing(topo.server.client()) as client:
            deadline = time.monotonic() + 60
            while client.scard("rq:workers") < len(plain):  # registered: they subscribe next
                assert time.monotonic() < deadline, "the rq workers never registered"
                time.sleep(0.05)
        time.sleep(1.0)  # their pub/sub threads waiting for a message
        procs = [topo.workers[n] for n in plain]
        for proc in procs:
            assert proc is not None
            os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        hung = [p.pid for p in procs if p is not None and _exited_by(p, deadline) is None]
        assert hung == [], f"still running 5 s after SIGTERM: {hung}"
    finally:
        topo.close()


#: A ``sitecustomize`` that makes redis-py's ``PubSubWorkerThread.stop`` clear its flag 0.3 s late.
LATE_PUBSUB_STOP = """
import time
from redis.client import PubSubWorkerThread
_stop = PubSubWorkerThread.stop
def _late_stop(self, timeout=None):  # the signature kept: unsubscribe_promptly reads it
    time.sleep(0.3)
    _stop(self, timeout)
PubSubWorkerThread.stop = _late_stop
"""


def _exited_by(proc: subprocess.Popen[str], deadline: float) -> int | None:
    """The exit status of ``proc`` once it exits before ``deadline``, else None."""
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            return rc
        time.sleep(0.02)
    return proc.poll()


def _break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *patches: str) -> None:
    """Apply ``patches`` in every Python process the harness starts (forwarder, workers, producers).

    Each is dedented alone: a ``sitecustomize`` that does not compile is only a line on the
    processes' stderr, and the mutant would quietly be the real thing.
    """
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("\n".join(textwrap.dedent(patch) for patch in patches))
    monkeypatch.setenv("PYTHONPATH", str(site))


#: Added to a mutant's patch: a run holds on after noting its start until the harness logs a
#: fault (``faults.jsonl`` beside the effects file; at most 30 s), so the workers take nothing
#: more and what the forwarder pushes meanwhile stays queued in Redis for the fault to take. A
#: run that starts after it does not wait (these runs have one fault).
HOLD_UNTIL_A_FAULT = """
import os, time
import hybridq.testing.chaos as chaos
_note = chaos._note
def _note_and_hold(path, kind, token, attempt):
    _note(path, kind, token, attempt)
    log = os.path.join(os.path.dirname(path), "faults.jsonl")
    until = time.time() + 30.0
    while kind == "B" and not os.path.exists(log) and time.time() < until:
        time.sleep(0.05)
chaos._note = _note_and_hold
"""


def _inject_when(monkeypatch: pytest.MonkeyPatch, ready: Callable[[Topology], bool]) -> list[float]:
    """Hold each fault of the schedule until ``ready`` (at most 60 s); return how long each waited.

    The mutants' tests need a fault that has something to act on (jobs queued in Redis, a job
    finished long before): the schedule's clock alone leaves that to the machine's speed.
    """
    inject = Topology.inject
    waits: list[float] = []

    def inject_when_ready(self: Topology, name: str, rng: random.Random) -> Fault:
        began = time.monotonic()
        while not ready(self) and time.monotonic() < began + 60.0:
            self.keep_alive()
            time.sleep(0.05)
        waits.append(time.monotonic() - began)
        return inject(self, name, rng)

    monkeypatch.setattr(Topology, "inject", inject_when_ready)
    return waits


def _queued(topo: Topology) -> int:
    """Jobs queued in Redis for the workers (0 while it is down)."""
    try:
        with contextlib.closing(topo.server.client(socket_timeout=1.0)) as client:
            return int(client.llen(f"rq:queue:{QUEUE}"))
    except redis.RedisError:
        return 0


def _left_queued(topo: Topology) -> bool:
    """Whether more than a few jobs wait in Redis and stay there: no worker is free to take them."""
    before = _queued(topo)
    time.sleep(0.1)
    return min(before, _queued(topo)) > 3


def _ended_before(topo: Topology, seconds: float) -> bool:
    """Whether a run of some job ended at least ``seconds`` ago."""
    runs = read_runs(topo.effects)
    now = time.time()
    return any(r.kind == "E" and r.at <= now - seconds for token_runs in runs.values() for r in token_runs)


def test_the_harness_sees_a_forwarder_that_loses_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Callable[[str], None]
) -> None:
    # No epoch check and no reconcile passes: what Redis forgets is never delivered again.
    _break(
        tmp_path,
        monkeypatch,
        """
        from hybridq.forwarder.reconcile import Reconciler as Completions
        Completions.check_epoch = lambda self: None
        Completions.reconcile_step = lambda self: []
        """,
        HOLD_UNTIL_A_FAULT,
    )
    # The one fault (seed 7: a FLUSHALL, due at 1.2 s; the schedule ends at 2.5 s) waits until
    # jobs stay queued in Redis: every worker holds its runs until the fault, so none is free to
    # take them, and the fault always finds some to lose. (Left to the clock, it lost only jobs
    # that happened to be queued at a fault: the workers run 33 jobs at once and take one within
    # milliseconds, so only when they were away, reconnecting after the restart before: lost=0
    # in 1 of 2 runs under load.) A drain of 4 s without progress: a lost job never finishes, so
    # the drain always runs to its end.
    waits = _inject_when(monkeypatch, _left_queued)
    result = _run(tmp_path, duration_s=2.5, seed=7, faults=("redis-restart", "flushall"), drain_s=4.0)
    figures(f"chaos mutant=forgets-redis-loss {result.total_line()} (fault waited {waits[0]:.1f} s)")
    assert len(waits) == 1
    assert result.lost > 0
    assert not result.ok


def test_the_harness_sees_a_forwarder_that_reruns_finished_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Callable[[str], None]
) -> None:
    # The ledger ignored: after Redis loses its data, every job is delivered again, long-finished
    # ones included, and nothing is left to stop them from running.
    _break(
        tmp_path,
        monkeypatch,
        """
        from hybridq.ledger.store import LedgerIndex
        LedgerIndex.is_terminal = lambda self, loc: False
        """,
    )
    # The one FLUSHALL waits for a job that ended longer ago than the harness's window (3 s: a
    # re-run of one that ended within it is excused): its re-run is one the harness must call a
    # violation. (Left to the clock, that needed a 24 s schedule of FLUSHALLs 5-15 s apart; a
    # shorter one missed it 3 runs of 4.)
    window_s = ChaosConfig.window_s
    waits = _inject_when(monkeypatch, lambda topo: _ended_before(topo, window_s + 0.5))
    result = _run(tmp_path, duration_s=2.5, seed=8, faults=("flushall",), drain_s=6.0)
    figures(f"chaos mutant=ignores-ledger {result.total_line()} (fault waited {waits[0]:.1f} s)")
    assert len(waits) == 1
    assert result.dup_execution > 0
    assert not result.ok
