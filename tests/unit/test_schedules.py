"""Periodic jobs kept by the forwarder (issue 17, item 5; docs/schedules.md).

Against the in-memory transport (``forget()`` is a Redis FLUSHALL) with an injected clock: each
tick is a journaled job keyed ``schedule:<key>:<fire time>``, so restarts, crashes, a second
forwarder and Redis losing everything neither fire a tick twice nor skip one.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import schedules
from hybridq.envelope.model import Envelope
from hybridq.errors import JournalLocked, TransportError
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalReader
from hybridq.ops.status import collect_status
from hybridq.scheduler import TICK_SEGMENT_BYTES, Scheduler, TickState, load_ticks, save_ticks
from hybridq.schedules import Schedule, ScheduleError
from hybridq.transport import MemoryTransport

from tests.unit.test_completions import Clock, make_forwarder, settle


def at(hour: int, minute: int, second: float = 0.0) -> float:
    """A Unix time on 2026-01-01, UTC."""
    return dt.datetime(2026, 1, 1, hour, minute, tzinfo=dt.UTC).timestamp() + second


@pytest.fixture(autouse=True)
def _registry() -> Iterator[None]:
    """Each test registers its own schedules."""
    saved = dict(schedules._registry)
    schedules._registry.clear()
    yield
    schedules._registry.clear()
    schedules._registry.update(saved)


def every5(catchup: str = "latest", key: str = "report", **options: Any) -> Schedule:
    return hybridq.schedule(
        cron="*/5 * * * *", func="tests.tasks.add", key=key, args=[1, 2], catchup=catchup, **options
    )


class Crash(Exception):
    """The process died here."""


def start(
    journal: Path,
    transport: MemoryTransport,
    clock: Clock,
    *declared: Schedule,
    save: Any = save_ticks,
    **kwargs: Any,
) -> tuple[Forwarder, Scheduler]:
    scheduler = Scheduler(journal, list(declared) or [every5()], save=save)
    return make_forwarder(journal, transport, clock=clock, schedules=scheduler, **kwargs), scheduler


def run(transport: MemoryTransport) -> list[str]:
    """Run what is queued; the fire times (HH:MM) of the ticks whose task ran."""
    ran: list[str] = []
    transport.work(func=lambda env, _attempt: ran.append(env.meta.get("fire_time", "")[11:16] or "job"))
    return ran


def tick_records(journal: Path) -> list[str]:
    """The idempotency keys of the journal's records, in order."""
    return [Envelope.from_bytes(r.payload).idempotency_key for r in JournalReader(journal).records()]


