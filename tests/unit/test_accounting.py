"""Issue 12.8: three suspected accounting bugs, each checked by a test (fixed where real)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridq import Queue, failed_jobs
from hybridq.cli import EXIT_ERROR, cli
from hybridq.errors import ConfigError
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import FileOps, JournalWriter, crashpoints
from hybridq.journal.reader import list_chains
from hybridq.ops.status import collect_status
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport

from tests import tasks


class Died(BaseException):
    """The forwarder process dies here (a SIGKILL at a crash point, in-process)."""


def make_forwarder(journal: Path, transport: MemoryTransport, **kwargs: object) -> Forwarder:
    kwargs.setdefault("backoff_initial_s", 0.001)
    kwargs.setdefault("backoff_max_s", 0.002)
    kwargs.setdefault("reconcile_interval_s", 0.0)
    kwargs.setdefault("lease_s", 0.0)
    forwarder = Forwarder(journal, transport, **kwargs)  # type: ignore[arg-type]
    forwarder.open()
    return forwarder


def settle(forwarder: Forwarder, steps: int = 5) -> None:
    assert forwarder.completions is not None
    for _ in range(steps):
        forwarder.completions.hurry()
        forwarder.step()


def test_a_lost_entry_is_counted_once_when_the_forwarder_dies_before_the_push(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, max_lost=2)
    forwarder.step()
    delivery = transport.take("default")
    assert delivery is not None
    transport.kill(delivery)  # its worker vanished once

    def die(name: str) -> None:
        if name == "redeliver_after_ledger":
            raise Died

    monkeypatch.setattr(crashpoints, "reached", die)
    with pytest.raises(Died):
        settle(forwarder)  # the `lost` entry is durable, the next attempt not pushed
    forwarder.close()
    monkeypatch.undo()
    assert transport.deliveries[job.id].attempt == 1
    forwarder = make_forwarder(journal_dir, transport, max_lost=2)
    settle(forwarder)
    # Before the fix: lost twice, so with max_lost=2 it failed for good without a second run.
    assert [f.error for f in failed_jobs(str(journal_dir))] == []
    assert forwarder.completions is not None
    assert list(forwarder.completions.index.lost.values()) == [(1, 1)]  # attempt 1, lost once
    assert transport.deliveries[job.id].attempt == 2
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert collect_status(str(journal_dir))["succeeded"] == 1


def test_a_worker_that_vanishes_again_after_a_restart_is_still_counted(journal_dir: Path) -> None:
    """The other side of the fix above: a forwarder restart forgives at most one vanish."""
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, max_lost=2)
    forwarder.step()
    for round_ in range(2):
        delivery = transport.take("default")
        assert delivery is not None
        transport.kill(delivery)
        settle(forwarder)
        if round_ == 0:
            forwarder.close()  # a clean restart between the two vanishes
            forwarder = make_forwarder(journal_dir, transport, max_lost=2)
    forwarder.close()
    [failed] = failed_jobs(str(journal_dir))
    assert "vanished 2 times" in (failed.error or "")


class RotationHook(FileOps):
    """Runs ``hook`` when the writer renames its next segment into place (after sealing the last)."""

    def __init__(self) -> None:
        self.hook: Callable[[], None] | None = None

    def replace(self, src: str, dst: str) -> None:
        hook, self.hook = self.hook, None
        if hook is not None and dst.endswith(".wal"):
            hook()
        super().replace(src, dst)


def test_compaction_between_a_writers_seal_and_its_next_segment_inflates_no_count(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    ops = RotationHook()
    writer = JournalWriter(journal_dir, max_segment_bytes=4096, fileops=ops)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    compacted_between: list[int] = []

    def compact_now() -> None:
        # Segment 0 is sealed and segment 1 not created yet: everything in 0 runs and is
        # compacted, and its chain has no file at this instant.
        settle(forwarder)
        transport.work()
        settle(forwarder)
        compacted_between.append(len(list_chains(str(journal_dir))))

    jobs = 0
    try:
        writer.append(queue.prepare(tasks.add, (0, 0)).to_bytes())
        jobs += 1
        ops.hook = compact_now
        while ops.hook is not None:  # until the writer rotates
            writer.append(queue.prepare(tasks.add, (jobs, 0)).to_bytes())
            jobs += 1
        for i in range(3):
            writer.append(queue.prepare(tasks.add, (i, 1)).to_bytes())
            jobs += 1
    finally:
        writer.close()
    assert compacted_between == [0]  # the race happened: the chain was gone at that instant
    settle(forwarder)  # the jobs of segment 1 are forwarded, not run yet
    assert forwarder.completions is not None
    done_before = forwarder.completions.terminal_total
    assert 0 < done_before < jobs
    # A late duplicate of a job of the compacted segment 0 (delivered again, reported "dup"):
    # its chain is present again, yet the job is counted in the compaction state already.
    early = next(d for d in transport.deliveries.values() if d.loc[1] == 0)
    transport.run(early)
    settle(forwarder)
    assert forwarder.completions.terminal_total == done_before
    forwarder.close()
    forwarder = make_forwarder(journal_dir, transport)  # restart while segment 1 is live
    try:
        assert forwarder.completions is not None
        # Before the fix the ledger entries of the compacted segment 0 counted again (its chain,
        # forgotten at the race, is present again): terminal twice the truth.
        assert forwarder.completions.terminal_total == done_before
        transport.work()
        settle(forwarder)
        assert forwarder.completions.terminal_total == jobs
    finally:
        forwarder.close()
    status = collect_status(str(journal_dir))
    assert (status["accepted"], status["succeeded"], status["pending"]) == (jobs, jobs, 0)


@pytest.mark.parametrize(("lease_s", "key_ttl_s"), [(10.0, 60.0), (10.0, 119.0), (60.0, 600.0)])
def test_a_key_ttl_too_short_for_the_done_grace_is_refused(
    journal_dir: Path, lease_s: float, key_ttl_s: float
) -> None:
    # A "done" job (outcome stored, event lost) waits max(60 s, 6 leases) before it is delivered
    # again to report that outcome; a key expiring first made it "orphaned", and it ran again.
    with pytest.raises(ConfigError, match="too short"):
        Forwarder(journal_dir, MemoryTransport(), lease_s=lease_s, key_ttl_s=key_ttl_s)
    assert not journal_dir.exists()  # refused before anything is created
    Forwarder(journal_dir, MemoryTransport(), lease_s=lease_s, key_ttl_s=2 * max(60.0, 6 * lease_s))


def test_the_forward_command_refuses_a_short_key_ttl_in_one_line(journal_dir: Path) -> None:
    result = CliRunner().invoke(
        cli,
        ["forward", "--journal", str(journal_dir), "--redis", "redis://127.0.0.1:1/0", "--key-ttl", "30"],
    )
    assert result.exit_code == EXIT_ERROR
    assert result.output.strip().count("\n") == 0
    assert "key TTL 30 s is too short for a 10 s lease: it must be at least 120 s" in result.output


def test_why_the_key_ttl_floor_an_outcome_expiring_within_the_done_grace_reruns_the_job(
    journal_dir: Path,
) -> None:
    """The hazard the floor above refuses, shown directly (passes on any version: a demonstration)."""
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work()
    transport.events.clear()  # its completion event was lost: the job is "done" in Redis
    settle(forwarder, steps=1)  # seen "done": the grace period starts
    transport.results.clear()  # the key TTL ran out within the grace
    settle(forwarder)  # now it reads "orphaned": a lost entry and a new attempt
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {job.id: 2}  # a finished job ran again


def test_a_finished_job_whose_chain_was_compacted_away_reads_finished(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    _close_writers()  # its segment is sealed: once the job is done, it can be compacted
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert list_chains(str(journal_dir)) == {}  # compacted, and its chain forgotten
    assert job.get_status() == "finished"  # "accepted" before the fix
