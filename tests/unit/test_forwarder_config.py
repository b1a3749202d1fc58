"""The forwarder's options: one frozen ForwarderConfig, or the same options as keywords."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.errors import ConfigError
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.transport import MemoryTransport

from tests import tasks


def test_a_config_object_and_keywords_make_the_same_forwarder(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(5)]
    transport = MemoryTransport()
    config = ForwarderConfig(batch_size=2, lease_s=30.0)
    with Forwarder(journal_dir, transport, config) as forwarder:
        assert forwarder.config is config
        assert forwarder.config == Forwarder(journal_dir, transport, batch_size=2, lease_s=30.0).config
        assert forwarder.step() == 5
        assert forwarder.stats.batches == 3  # of two jobs at most
    assert list(transport.queues["default"]) == [j.id for j in jobs]
    assert load_checkpoint(str(journal_dir)).forwarded == 5


def test_the_config_is_frozen_and_checked_when_made(journal_dir: Path) -> None:
    config = ForwarderConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lease_s = 1.0  # type: ignore[misc]
    assert config.reconcile_every_s == 2.0  # a fifth of the lease, at least 1 s
    with pytest.raises(ValueError, match="batch_size"):
        ForwarderConfig(batch_size=0)
    with pytest.raises(ConfigError, match="too short"):
        ForwarderConfig(lease_s=10.0, key_ttl_s=60.0)


def test_a_config_and_keywords_together_are_refused(journal_dir: Path) -> None:
    with pytest.raises(TypeError, match="not both"):
        Forwarder(journal_dir, MemoryTransport(), ForwarderConfig(), lease_s=30.0)
    with pytest.raises(TypeError):
        Forwarder(journal_dir, MemoryTransport(), lease=30.0)  # a misspelt option
    assert not journal_dir.exists()  # refused before anything is created


@pytest.mark.parametrize("every", [-1.0, 0.001, 0.19, 3601.0, float("nan")])
def test_a_stats_interval_out_of_range_is_refused(every: float) -> None:
    with pytest.raises(ValueError, match="stats_every_s"):
        ForwarderConfig(stats_every_s=every)


def test_the_memory_transport_takes_no_stats_snapshot_and_forwarding_goes_on(journal_dir: Path) -> None:
    """The port's default publishes nowhere: a transport without a shared place is not an error.

    Nor a reason to wake: the idle wait ended for each snapshot due (test_completions saw it).
    """
    Queue("q", journal=journal_dir).enqueue(tasks.add, 1, 2)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport, stats_every_s=0.2) as forwarder:
        forwarder.step()
        assert forwarder.publisher.published == 0
        assert forwarder.publisher.due_at() is None
        assert forwarder.publisher.figures()["accepted"] == 1
        assert forwarder.publisher.figures()["queues"] == {"q": 1}
    assert transport.read_stats(10) == []


def test_forward_refuses_a_stats_interval_below_the_minimum_in_one_line() -> None:
    """--stats-every 0.001 would publish to Redis a thousand times a second per forwarder."""
    from click.testing import CliRunner
    from hybridq.cli import cli

    result = CliRunner().invoke(cli, ["forward", "--journal", "/nonexistent/j", "--stats-every", "0.001"])
    assert result.exit_code == 2, result.output
    assert "0 (never) or from 0.2" in result.output


def test_the_first_stats_snapshot_reads_only_what_the_forwarder_has_not(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It counted every record of the journal again, inside the forwarder's loop (1.2 s measured
    on a 79 MB journal); the forwarder already knows how many it has read."""
    from hybridq.journal import JournalReader

    queue = Queue("q", journal=journal_dir)
    for i in range(50):
        queue.enqueue(tasks.add, i, i)
    checked: list[int] = []
    real_check = JournalReader.check

    def spy(self: JournalReader, since: Any = None) -> int:
        checked.append(real_check(self, since))
        return checked[-1]

    with Forwarder(journal_dir, MemoryTransport(), stats_every_s=0) as forwarder:
        forwarder.step()
        monkeypatch.setattr(JournalReader, "check", spy)
        assert forwarder.publisher.figures()["accepted"] == 50
        assert sum(checked) == 0, f"{sum(checked)} records read again for the snapshot"
        queue.enqueue(tasks.add, 1, 1)
        figures = forwarder.publisher.figures()
        assert (figures["accepted"], figures["not_yet_forwarded"]) == (51, 1)
        assert sum(checked) == 1
