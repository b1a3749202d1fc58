"""``hybridq.stats``: the ``status --json`` object from the forwarder's snapshot, equal to the scan."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hybridq
import pytest
from click.testing import CliRunner
from hybridq import Queue, Retry, requeue
from hybridq.cli import cli
from hybridq.envelope.model import Envelope
from hybridq.errors import JournalCorruption, JournalIOError
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import ChainPosition
from hybridq.journal.format import segment_name
from hybridq.journal.reader import list_chains
from hybridq.journal.repair import repair
from hybridq.journal.statefile import read_state, write_state
from hybridq.ledger.checkpoint import forwarder_holder
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import open_ledger_writer
from hybridq.lookup import pending_file
from hybridq.lookup.stats import STATS_NAME, PendingTracker, load_snapshot
from hybridq.ops.status import collect_status, stats
from hybridq.ops.status_counts import from_snapshot as _from_snapshot
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit import test_completions
from tests.unit.test_completions import Clock, settle, write_jobs

AGES = ("oldest_pending_age_s", "forwarding_lag_s")
_opened: list[Forwarder] = []


def make_forwarder(journal: Path, transport: MemoryTransport, **kwargs: Any) -> Forwarder:
    forwarder = test_completions.make_forwarder(journal, transport, **kwargs)
    _opened.append(forwarder)
    return forwarder


@pytest.fixture(autouse=True)
def _close_forwarders() -> Any:
    yield
    while _opened:
        _opened.pop().close()  # a failed assertion must not leak one (idempotent)


def same(journal: Path, *, cheap: bool = True) -> dict[str, Any]:
    """stats() and the full scan agree (ages to within a second); returns stats()."""
    running = forwarder_holder(str(journal)) is not None
    assert (_from_snapshot(str(journal), running=running) is not None) == cheap
    fast = stats(journal)
    slow = collect_status(str(journal))
    assert list(fast) == list(slow)
    for age in AGES:
        assert abs(fast.pop(age) - slow.pop(age)) < 1.0
    assert fast == slow
    return fast


def saved_count(journal: Path) -> Path:
    """The count a clean stop saves for the next start (hybridq.lookup.pending_file)."""
    return journal / "lookup" / "pending.state"


def fail_zero(env: Envelope, attempt: int) -> None:
    if env.args[0] == 0:
        raise ValueError("zero")


def fail_all(env: Envelope, attempt: int) -> None:
    raise ValueError("no")


def test_fresh_journal_without_a_forwarder_scans(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(5):
        queue.enqueue(tasks.add, i, i)
    out = same(journal_dir, cheap=False)
    assert out["accepted"] == 5
    assert out["not_yet_forwarded"] == 5


def test_forwarded_finished_failed_and_stopped(journal_dir: Path) -> None:
    a = Queue("a", journal=journal_dir)
    b = Queue("b", journal=journal_dir)
    for i in range(6):
        a.enqueue(tasks.add, i, i)
    b.enqueue(tasks.add, 1, 1, retry=Retry(max_attempts=3, backoff_s=100, jitter=False))
    b.enqueue(tasks.add, 2, 2, delay=3600)  # held by the forwarder
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    out = same(journal_dir)
    assert (out["forwarded"], out["delayed_held"], out["queues"]) == (7, 1, {"a": 6, "b": 2})
    transport.work("a", func=fail_zero, limit=4)  # one failure, three successes
    transport.work("b", func=fail_all)  # a retry
    forwarder.step()
    out = same(journal_dir)
    assert (out["succeeded"], out["failed"], out["retrying"], out["failed_listed"]) == (3, 1, 1, 1)
    assert out["queues"] == {"a": 2, "b": 2}
    forwarder.close()
    late = [a.enqueue(tasks.add, 9, 9) for _ in range(3)]  # the forwarder is not running
    out = same(journal_dir)
    assert out["not_yet_forwarded"] == 3
    assert out["queues"] == {"a": 5, "b": 2}
    assert out["forwarder"] is None
    assert len(late) == 3


def test_compacted_journal(journal_dir: Path) -> None:
    write_jobs(journal_dir, 300)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(limit=150, func=fail_zero)
    settle(forwarder)
    settle(forwarder)
    out = same(journal_dir)
    assert out["compacted_segments"] > 0
    assert (out["accepted"], out["pending"]) == (300, 150)
    transport.work()
    settle(forwarder)
    forwarder.close()
    out = same(journal_dir)
    assert (out["accepted"], out["succeeded"], out["failed"], out["pending"]) == (300, 299, 1, 0)


def test_a_restarted_forwarder_rebuilds_the_same_figures(journal_dir: Path) -> None:
    transport, before = stopped_midway(journal_dir)
    Queue("other", journal=journal_dir).enqueue(tasks.add, 2, 2)  # after the position: not read
    saved_count(journal_dir).unlink()  # as after a crash: the count is made again
    forwarder = make_forwarder(journal_dir, transport)
    assert not forwarder.state.pending_ready  # counted after the first push, a slice per step
    forwarder.state.count_pending(budget_s=60.0)
    rebuilt = forwarder.state.pending
    assert (rebuilt.consumed, rebuilt.pending, rebuilt.oldest()) == (
        before.consumed,
        before.queues,
        before.oldest_pending,
    )
    out = same(journal_dir)
    assert out["not_yet_forwarded"] == 1
    forwarder.step()
    forwarder.close()
    after = load_snapshot(str(journal_dir))
    assert after is not None
    assert (after.consumed, after.queues) == (before.consumed + 1, {"default": 50, "other": 2})
    same(journal_dir)


def test_a_requeue_by_another_process_falls_back_to_the_scan(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 0, 0)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(func=fail_zero)
    forwarder.step()
    same(journal_dir)
    requeue([job.id], journal=str(journal_dir))
    out = same(journal_dir, cheap=False)  # the forwarder has not read that ledger chain
    assert out["failed_listed"] == 0
    forwarder.close()


def test_a_missing_or_damaged_snapshot_means_the_scan(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    forwarder.step()
    forwarder.close()
    same(journal_dir)
    path = journal_dir / f"{STATS_NAME}.state"
    path.write_bytes(b"garbage")
    same(journal_dir, cheap=False)
    path.unlink()
    same(journal_dir, cheap=False)


def test_exact_scans_and_optional_keys(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    forwarder.step()
    forwarder.close()
    out = hybridq.stats(journal_dir, exact=True)
    assert "redis" not in out
    assert "outbox" not in out
    down = hybridq.stats(str(journal_dir), redis_url="redis://127.0.0.1:1/0")
    assert down["redis"] == {"url": "redis://127.0.0.1:1/0", "up": False, "waiting_for_a_worker": None}


def test_the_cli_prints_what_stats_returns(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    forwarder.step()
    forwarder.close()
    runner = CliRunner()
    for extra in ([], ["--exact"]):
        result = runner.invoke(cli, ["status", "--json", "--journal", str(journal_dir), *extra])
        assert result.exit_code == 0, result.output
        printed = json.loads(result.output)
        expected = stats(journal_dir)
        for age in AGES:
            assert abs(printed.pop(age) - expected.pop(age)) < 1.0
        assert printed == expected


def test_stats_and_the_cli_agree_in_the_same_environment(
    journal_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HYBRIDQ_REDIS_URL (and the other variables status reads) set: the same object (issue 27)."""
    import sqlite3

    from hybridq.outbox.schema import create_table

    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    make_forwarder(journal_dir, MemoryTransport()).step()
    password = tmp_path / "redis-password"
    password.write_text("s3cret\n")
    password.chmod(0o600)
    conn = sqlite3.connect(tmp_path / "app.db", isolation_level=None)
    create_table(conn, "hybridq_outbox")
    conn.close()
    env = {
        "HYBRIDQ_JOURNAL": str(journal_dir),
        "HYBRIDQ_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing listens: down, at once
        "HYBRIDQ_REDIS_PASSWORD_FILE": str(password),
        "HYBRIDQ_REDIS_FOR": "emails=redis://127.0.0.1:2/0",
        "HYBRIDQ_OUTBOX": f"sqlite:///{tmp_path / 'app.db'}",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, ["status", "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    assert {"redis", "redis_instances", "outbox"} <= set(printed)
    assert printed["redis"]["url"] == "redis://***@127.0.0.1:1/0"  # the password file's, hidden
    for out in (hybridq.stats(), hybridq.stats(journal_dir)):
        for age in AGES:
            assert abs(printed[age] - out.pop(age)) < 1.0
        out["outbox"].pop("oldest_age_s")
        assert out == {k: v for k, v in printed.items() if k not in AGES} | {
            "outbox": {k: v for k, v in printed["outbox"].items() if k != "oldest_age_s"}
        }
    # None leaves a part out whatever the environment says.
    bare = hybridq.stats(journal_dir, redis_url=None, outbox=None, redis_for=None)
    assert not {"redis", "redis_instances", "outbox"} & set(bare)


def test_the_tracker_forgets_records_of_a_step_that_failed() -> None:
    tracker = PendingTracker()
    for offset in range(64, 64 + 100 * 10, 10):
        tracker.saw(("w", 0, offset), ("q", float(offset)))
    tracker.done(("w", 0, 64))
    assert (tracker.consumed, tracker.pending, tracker.oldest()) == (100, {"q": 99}, 74.0)
    tracker.rewind({"w": ChainPosition(0, 64 + 10 * 50, 51)})
    assert (tracker.consumed, tracker.pending, tracker.oldest()) == (50, {"q": 49}, 74.0)
    tracker.saw(("w", 0, 64 + 10 * 50), ("q", 1.0))
    assert (tracker.consumed, tracker.pending, tracker.oldest()) == (51, {"q": 50}, 1.0)
    tracker.rewind({})
    assert (tracker.consumed, tracker.pending, tracker.oldest()) == (0, {}, None)


def test_the_forwarder_works_without_writing_its_snapshot(journal_dir: Path, monkeypatch: Any) -> None:
    def refuse(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hybridq.forwarder.snapshot.save_snapshot", refuse)
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder: Forwarder = make_forwarder(journal_dir, transport)
    assert forwarder.step() == 1
    forwarder.close()
    assert not os.path.exists(journal_dir / f"{STATS_NAME}.state")
    same(journal_dir, cheap=False)


@pytest.mark.parametrize("exact", [False, True])
def test_stats_of_a_missing_journal_is_an_error(tmp_path: Path, exact: bool) -> None:
    with pytest.raises(hybridq.JournalPathError):
        stats(tmp_path / "nope", exact=exact)


def test_delayed_jobs_held_then_released(journal_dir: Path) -> None:
    clock = Clock()
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 1, 1, run_at=clock.now + 60)
    queue.enqueue(tasks.add, 2, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    forwarder.step()
    out = same(journal_dir)
    assert (out["forwarded"], out["delayed_held"], out["pending"]) == (1, 1, 2)
    clock.now += 61
    forwarder.step()
    out = same(journal_dir)
    assert (out["forwarded"], out["delayed_held"], out["pending"]) == (2, 0, 2)
    transport.work()
    forwarder.step()
    forwarder.close()
    out = same(journal_dir)
    assert (out["succeeded"], out["pending"], out["queues"]) == (2, 0, {})


def test_a_step_that_failed_is_not_counted_until_it_is_read_again(
    journal_dir: Path, monkeypatch: Any
) -> None:
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 1, 1)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    forwarder.step()
    queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(5)])

    def broken(batch: object) -> None:
        raise RuntimeError("push failed")

    monkeypatch.setattr(forwarder, "_push", broken)
    with pytest.raises(RuntimeError, match="push failed"):
        forwarder.step()  # the 5 records were read, not pushed: read again at the next step
    monkeypatch.undo()
    # A save before they are read again (a held job falling due first) writes a snapshot.
    forwarder.state.save(0)
    out = same(journal_dir)
    assert (out["accepted"], out["not_yet_forwarded"], out["queues"]) == (6, 5, {"default": 6})
    forwarder.step()
    out = same(journal_dir)
    assert (out["accepted"], out["not_yet_forwarded"], out["forwarded"]) == (6, 0, 6)


