"""The forwarder's window (issue 29): sizing with a fake clock, the memory gate, the run table.

The forwarder runs on the in-memory transport, told to report its queues' lengths and a
``maxmemory`` (``WindowedTransport``): what the RQ transport reads from ``LLEN`` and ``INFO``.
Each test runs in well under a second.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
from hybridq import Queue, Retry
from hybridq.envelope.model import Envelope
from hybridq.errors import JournalIOError, RedisFull
from hybridq.forwarder import Forwarder
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.runs import RunTable
from hybridq.forwarder.window import BOOST_DECAY_S, MemoryGate, QueueWindow
from hybridq.journal.fileops import FileOps
from hybridq.ops.window_stats import waiting_in_journal
from hybridq.testing.memory import MemoryTransport
from hybridq.transport.base import Delivery, MemoryInfo, PushResult

from tests import tasks


class WindowedTransport(MemoryTransport):
    """The memory transport, reporting queue lengths and (optionally) a Redis at its limit."""

    def __init__(self) -> None:
        super().__init__()
        self.info: MemoryInfo | None = None
        self.oom = False
        self.pushed_ids: list[str] = []

    def queue_lengths(self, queues: Sequence[str]) -> dict[str, int]:
        return {q: len(self.queues.get(q, [])) for q in queues}

    def memory(self) -> MemoryInfo | None:
        return self.info

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        if self.oom:
            raise RedisFull("Redis is full: OOM command not allowed")
        self.pushed_ids += [d.envelope.id for d in jobs]
        return super().push(jobs)


def forwarder(journal: Path, transport: MemoryTransport, **options: object) -> Forwarder:
    f = Forwarder(journal, transport, backoff_initial_s=0.001, backoff_max_s=0.002, **options)  # type: ignore[arg-type]
    f.open()
    return f


def enqueue(journal: Path, n: int, queue: str = "default") -> list[str]:
    q = Queue(queue, journal=journal)
    return [j.id for j in q.enqueue_many(q.prepare(tasks.add, [i, i]) for i in range(n))]


# -- sizing -----------------------------------------------------------------------------------


def test_the_target_follows_the_drain_between_floor_and_ceiling() -> None:
    w = QueueWindow(floor=100, ceiling=1000, cover_s=1.0)
    assert w.target == 100
    w.observe(0, 0.0)
    for t in range(1, 40):  # 400 jobs/s leave the queue, never emptying it
        w.pushed(400)
        w.observe(w.expected - 400 + 10, float(t))
    assert 350 <= w.target <= 410
    for t in range(40, 80):  # 5,000 jobs/s: the ceiling
        w.pushed(5000)
        w.observe(w.expected - 5000 + 10, float(t))
    assert w.target == 1000


def test_an_underrun_doubles_the_target_and_it_decays_back() -> None:
    w = QueueWindow(floor=100, ceiling=1000, cover_s=1.0)
    w.observe(0, 0.0)
    w.pushed(100)
    w.observe(0, 0.01)  # the workers emptied it at once: they wait for the forwarder
    before = max(w.floor, int(w.rate * w.cover_s))  # the target the underrun found
    assert w.boost == 2 * before
    assert w.target >= 2 * before
    w.pushed(10)
    w.observe(5, 0.02 + BOOST_DECAY_S)
    assert w.boost == before


def test_a_rising_drain_is_followed_within_a_second_and_a_falling_one_slowly() -> None:
    # A burn-down's workers drain 4,000 jobs/s from the start: with the drain's rise smoothed as
    # slowly as its fall (5 s), the window lagged a fifth of it after a second, and the workers
    # found the queue empty again and again (B1, docs/benchmarks.md).
    w = QueueWindow(floor=500, ceiling=10_000, cover_s=1.0)
    w.observe(0, 0.0)
    for step in range(1, 11):
        w.pushed(400)
        w.observe(0, step / 10)
    assert w.rate >= 0.8 * 4000
    for step in range(11, 21):  # the drain stops: the rate falls over seconds, not at once
        w.observe(0, step / 10)
    assert w.rate >= 0.6 * 4000


def test_a_queue_is_topped_up_only_once_it_fell_to_half() -> None:
    w = QueueWindow(floor=100, ceiling=100, cover_s=1.0)
    w.observe(60, 0.0)
    assert w.room() == 0  # 60 > 50: not yet
    w.observe(50, 1.0)
    assert w.room() == 50
    w.pushed(50)
    assert w.room() == 0


# -- the memory gate --------------------------------------------------------------------------


def test_the_gate_stops_at_the_high_water_mark_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    gate = MemoryGate(ForwarderConfig(redis_high_water=0.8), clock=lambda: 0.0)
    gate.info = MemoryInfo(used=1_000_000, maxmemory=10_000_000, policy="noeviction")
    assert gate.room() == (8_000_000 - 1_000_000) // (2 * 4000)
    gate.pushed(2 * gate.room())  # each costs its hash and its push's input buffer
    with caplog.at_level(logging.INFO, logger="hybridq.forwarder"):
        assert gate.room() == 0
    assert gate.paused == "high_water"
    assert not caplog.records  # flow control under a backlog, not news
    gate.info = MemoryInfo(used=0, maxmemory=0, policy="noeviction")
    assert gate.room() > 10**9  # no maxmemory: no mark
    assert gate.paused is None


def test_an_oom_reply_pauses_with_one_line_each_way(caplog: pytest.LogCaptureFixture) -> None:
    gate = MemoryGate(ForwarderConfig(), clock=lambda: 0.0)
    gate.info = MemoryInfo(used=11_000_000, maxmemory=10_000_000, policy="noeviction")
    with caplog.at_level(logging.INFO, logger="hybridq.forwarder"):
        for _ in range(3):
            gate.refused(RedisFull("OOM"))
            assert gate.room() == 0
        gate.info = MemoryInfo(used=1_000_000, maxmemory=10_000_000, policy="noeviction")
        assert gate.room() > 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "Redis is full (OOM reply" in lines[0]
    assert "pushes resumed" in lines[1]
    assert gate.pauses == 1


# -- the forwarder ----------------------------------------------------------------------------


def test_only_the_window_goes_to_redis_and_the_backlog_drains_through_it_once(journal_dir: Path) -> None:
    ids = enqueue(journal_dir, 3000)
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=200, window_max=200)
    try:
        f.step()
        assert len(transport.queues["default"]) == 200
        assert f.state.runs.waiting("default") == 2800
        assert f.checkpoint.positions  # read and indexed: the checkpoint moved past all of it
        for _ in range(40):
            transport.work("default", limit=150)
            f.step()
        assert transport.executions == dict.fromkeys(ids, 1)
        assert f.state.runs.total == 0
        assert Counter(transport.pushed_ids) == Counter(ids)  # each pushed once, in journal order
        assert transport.pushed_ids == ids
    finally:
        f.close()


def one_step_then_stop(journal_dir: Path, n: int) -> tuple[list[str], WindowedTransport]:
    """``n`` jobs, a forwarder with a 100-job window that takes one step and stops."""
    ids = enqueue(journal_dir, n)
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=100, window_max=100)
    f.step()
    f.close()
    return ids, transport


def test_a_restart_keeps_the_backlog_on_disk_and_pushes_nothing_twice(journal_dir: Path) -> None:
    ids, transport = one_step_then_stop(journal_dir, 1000)
    assert RunTable(str(journal_dir)).path.endswith("runs/runs.sqlite")
    f = forwarder(journal_dir, transport, window_min=100, window_max=100)
    try:
        assert f.state.runs.waiting("default") == 900
        for _ in range(30):
            transport.work("default")
            f.step()
        assert transport.executions == dict.fromkeys(ids, 1)
        assert transport.pushed_ids == ids
    finally:
        f.close()


def test_records_read_again_after_a_crash_before_the_checkpoint_run_once(journal_dir: Path) -> None:
    ids = enqueue(journal_dir, 600)
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=100, window_max=100)
    f.state.save = lambda forwarded: None  # type: ignore[method-assign]  # the crash: never saved
    f.step()
    f.close()
    f = forwarder(journal_dir, transport, window_min=100, window_max=100)
    try:
        f.step()  # reads everything again from the old checkpoint
        # INSERT OR IGNORE: one row each; the 100 pushed before the crash are indexed again
        # (pushed, then absorbed by their job id, or skipped once their outcome is in the ledger).
        assert f.state.runs.waiting("default") == 600
        assert len(transport.queues["default"]) == 100
        for _ in range(20):
            transport.work("default")
            f.step()
        assert transport.executions == dict.fromkeys(ids, 1)
        assert f.state.runs.total == 0
    finally:
        f.close()


def test_an_oom_reply_leaves_the_batch_in_the_run_table_and_the_loop_goes_on(journal_dir: Path) -> None:
    ids = enqueue(journal_dir, 300)
    transport = WindowedTransport()
    transport.oom = True
    f = forwarder(journal_dir, transport, window_min=500, window_max=500)
    try:
        f.step()  # no stall: the step returns, the jobs wait on disk
        assert f.backlog.gate.paused == "oom"
        assert f.state.runs.waiting("default") == 300
        assert not transport.queues.get("default")
        transport.oom = False
        f.backlog.gate.info = None  # the next sample: room again
        f.step()
        transport.work("default")
        f.step()
        assert transport.executions == dict.fromkeys(ids, 1)
    finally:
        f.close()


def test_a_delayed_job_that_comes_due_waits_behind_the_window(journal_dir: Path) -> None:
    now = [time.time()]
    q = Queue("default", journal=journal_dir)
    late = q.enqueue(tasks.add, 1, 1, delay=10)
    ids = enqueue(journal_dir, 150)
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=100, window_max=100, clock=lambda: now[0])
    try:
        f.step()
        assert late.id not in transport.jobs
        now[0] += 3600  # long due
        f.step()
        assert late.id not in transport.queues["default"]  # the window is full: it waits its turn
        for _ in range(10):
            transport.work("default")
            f.step()
        assert set(transport.executions) == {*ids, late.id}
    finally:
        f.close()


def test_a_lost_run_table_redelivers_through_the_window_not_the_whole_backlog(journal_dir: Path) -> None:
    # Every record before the checkpoint without a row reads as pushed: the reconcile pass finds
    # the backlog "missing" in Redis. Delivered again at once, it would all go into Redis.
    ids, transport = one_step_then_stop(journal_dir, 1000)
    os.unlink(RunTable(str(journal_dir)).path)
    f = forwarder(
        journal_dir, transport, window_min=100, window_max=100, lease_s=0.0, reconcile_interval_s=0.0
    )
    try:
        deepest = 0
        for _ in range(200):
            f.completions.hurry()
            f.step()
            deepest = max(deepest, len(transport.queues.get("default", [])))
            transport.work("default")
        assert deepest <= 100
        assert transport.executions == dict.fromkeys(ids, 1)
    finally:
        f.close()


def test_creating_the_run_table_makes_its_directory_entries_durable(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows fsync'd into a file whose directory entry a power cut loses are rows lost: the records
    # they stand for read as pushed (the run table's first rule).
    synced: list[str] = []
    monkeypatch.setattr(FileOps, "fsync_dir", lambda _self, path: synced.append(os.path.realpath(path)))
    table = RunTable(str(journal_dir))
    table.open()
    table.close()
    runs_dir = os.path.dirname(os.path.realpath(table.path))
    assert os.path.dirname(runs_dir) in synced  # runs/ in the journal directory
    assert runs_dir in synced  # runs.sqlite (and its WAL) in runs/


def test_doctor_takes_an_unreadable_run_table_for_unknown_not_for_pushed(
    journal_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # "Not waiting" would have doctor --fix push every job the table holds into Redis.
    path = RunTable(str(journal_dir)).path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"not a database" * 100)
    waiting = waiting_in_journal(str(journal_dir))
    with caplog.at_level(logging.WARNING):
        assert waiting(("w", 0, 64)) is True
        assert waiting(("w", 0, 128)) is True
    assert len([r for r in caplog.records if "run table" in r.getMessage()]) == 1


def test_a_due_retry_goes_before_the_backlog(journal_dir: Path) -> None:
    # The refill took every slot the window had before the retries asked: a retry waited for
    # the whole backlog to drain.
    flaky = Queue(journal=journal_dir).enqueue(tasks.add, 0, 0, retry=Retry(max_attempts=2, backoff_s=0))
    enqueue(journal_dir, 300)
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=10, window_max=10)
    order: list[str] = []

    def task(env: Envelope, attempt: int) -> None:
        order.append(f"{env.id}:{attempt}")
        if env.id == flaky.id and attempt == 1:
            raise RuntimeError("flaky")

    try:
        for _ in range(100):
            f.step()
            transport.work("default", task, limit=5)
        assert f"{flaky.id}:2" in order
        assert order.index(f"{flaky.id}:2") < 40
    finally:
        f.close()


def test_a_pause_at_the_high_water_mark_for_over_a_minute_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    gate = MemoryGate(ForwarderConfig(redis_high_water=0.8), clock=lambda: now[0])
    gate.info = MemoryInfo(used=9_000_000, maxmemory=10_000_000, policy="noeviction")
    with caplog.at_level(logging.INFO, logger="hybridq.forwarder"):
        for t in (0.0, 30.0, 59.0, 61.0, 90.0, 300.0):
            now[0] = t
            assert gate.room() == 0
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 1, lines
    assert "high-water mark for 61 s" in lines[0]


def test_a_run_table_error_after_open_is_one_line_not_a_traceback(journal_dir: Path) -> None:
    # A traceback, a restart by the supervisor, the same error: a crash loop nobody can read.
    # As the journal's error, `hybridq forward` prints one line and exits 1; a full disk pauses.
    table = RunTable(str(journal_dir))
    table.open()
    table.db.execute("DROP TABLE runs")  # what a damaged file or a failing disk looks like here
    with pytest.raises(JournalIOError, match=r"the run table failed on .*runs\.sqlite: no such table"):
        table.add([(("w", 0, 64), "default", 1.0, 0, "")])
    table.close()
