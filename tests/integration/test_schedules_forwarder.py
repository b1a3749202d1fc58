"""Schedules kept by a real ``hybridq forward --schedules`` process, run by a worker (docs/schedules.md).

The forwarder is a child process on a private Redis; it is started with its schedule's state
ten minutes behind (as after ten minutes down), so the catch-up fires ten ticks at once instead
of the test waiting for minutes. It is killed (SIGKILL) before it harvests, started again, and
Redis is flushed once the outcomes are in its ledger: every tick's task ran exactly once, and
none is missing.
"""

from __future__ import annotations

import collections
import datetime as dt
import signal
import time
from collections.abc import Callable
from pathlib import Path

from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader
from hybridq.journal.paths import ensure_journal_dir
from hybridq.scheduler import TickState, load_ticks, save_ticks
from hybridq.schedules import parse_tick_key
from hybridq.testing.embedded import RedisServer

from tests.integration.test_forward_outbox import run_jobs
from tests.support.processes import ForwarderProcess, run_status, wait_until


def minute_keys(after: float, through: float) -> list[str]:
    """The tick keys of every minute in ``(after, through]``."""
    first = (int(after) // 60 + 1) * 60
    return [
        "schedule:minutely:" + dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for t in range(first, int(through) + 1, 60)
    ]


def test_a_schedules_ticks_run_once_each_across_a_kill_and_a_redis_flush(
    tmp_path: Path,
    journal_dir: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    ticks = tmp_path / "ticks"
    env = {**subprocess_env, "HYBRIDQ_TEST_TICKS": str(ticks)}
    ensure_journal_dir(journal_dir)
    behind = time.time() - 600
    save_ticks(str(journal_dir), {"minutely": TickState(through=behind)})  # down for 10 minutes
    args = ("--schedules", "tests.scheduled")
    log = tmp_path / "forwarder.log"
    forwarder = ForwarderProcess(journal_dir, redis_server.url, env=env, log_path=log, extra_args=args)
    try:
        queued = redis_server.client()
        wait_until(lambda: queued.llen("rq:queue:default") >= 10, what="10 caught-up ticks in RQ")
        forwarder.assert_alive()
    finally:
        forwarder.kill()  # SIGKILL: no clean stop
    caught_up = load_ticks(str(journal_dir))["minutely"].fired
    run_jobs(redis_server)  # the job's arguments name the ticks file

    def drained() -> bool:
        run_jobs(redis_server)  # whatever is queued: redeliveries, a tick that came due meanwhile
        return bool(run_status(journal_dir, env)["pending"] == 0)

    restarted = ForwarderProcess(journal_dir, redis_server.url, env=env, log_path=log, extra_args=args)
    try:
        wait_until(
            lambda: run_status(journal_dir, env)["succeeded"] >= caught_up,
            timeout=60,
            what="the caught-up ticks harvested",
        )
        # Redis loses everything (outcomes, queues, the epoch); the ledger has the ticks finished.
        redis_server.client().flushall()
        wait_until(lambda: "re-forwarding" in restarted.log(), timeout=60, what="the forwarder noticing")
        wait_until(drained, timeout=60, interval=0.2, what="nothing pending")
        restarted.assert_alive()
    finally:
        rc, _ = restarted.terminate()
    assert rc == 0, restarted.log()[-3000:]
    ran = collections.Counter(ticks.read_text().split())
    fired = sorted(tick[1].timestamp() for key in ran if (tick := parse_tick_key(key)) is not None)
    assert caught_up >= 10
    assert sorted(ran) == minute_keys(behind, fired[-1])  # none skipped, none foreign
    assert set(ran.values()) == {1}  # each ran once
    last = load_ticks(str(journal_dir))["minutely"].last
    assert last is not None
    assert last - fired[-1] <= 60  # at most a tick that came due after the drain, not run yet
    figures(f"SCHEDULES forward --schedules caught_up={caught_up} ticks={len(ran)} runs={sum(ran.values())}")


def test_a_forwarder_killed_between_a_ticks_append_and_its_record_runs_the_tick_once(
    tmp_path: Path,
    journal_dir: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    ticks = tmp_path / "ticks"
    env = {**subprocess_env, "HYBRIDQ_TEST_TICKS": str(ticks)}
    ensure_journal_dir(journal_dir)
    behind = time.time() - 600
    save_ticks(str(journal_dir), {"minutely": TickState(through=behind)})
    args = ("--schedules", "tests.scheduled")
    log = tmp_path / "forwarder.log"
    crashing = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env={**env, "HYBRIDQ_CRASH_POINT": "schedule_after_append"},
        log_path=log,
        extra_args=args,
    )
    assert crashing.wait(60) == -signal.SIGKILL, crashing.log()[-3000:]
    appended = [Envelope.from_bytes(r.payload).idempotency_key for r in JournalReader(journal_dir).records()]
    assert len(appended) >= 10
    assert load_ticks(str(journal_dir))["minutely"].through == behind  # its record was not saved

    def drained() -> bool:
        run_jobs(redis_server)
        return bool(run_status(journal_dir, env)["pending"] == 0)

    restarted = ForwarderProcess(journal_dir, redis_server.url, env=env, log_path=log, extra_args=args)
    try:
        wait_until(lambda: load_ticks(str(journal_dir))["minutely"].fired > 0, what="the ticks recorded")
        wait_until(drained, timeout=60, interval=0.2, what="nothing pending")
        restarted.assert_alive()
    finally:
        rc, _ = restarted.terminate()
    assert rc == 0, restarted.log()[-3000:]
    ran = collections.Counter(ticks.read_text().split())
    assert set(appended) <= set(ran)  # every tick the crashed forwarder appended ran...
    assert set(ran.values()) == {1}  # ...once: its second append was a duplicate, never pushed
    status = run_status(journal_dir, env)
    assert status["duplicates_suppressed"] >= len(appended)
    figures(
        f"SCHEDULES crash after append: appended={len(appended)} ran={sum(ran.values())} "
        f"suppressed={status['duplicates_suppressed']}"
    )