def test_a_forwarder_that_stopped_before_its_snapshot_caught_up_means_the_scan(
    journal_dir: Path, monkeypatch: Any
) -> None:
    queue = Queue(journal=journal_dir)
    queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(4)])
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work(limit=2)
    forwarder.step()  # its ledger chain is in the snapshot now
    same(journal_dir)
    transport.work()

    def refuse(*_: object) -> None:
        raise OSError(28, "No space left on device")

    # Dies (stops) after recording outcomes and saving its checkpoint, before the snapshot.
    monkeypatch.setattr("hybridq.forwarder.snapshot.save_snapshot", refuse)
    forwarder.step()
    forwarder.close()
    monkeypatch.undo()
    out = same(journal_dir, cheap=False)
    assert (out["succeeded"], out["pending"]) == (4, 0)
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()  # a running forwarder writes it again
    out = same(journal_dir)
    assert (out["succeeded"], out["pending"]) == (4, 0)


def test_cancelled_jobs_count_the_same_in_stats_and_the_scan(journal_dir: Path) -> None:
    """A cancel settles a job as ``cancelled``: not pending any more, in the snapshot as in the scan."""
    queue = Queue(journal=journal_dir)
    pushed = queue.enqueue(tasks.add, 1, 2)
    kept = queue.enqueue(tasks.add, 3, 4)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    settle(forwarder)
    assert pushed.cancel() == "requested"
    assert same(journal_dir, cheap=False)["cancelled"] == 0  # a request file not taken in: the scan
    held = queue.enqueue(tasks.add, 5, 6, delay=3600)
    settle(forwarder)
    assert held.cancel() == "requested"
    settle(forwarder)
    transport.work()
    settle(forwarder)
    out = same(journal_dir)
    assert (out["cancelled"], out["succeeded"], out["pending"], out["cancels_pending"]) == (2, 1, 0, 0)
    assert kept.get_status() == "finished"


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Appended to each time a start counts the journal (rather than taking a saved count)."""
    calls: list[str] = []
    fill = pending_file.count_into

    def counting(tracker: PendingTracker, *args: Any, **kwargs: Any) -> Iterator[None]:
        calls.append("fill")  # once it is read from, not when it is made
        yield from fill(tracker, *args, **kwargs)

    monkeypatch.setattr(pending_file, "count_into", counting)
    return calls


def taken(forwarder: Forwarder, counts: list[str]) -> bool:
    """Whether the start took a saved count: its first slice joins it, nothing counted."""
    before = len(counts)
    forwarder.state.count_pending(budget_s=0)
    if not forwarder.state.pending_ready:
        forwarder.state.count_pending(budget_s=60.0)
    return len(counts) == before


def stopped_midway(journal: Path) -> tuple[MemoryTransport, Any]:
    """121 jobs read, 70 of them run, the forwarder stopped cleanly; and its last snapshot."""
    write_jobs(journal, 120)
    Queue("other", journal=journal).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal, transport)
    forwarder.step()
    transport.work(limit=70)
    settle(forwarder)
    forwarder.close()
    before = load_snapshot(str(journal))
    assert before is not None
    return transport, before


def test_a_clean_stop_saves_the_count_and_the_next_start_takes_it(
    journal_dir: Path, counts: list[str]
) -> None:
    # Fails before: every start counted the jobs read before it again (a JSON parse per record
    # of the live journal: seconds at a million, the stats snapshot and the loop's idling waiting).
    transport, before = stopped_midway(journal_dir)
    assert saved_count(journal_dir).exists()
    forwarder = make_forwarder(journal_dir, transport)
    assert saved_count(journal_dir).exists()  # not read before the first push
    assert taken(forwarder, counts)  # nothing counted
    assert forwarder.state.pending_ready
    assert not saved_count(journal_dir).exists()  # read once: never taken by a later start
    count = forwarder.state.pending
    assert (count.consumed, count.pending, count.oldest()) == (
        before.consumed,
        before.queues,
        before.oldest_pending,
    )
    Queue("other", journal=journal_dir).enqueue(tasks.add, 2, 2)
    forwarder.step()
    transport.work()
    settle(forwarder)
    assert forwarder.state.pending.pending == {"other": 2}  # the outcomes since are applied to it
    same(journal_dir)
    forwarder.close()


def test_a_saved_count_is_not_taken_once_the_ledger_changed(journal_dir: Path, counts: list[str]) -> None:
    # Another process's outcome after the stop (here a job of the saved count finishing): the
    # count would be wrong, so the start counts again and gets it right.
    transport, before = stopped_midway(journal_dir)
    waiting = next(d for d in transport.deliveries.values() if d.envelope.queue == "other")  # never run
    writer = open_ledger_writer(str(journal_dir))
    writer.append_many(
        [Entry("done", waiting.envelope.id, waiting.loc, outcome="succeeded", at=1.0).to_bytes()]
    )
    writer.close()
    forwarder = make_forwarder(journal_dir, transport)
    assert not taken(forwarder, counts)
    assert sum(forwarder.state.pending.pending.values()) == sum(before.queues.values()) - 1
    forwarder.close()


def test_a_saved_count_is_not_taken_after_a_repair_dropped_records_before_the_positions(
    journal_dir: Path, counts: list[str]
) -> None:
    # Bit rot in a sealed segment long before the positions, dropped by `journal repair
    # --accept-loss` (the segment cut there, the chain's later ones removed): the positions, the
    # ledger and the compaction state are unchanged, but the count is not.
    transport, _ = stopped_midway(journal_dir)
    [(writer, segments)] = [(w, s) for w, s in list_chains(str(journal_dir)).items() if len(s) > 1]
    path = journal_dir / segment_name(writer, segments[len(segments) // 2])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    repair(str(journal_dir), accept_loss=True)
    forwarder = make_forwarder(journal_dir, transport)
    assert not taken(forwarder, counts)
    assert sum(forwarder.state.pending.pending.values()) == collect_status(str(journal_dir))["pending"]
    forwarder.close()


@pytest.mark.parametrize("damage", [b"", b"garbage" * 50])
def test_a_damaged_saved_count_is_ignored(journal_dir: Path, damage: bytes, counts: list[str]) -> None:
    transport, before = stopped_midway(journal_dir)
    path = saved_count(journal_dir)
    path.write_bytes(path.read_bytes()[:-100] + damage)
    forwarder = make_forwarder(journal_dir, transport)
    assert not taken(forwarder, counts)
    assert forwarder.state.pending.pending == before.queues
    forwarder.close()


@pytest.mark.parametrize("version", [1, 2])
def test_a_saved_count_of_an_older_format_is_ignored(
    journal_dir: Path, version: int, counts: list[str]
) -> None:
    # A file of the format before the per-queue sums (2), or before the blocks (1), left by an
    # older forwarder: its columns would read as something else, so it is counted again.
    transport, before = stopped_midway(journal_dir)
    lookup = os.path.join(journal_dir, "lookup")
    payload = read_state(lookup, pending_file.NAME)
    (n,) = struct.unpack_from("<I", payload)
    key = json.loads(payload[4 : 4 + n])
    assert key["v"] == 3
    key["v"] = version
    raw = json.dumps(key, sort_keys=True).encode()
    write_state(lookup, pending_file.NAME, struct.pack("<I", len(raw)) + raw + payload[4 + n :])
    forwarder = make_forwarder(journal_dir, transport)
    assert not taken(forwarder, counts)
    assert not saved_count(journal_dir).exists()  # read once, deleted
    assert forwarder.state.pending.pending == before.queues
    forwarder.close()


def test_a_start_after_a_crash_counts_again(journal_dir: Path, tmp_path: Path, counts: list[str]) -> None:
    # The saved count is read once and deleted: a forwarder that took it and then died (its
    # files copied while it runs: what a crash leaves) is followed by a start that counts.
    transport, _ = stopped_midway(journal_dir)
    forwarder = make_forwarder(journal_dir, transport)
    assert taken(forwarder, counts)
    transport.work(limit=20)
    settle(forwarder)
    crashed = tmp_path / "crashed"
    shutil.copytree(journal_dir, crashed, ignore=shutil.ignore_patterns("*.sock"))
    forwarder.close()
    (crashed / "forwarder.lock").unlink(missing_ok=True)
    after = make_forwarder(crashed, transport)
    assert not taken(after, counts)
    assert after.state.pending.pending == {"default": 30, "other": 1}
    after.close()


def test_a_start_that_failed_before_its_count_saves_none(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its close saved the empty count it had not begun: the next start, the files unchanged,
    # would have taken it and counted no job read before.
    stopped_midway(journal_dir)
    saved_count(journal_dir).unlink()

    def broken(*_args: object) -> None:
        raise JournalCorruption("ledger", 0, reason="damaged for this test")

    with monkeypatch.context() as m:
        m.setattr("hybridq.forwarder.state.resume", broken)  # the ledger's replay
        with pytest.raises(JournalCorruption):
            make_forwarder(journal_dir, MemoryTransport())
    assert not saved_count(journal_dir).exists()


def test_outcomes_harvested_before_the_saved_count_is_read_are_applied_to_it(
    journal_dir: Path, counts: list[str]
) -> None:
    # The first step harvests before its count slice reads the saved count: those outcomes were
    # lost, and their jobs stayed pending in the figures (found by test_start_count.py).
    transport, _ = stopped_midway(journal_dir)
    transport.work()  # the other 50 run while no forwarder does: their outcomes wait
    counted = len(counts)
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()  # the harvest, then the first slice: the saved count
    assert forwarder.state.pending_ready
    assert len(counts) == counted  # taken, not counted
    assert forwarder.state.pending.pending == {"other": 1}
    same(journal_dir)
    forwarder.close()


def test_a_full_disk_at_the_stop_saves_no_count_and_the_stop_goes_on(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*_args: object) -> None:
        raise JournalIOError("pending.state", "write", OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr("hybridq.lookup.pending_file.write_state", full)
    stopped_midway(journal_dir)  # its close() did not raise
    assert not saved_count(journal_dir).exists()
    assert forwarder_holder(str(journal_dir)) is None  # the lock was released