def test_ticks_fire_at_their_times_once_each_as_keyed_jobs(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    forwarder, scheduler = start(journal_dir, transport, clock)
    assert forwarder.step() == 0  # first sight: the past is not caught up
    assert scheduler.next_fire() == at(10, 5)
    clock.now = at(10, 4, 59.9)
    assert forwarder.step() == 0
    clock.now = at(10, 5, 0.2)
    assert forwarder.step() == 1
    [job_id] = transport.queues["default"]
    env = transport.jobs[job_id]
    assert env.idempotency_key == "schedule:report:2026-01-01T10:05:00Z"
    assert (env.func, env.args, env.meta) == (
        "tests.tasks.add",
        (1, 2),
        {"schedule": "report", "fire_time": "2026-01-01T10:05:00Z"},
    )
    for now in (at(10, 7), at(10, 9, 59)):
        clock.now = now
        assert forwarder.step() == 0
    clock.now = at(10, 10, 0.5)
    forwarder.step()
    clock.now = at(10, 15, 0.1)
    forwarder.step()
    assert run(transport) == ["10:05", "10:10", "10:15"]
    settle(forwarder)
    forwarder.close()
    assert collect_status(str(journal_dir))["succeeded"] == 3
    assert load_ticks(str(journal_dir)) == {"report": TickState(at(10, 15, 0.1), at(10, 15), 3)}


def test_the_loop_wakes_for_the_next_tick(journal_dir: Path) -> None:
    clock = Clock(at(10, 4, 59.8))
    forwarder, _ = start(journal_dir, MemoryTransport(), clock, idle_timeout_s=5.0)
    forwarder.step()
    began = time.monotonic()
    forwarder._wait()
    took = time.monotonic() - began
    forwarder.close()
    assert took < 1.0  # 0.2 s to the tick, not the 5 s idle timeout


def test_a_restart_mid_schedule_neither_fires_twice_nor_skips(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    first, _ = start(journal_dir, transport, clock)
    first.step()
    clock.now = at(10, 5)
    first.step()
    first.close()
    clock.now = at(10, 6)
    second, _ = start(journal_dir, transport, clock)
    assert second.step() == 0  # 10:05 is fired already
    clock.now = at(10, 10)
    assert second.step() == 1
    assert run(transport) == ["10:05", "10:10"]
    settle(second)
    second.close()


def test_a_crash_between_the_ticks_append_and_its_record_makes_a_duplicate_never_pushed(
    journal_dir: Path,
) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    saves: list[int] = []

    def save_then_die(journal: str, ticks: dict[str, TickState]) -> None:
        saves.append(1)
        if len(saves) > 1:  # the first save records the new schedule; the second, the tick
            raise Crash
        save_ticks(journal, ticks)

    crashing, _ = start(journal_dir, transport, clock, save=save_then_die)
    crashing.step()
    clock.now = at(10, 5)
    with pytest.raises(Crash):
        crashing.step()  # the tick is in the journal; the scheduler's record of it is not
    crashing.close()
    clock.now = at(10, 6)
    restarted, _ = start(journal_dir, transport, clock)
    restarted.step()  # appends the 10:05 tick again: the same key
    assert tick_records(journal_dir) == ["schedule:report:2026-01-01T10:05:00Z"] * 2
    assert len(transport.deliveries) == 1  # the second is recorded as a duplicate, not pushed
    assert run(transport) == ["10:05"]
    settle(restarted)
    restarted.close()
    status = collect_status(str(journal_dir))
    assert (status["succeeded"], status["duplicates_suppressed"], status["pending"]) == (2, 1, 0)


@pytest.mark.parametrize(
    ("catchup", "options", "restart_at", "fired"),
    [
        (
            "all",
            {},
            at(11, 5, 30),
            [f"{h}:{m:02d}" for h, m in [(10, 10), (10, 15), (10, 20), (10, 25)]]
            + [f"{h}:{m:02d}" for h, m in [(10, 30), (10, 35), (10, 40), (10, 45), (10, 50), (10, 55)]]
            + ["11:00", "11:05"],
        ),
        ("all", {"max_catchup": 3}, at(11, 5, 30), ["10:55", "11:00", "11:05"]),
        ("latest", {}, at(11, 6, 30), ["11:05"]),
        ("none", {}, at(11, 5, 30), ["11:05"]),  # 30 s late: within grace_s (60 s)
        ("none", {}, at(11, 6, 30), []),  # 90 s late: missed
    ],
)
def test_catchup_after_an_hour_down(
    journal_dir: Path, catchup: str, options: dict[str, Any], restart_at: float, fired: list[str]
) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    declared = every5(catchup, **options)
    forwarder, _ = start(journal_dir, transport, clock, declared)
    forwarder.step()
    clock.now = at(10, 5)
    forwarder.step()
    forwarder.close()
    assert run(transport) == ["10:05"]
    clock.now = restart_at  # down for an hour
    forwarder, scheduler = start(journal_dir, transport, clock, declared)
    forwarder.step()
    assert run(transport) == fired
    clock.now = at(11, 10)  # and back on time afterwards
    forwarder.step()
    assert run(transport) == ["11:10"]
    settle(forwarder)
    forwarder.close()
    assert scheduler.ticks["report"].fired == 1 + len(fired) + 1


def test_two_forwarders_on_one_journal_take_turns_and_fire_each_tick_once(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    active, _ = start(journal_dir, transport, clock)
    active.step()
    standby = Forwarder(journal_dir, transport, clock=clock, schedules=Scheduler(journal_dir, [every5()]))
    with pytest.raises(JournalLocked, match="one forwarder per journal directory"):
        standby.open()  # one owner at a time: the lock, not the schedule, decides
    clock.now = at(10, 5)
    active.step()
    active.close()  # the active one stops (or dies): the standby's supervisor starts it again
    clock.now = at(10, 10)
    standby.open()
    standby.step()
    assert run(transport) == ["10:05", "10:10"]
    settle(standby)
    standby.close()


def test_two_journals_sharing_a_schedule_and_redis_run_each_tick_once(tmp_path: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()  # one Redis
    a, _ = start(tmp_path / "a", transport, clock)
    b, _ = start(tmp_path / "b", transport, clock)
    for now in (at(10, 2), at(10, 5), at(10, 10)):
        clock.now = now
        a.step()
        b.step()
    assert len(transport.deliveries) == 4  # each journal has its own job per tick...
    assert run(transport) == ["10:05", "10:10"]  # ...and the workers' key claim runs one
    settle(a)
    settle(b)
    a.close()
    b.close()
    both = [collect_status(str(tmp_path / j)) for j in ("a", "b")]
    assert sum(s["succeeded"] for s in both) == 4  # each journal's copy is finished
    assert all(s["pending"] == 0 for s in both)


def test_two_journals_run_a_tick_twice_if_redis_lost_its_outcome_in_between(tmp_path: Path) -> None:
    # What does not hold (docs/schedules.md): the second journal's copy is delivered after Redis
    # lost the first's stored outcome. One journal (one forwarder) is the exactly-once setup.
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    a, _ = start(tmp_path / "a", transport, clock)
    b, _ = start(tmp_path / "b", transport, clock)
    a.step()
    b.step()
    clock.now = at(10, 5)
    a.step()
    assert run(transport) == ["10:05"]
    settle(a)
    transport.forget()
    b.step()
    assert run(transport) == ["10:05"]
    settle(b)
    a.close()
    b.close()


def test_redis_losing_everything_between_ticks_reruns_nothing_and_skips_nothing(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    forwarder, _ = start(journal_dir, transport, clock)
    forwarder.step()
    clock.now = at(10, 5)
    forwarder.step()
    assert run(transport) == ["10:05"]
    settle(forwarder)
    clock.now = at(10, 7)
    forwarder.step()  # a pushed, unrun tick is lost with Redis too: see below
    transport.forget()  # FLUSHALL
    clock.now = at(10, 10)
    settle(forwarder)
    assert run(transport) == ["10:10"]
    settle(forwarder)
    forwarder.close()
    assert collect_status(str(journal_dir))["succeeded"] == 2


def test_a_tick_pushed_then_lost_with_redis_is_delivered_again(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    forwarder, _ = start(journal_dir, transport, clock)
    forwarder.step()
    clock.now = at(10, 5)
    forwarder.step()
    transport.forget()  # the queued tick is gone from Redis, not from the journal
    settle(forwarder)
    assert run(transport) == ["10:05"]
    settle(forwarder)
    forwarder.close()
    assert collect_status(str(journal_dir))["succeeded"] == 1


def test_a_tick_due_while_redis_is_down_is_journaled_meanwhile(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    forwarder, scheduler = start(journal_dir, transport, clock)
    forwarder.step()
    clock.now = at(10, 12)
    forwarder.step()  # the 10:10 tick
    hybridq.Queue(journal=journal_dir).enqueue("tests.tasks.add", 3, 4)  # something to push
    push = transport.push

    def down_until_1015(jobs: Any) -> Any:
        if clock.now < at(10, 15):
            clock.now = at(10, 15, 1)  # the outage outlasts the tick
            raise TransportError("down")
        return push(jobs)

    transport.push = down_until_1015  # type: ignore[method-assign]
    forwarder.step()  # the tick is appended while the push waits for Redis
    assert scheduler.ticks["report"].last == at(10, 15)
    forwarder.step()
    assert sorted(run(transport)) == ["10:10", "10:15", "job"]
    settle(forwarder)
    forwarder.close()
    assert collect_status(str(journal_dir))["succeeded"] == 3


def test_a_tick_due_while_a_long_backlog_is_forwarded_is_journaled_meanwhile(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    forwarder, scheduler = start(journal_dir, transport, clock, batch_size=2)
    forwarder.step()
    queue = hybridq.Queue(journal=journal_dir)
    for n in range(6):
        queue.enqueue("tests.tasks.add", n, n)
    clock.now = at(10, 4, 59)
    push = transport.push

    def slow(jobs: Any) -> Any:
        clock.now += 1.0  # each batch takes a second
        return push(jobs)

    transport.push = slow  # type: ignore[method-assign]
    forwarder.step()  # three batches: the tick at 10:05 comes due during the second
    assert scheduler.ticks["report"].last == at(10, 5)
    settle(forwarder)
    forwarder.close()


def test_ticks_have_their_own_small_journal_chain_so_their_segments_seal_and_go(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    forwarder, scheduler = start(journal_dir, transport, clock)
    forwarder.step()
    job = hybridq.Queue(journal=journal_dir).enqueue("tests.tasks.add", 1, 1)  # the process's chain
    clock.now = at(10, 5)
    forwarder.step()
    assert scheduler._writer is not None
    assert scheduler._writer.max_segment_bytes == TICK_SEGMENT_BYTES == 1 << 20
    forwarder.close()
    chains = {
        Envelope.from_bytes(r.payload).id: (r.writer_id, r.segment_index)
        for r in JournalReader(journal_dir).records()
    }
    [tick] = [c for job_id, c in chains.items() if job_id != job.id]
    assert tick[0] != chains[job.id][0]


def test_a_schedule_seen_first_after_a_restart_starts_then_and_a_removed_one_is_forgotten(
    journal_dir: Path,
) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    forwarder, _ = start(journal_dir, transport, clock, every5(key="old"))
    forwarder.step()
    forwarder.close()
    clock.now = at(11, 2)
    forwarder, _ = start(journal_dir, transport, clock, every5("all", key="new"))
    assert forwarder.step() == 0  # "new" starts now; "old" is no longer declared
    forwarder.close()
    assert set(load_ticks(str(journal_dir))) == {"new"}


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"cron": "*/5 * * *"}, "4 fields, expected 5"),
        ({"cron": "0 0 31 2 *"}, "never occurs"),
        ({"key": "has space"}, "bad schedule key"),
        ({"key": ""}, "bad schedule key"),
        ({"tz": "Mars/Olympus"}, "unknown time zone"),
        ({"catchup": "some"}, "catchup must be one of all, latest, none"),
        ({"max_catchup": 0}, "max_catchup must be"),
        ({"grace_s": -1}, "grace_s"),
        ({"queue": "no queue"}, "invalid queue name"),
        ({"func": "not_dotted"}, "func"),
        ({"args": [object()]}, "not JSON"),
        ({"ttl": 5}, "unknown option(s) ttl"),
        ({"meta": {"schedule": 1}}, "without the keys schedule, fire_time"),
        ({"retry": 3}, "retry must be a hybridq.Retry"),
    ],
)
def test_a_bad_schedule_is_one_line_at_registration(kwargs: dict[str, Any], says: str) -> None:
    declared = {"cron": "*/5 * * * *", "func": "tests.tasks.add", "key": "report", **kwargs}
    with pytest.raises(ScheduleError) as info:
        hybridq.schedule(**declared)
    message = str(info.value)
    assert says in message
    assert "\n" not in message
    assert schedules.registered() == []


def test_registering_the_same_schedule_again_is_fine_a_different_one_under_its_key_is_not() -> None:
    first = every5()
    assert every5() == first  # a module imported twice
    with pytest.raises(ScheduleError, match="registered already"):
        every5("all")
    assert schedules.registered() == [first]


def test_job_options_are_checked_before_the_forwarder_starts(journal_dir: Path) -> None:
    with pytest.raises(ScheduleError, match="job_timeout"):
        every5(job_timeout=0)
    bad = Schedule(key="bad", cron=every5().cron, func="tests.tasks.add", options={"job_timeout": -1})
    with pytest.raises(ScheduleError, match="schedule 'bad': job_timeout"):
        Scheduler(journal_dir, [bad])


def test_a_tick_runs_with_its_options_and_a_time_zone(journal_dir: Path) -> None:
    clock, transport = Clock(at(8, 58)), MemoryTransport()
    declared = hybridq.schedule(
        cron="0 10 * * *",
        func="tests.tasks.add",
        key="paris-ten",
        tz="Europe/Paris",  # 10:00 in Paris is 09:00 UTC in January
        queue="reports",
        job_timeout=30,
        meta={"team": "ops"},
        description="daily",
    )
    forwarder, _ = start(journal_dir, transport, clock, declared)
    forwarder.step()
    clock.now = at(9, 0)
    forwarder.step()
    [job_id] = transport.queues["reports"]
    env = transport.jobs[job_id]
    assert env.idempotency_key == "schedule:paris-ten:2026-01-01T09:00:00Z"
    assert (env.timeout_s, env.description) == (30, "daily")
    assert env.meta == {"team": "ops", "schedule": "paris-ten", "fire_time": "2026-01-01T09:00:00Z"}
    forwarder.close()


def test_a_tick_key_parses_back_and_other_keys_do_not() -> None:
    fired = dt.datetime(2026, 1, 1, 10, 5, tzinfo=dt.UTC)
    assert schedules.parse_tick_key(schedules.tick_key("digest", fired.timestamp())) == ("digest", fired)
    for other in ("upload:a.jpg", "schedule:bad key:2026-01-01T10:05:00Z", "schedule:digest:soon", "x"):
        assert schedules.parse_tick_key(other) is None


def test_a_damaged_state_file_is_an_error_not_a_fresh_start(journal_dir: Path) -> None:
    clock, transport = Clock(at(10, 2)), MemoryTransport()
    forwarder, _ = start(journal_dir, transport, clock)
    forwarder.step()
    forwarder.close()
    state = journal_dir / "schedules.state"
    state.write_bytes(state.read_bytes()[:-3] + b"xyz")
    forwarder, _ = start(journal_dir, transport, clock)
    with pytest.raises(hybridq.StateFileCorrupt):
        forwarder.step()
    forwarder.close()


@pytest.mark.parametrize(
    ("source", "says"),
    [
        (None, "cannot import schedules module"),
        ("import hybridq\nhybridq.schedule(cron='* * *', func='tests.tasks.add', key='k')\n", "3 fields"),
        ("x = 1\n", "registered no schedule"),
        ("raise RuntimeError('boom')\n", "failed: RuntimeError: boom"),
    ],
)
def test_forward_with_a_bad_schedules_module_is_one_line_exit_2_and_forwards_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str | None, says: str
) -> None:
    from click.testing import CliRunner
    from hybridq.cli import cli

    name = f"sched_{tmp_path.name.replace('-', '_')}"
    if source is not None:
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    journal = tmp_path / "journal"
    result = CliRunner().invoke(cli, ["forward", "--journal", str(journal), "--schedules", name])
    assert result.exit_code == 2, result.output
    [line] = result.output.splitlines()
    assert line.startswith("hybridq: error: ")
    assert says in line
    assert not journal.exists()
