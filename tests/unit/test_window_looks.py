"""When the forwarder reads Redis's queue lengths (docs/forwarder.md, "The window").

A step reads the lengths right before a job it just read may go to Redis (so that push is sized
from fresh lengths, including the read jobs' own queues), and an idle step reads them once, in
its maintenance. The transport counts its calls: what the RQ transport sends as ``LLEN``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybridq.forwarder import Forwarder
from hybridq.transport.base import Delivery, PushResult

from tests.unit.test_window import WindowedTransport, enqueue, forwarder


class CountingTransport(WindowedTransport):
    """Records each length read and push, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def queue_lengths(self, queues: Sequence[str]) -> dict[str, int]:
        self.calls.append("lengths:" + ",".join(queues))
        return super().queue_lengths(queues)

    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        self.calls.append("push")
        return super().push(jobs)


def windowed(journal: Path, transport: CountingTransport) -> Forwarder:
    return forwarder(journal, transport, window_min=100, window_max=100)


def test_an_idle_step_reads_the_queue_lengths_once(journal_dir: Path) -> None:
    enqueue(journal_dir, 10)
    transport = CountingTransport()
    f = windowed(journal_dir, transport)
    try:
        f.step()
        assert len(transport.queues["default"]) == 10
        transport.calls.clear()
        f.step()  # no new record, nothing waiting on disk
        assert transport.calls == ["lengths:default"]
    finally:
        f.close()


def test_jobs_just_read_are_pushed_against_fresh_lengths(journal_dir: Path) -> None:
    enqueue(journal_dir, 100)
    transport = CountingTransport()
    f = windowed(journal_dir, transport)
    try:
        f.step()  # the window is full: 100 in Redis, and the last look saw them
        transport.work("default")  # the workers drain it between two steps
        enqueue(journal_dir, 100)
        transport.calls.clear()
        f.step()
        # Read fresh (length 0), the 100 new jobs go straight to Redis: none through the run
        # table. Sized from the last step's length (100), all 100 would have waited on disk.
        assert transport.calls[:2] == ["lengths:default", "push"]
        assert f.backlog.refilled == 0
        assert len(transport.queues["default"]) == 100
    finally:
        f.close()


def test_a_queue_first_seen_in_the_records_just_read_is_sized_from_its_length(journal_dir: Path) -> None:
    enqueue(journal_dir, 100)
    transport = CountingTransport()
    f = windowed(journal_dir, transport)
    f.step()  # 100 in Redis
    f.close()
    enqueue(journal_dir, 100)
    f = windowed(journal_dir, transport)  # a restart: its windows know no queue yet
    try:
        transport.calls.clear()
        f.step()
        # The read jobs' queue is looked at before they go: Redis holds a full window already,
        # so they wait on disk rather than doubling it.
        assert transport.calls[0] == "lengths:default"
        assert len(transport.queues["default"]) == 100
        assert f.state.runs.waiting("default") == 100
    finally:
        f.close()
