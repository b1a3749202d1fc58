"""The forwarder's per-step costs while completions stream in (issue 15's burn-down).

A stream of harvests publishes the terminal count (a checkpoint save: three fsyncs) at most every
``PUBLISH_TERMINAL_S``, and publishes what is left when the loop idles or the forwarder closes;
the stats snapshot is rewritten in place, not replaced by a rename (which made ext4 flush it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder import loop as forwarder_mod
from hybridq.forwarder import maintain
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.lookup.stats import STATS_NAME, load_snapshot
from hybridq.transport import MemoryTransport

from tests import tasks


def _forwarder(journal: Path, transport: MemoryTransport) -> Forwarder:
    forwarder = Forwarder(
        journal, transport, backoff_initial_s=0.001, backoff_max_s=0.002, reconcile_interval_s=3600.0
    )
    forwarder.open()
    return forwarder


def _count_saves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    saves: list[int] = []
    real = forwarder_mod.Forwarder._save

    def counted(self: Forwarder, forwarded: int) -> None:
        saves.append(forwarded)
        real(self, forwarded)

    monkeypatch.setattr(forwarder_mod.Forwarder, "_save", counted)
    return saves


def test_a_stream_of_harvests_publishes_the_terminal_count_at_most_every_interval(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(20):
        queue.enqueue(tasks.add, i, i)
    transport = MemoryTransport()
    forwarder = _forwarder(journal_dir, transport)
    forwarder.step()  # pushes the 20 (and saves for that)
    saves = _count_saves(monkeypatch)
    monkeypatch.setattr(maintain, "PUBLISH_TERMINAL_S", 3600.0)
    for _ in range(10):
        transport.work(limit=2)
        forwarder.step()
    # The first harvest publishes at once; the nine after it wait for the interval.
    assert saves == [0]
    assert load_checkpoint(str(journal_dir)).terminal == 2  # type: ignore[union-attr]
    forwarder.close()  # publishes what is left
    assert saves == [0, 0]
    assert load_checkpoint(str(journal_dir)).terminal == 20  # type: ignore[union-attr]


def test_a_pending_publication_is_made_once_the_interval_has_passed(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(4):
        queue.enqueue(tasks.add, i, i)
    transport = MemoryTransport()
    forwarder = _forwarder(journal_dir, transport)
    forwarder.step()
    monkeypatch.setattr(maintain, "PUBLISH_TERMINAL_S", 0.0)
    transport.work(limit=1)
    forwarder.step()
    transport.work(limit=3)
    forwarder.step()
    assert load_checkpoint(str(journal_dir)).terminal == 4  # type: ignore[union-attr]
    forwarder.close()


def test_the_stats_snapshot_is_rewritten_in_place(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    queue.enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = _forwarder(journal_dir, transport)
    forwarder.step()
    path = journal_dir / f"{STATS_NAME}.state"
    inode = os.stat(path).st_ino
    transport.work()
    forwarder.step()
    forwarder.close()
    assert os.stat(path).st_ino == inode  # no rename: ext4 would flush the new file
    snapshot = load_snapshot(str(journal_dir))
    assert snapshot is not None
    assert snapshot.outcomes.get("succeeded") == 1
    assert not any(name.startswith(STATS_NAME) and name.endswith(".tmp") for name in os.listdir(journal_dir))


def test_a_pending_publication_is_made_while_redis_is_down_and_the_loop_does_not_spin(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count is local state: an outage must neither hold it back nor make the wait zero."""
    import threading
    import time

    queue = Queue(journal=journal_dir)
    for i in range(4):
        queue.enqueue(tasks.add, i, i)
    transport = MemoryTransport()
    forwarder = Forwarder(
        journal_dir, transport, backoff_initial_s=0.5, backoff_max_s=5.0, reconcile_interval_s=3600.0
    )
    forwarder.open()
    forwarder.step()
    transport.work(limit=1)
    forwarder.step()  # the first harvest publishes at once
    transport.work(limit=3)
    forwarder.step()  # the second waits for the interval
    assert load_checkpoint(str(journal_dir)).terminal == 1  # type: ignore[union-attr]
    transport.down = True  # Redis goes away while the publication is pending
    steps: list[int] = []
    real = Forwarder.step

    def counted(self: Forwarder) -> int:
        steps.append(1)
        return real(self)

    monkeypatch.setattr(Forwarder, "step", counted)
    thread = threading.Thread(target=forwarder.run)
    thread.start()
    time.sleep(1.0)
    forwarder.stop()
    thread.join(10)
    assert load_checkpoint(str(journal_dir)).terminal == 4  # type: ignore[union-attr]
    assert len(steps) < 50, len(steps)  # before: thousands (the wait was zero)
    forwarder.close()
