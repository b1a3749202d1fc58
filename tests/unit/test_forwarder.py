"""The forwarder against the in-memory transport: no loss, bounded duplicates, delays, outages."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.errors import JournalCorruption, JournalIOError, JournalLocked
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.fileops import FileOps
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.ops.status import collect_status
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport

from tests import tasks


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_forwarder(journal: Path, transport: MemoryTransport, **kwargs) -> Forwarder:
    kwargs.setdefault("backoff_initial_s", 0.001)
    kwargs.setdefault("backoff_max_s", 0.002)
    forwarder = Forwarder(journal, transport, **kwargs)
    forwarder.open()
    return forwarder


def queued_ids(transport: MemoryTransport, queue: str = "default") -> list[str]:
    return list(transport.queues.get(queue, []))


def test_every_job_is_forwarded_once_in_order(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(1234)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, batch_size=100)
    try:
        assert forwarder.step() == 1234
        assert forwarder.step() == 0
    finally:
        forwarder.close()
    assert queued_ids(transport) == [j.id for j in jobs]
    assert load_checkpoint(str(journal_dir)).forwarded == 1234
    assert jobs[-1].get_status() == "forwarded"


def test_jobs_go_to_their_own_queues(journal_dir: Path) -> None:
    Queue("a", journal_dir).enqueue(tasks.add, 1, 1)
    Queue("b", journal_dir).enqueue(tasks.add, 2, 2)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()
    assert {q: len(ids) for q, ids in transport.queues.items()} == {"a": 1, "b": 1}


def test_while_the_transport_is_down_the_checkpoint_does_not_move(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(10)]
    transport = MemoryTransport()
    transport.down = True
    forwarder = make_forwarder(journal_dir, transport)
    runner = threading.Thread(target=forwarder.step)
    runner.start()
    while forwarder.stats.transport_failures < 5:
        pass
    saved = load_checkpoint(str(journal_dir))
    assert saved is not None
    assert (saved.positions, saved.forwarded) == ({}, 0)  # nothing durable claims they were forwarded
    transport.down = False
    runner.join(timeout=10)
    forwarder.close()
    assert queued_ids(transport) == [j.id for j in jobs]
    assert forwarder.stats.down_since is None


def test_a_partial_push_is_repeated_without_queueing_twice(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(50)]
    transport = MemoryTransport()
    transport.fail_next(2, after=20)  # 20 jobs land, then the connection "drops"; twice
    with Forwarder(journal_dir, transport, backoff_initial_s=0.001) as forwarder:
        forwarder.step()
    assert queued_ids(transport) == [j.id for j in jobs]
    assert load_checkpoint(str(journal_dir)).duplicate_pushes == 20


def test_a_crash_before_the_checkpoint_costs_at_most_one_batch_of_duplicates(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(300)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, batch_size=100)
    original_save = forwarder._save
    saves = 0

    def crash_on_second_save(n: int) -> None:
        nonlocal saves
        saves += 1
        if saves == 2:
            raise SystemExit("crash between push and checkpoint")
        original_save(n)

    forwarder._save = crash_on_second_save  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        forwarder.step()
    forwarder.close()
    again = make_forwarder(journal_dir, transport, batch_size=100)
    try:
        again.step()
    finally:
        again.close()
    assert queued_ids(transport) == [j.id for j in jobs]  # none lost, none queued twice
    assert again.stats.duplicate_pushes == 100  # exactly the batch whose checkpoint was lost


def test_delayed_jobs_are_held_durably_and_pushed_when_due(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    clock = Clock()
    later = queue.enqueue(tasks.add, 1, 1, run_at=clock.now + 60)
    now = queue.enqueue(tasks.add, 2, 2)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    forwarder.step()
    assert queued_ids(transport) == [now.id]
    assert later.get_status() == "scheduled"
    forwarder.close()
    # A restart (even with Redis emptied) still holds it: the hold is in the durable checkpoint.
    transport.forget()
    clock.now += 61
    again = make_forwarder(journal_dir, transport, clock=clock)
    try:
        again.step()
    finally:
        again.close()
    # The held job is pushed when due; the emptied "Redis" also gets back the job it lost.
    assert sorted(queued_ids(transport)) == sorted([later.id, now.id])
    assert load_checkpoint(str(journal_dir)).held == []


def test_a_record_that_is_not_an_envelope_is_skipped_loudly(journal_dir: Path, caplog) -> None:
    with JournalWriter(journal_dir) as writer:
        writer.append(b'{"not": "an envelope"}')
    good = Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()
    assert queued_ids(transport) == [good.id]
    assert load_checkpoint(str(journal_dir)).invalid == 1
    assert "not a valid job envelope" in caplog.text


def test_a_second_forwarder_is_refused_naming_the_holder(journal_dir: Path) -> None:
    Queue(journal=journal_dir)
    with Forwarder(journal_dir, MemoryTransport()):
        with pytest.raises(JournalLocked) as info:
            Forwarder(journal_dir, MemoryTransport()).open()
        assert "forwarder pid" in str(info.value)


def _rot(journal_dir: Path) -> None:
    segment = next(p for p in journal_dir.glob("*.wal") if p.stat().st_size > 100)
    raw = bytearray(segment.read_bytes())
    raw[100] ^= 0xFF
    segment.chmod(0o600)
    segment.write_bytes(bytes(raw))
    segment.chmod(0o400)


def test_a_corrupt_journal_stops_the_forwarder_before_anything_is_forwarded(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    for i in range(5):
        queue.enqueue(tasks.add, i, i)
    _close_writers()  # seal the producer's segment: damage in a sealed segment is corruption
    _rot(journal_dir)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder, pytest.raises(JournalCorruption):
        forwarder.step()  # start-up reads only the tails: the reader meets the damage first
    assert queued_ids(transport) == []


def test_bit_rot_in_a_forwarded_segment_stops_the_forwarder(journal_dir: Path) -> None:
    # Start-up checks only the tails (issue 29: the first job does not wait for the whole
    # journal); the sealed segments are checked in the background. Damage in a segment already
    # forwarded is never skipped: the forwarder stops with it, as start-up used to refuse
    # (docs/reliability.md rule 11), whichever reader meets it first.
    queue = Queue(journal=journal_dir)
    for i in range(5):
        queue.enqueue(tasks.add, i, i)
    _close_writers()
    with Forwarder(journal_dir, MemoryTransport()) as forwarder:
        forwarder.step()
        check = forwarder.journal_check
        assert check is not None
        assert check.finished.wait(10)
        assert (check.failure, check.checked) == (None, 1)  # the sealed segment, in the background
    _rot(journal_dir)
    transport = MemoryTransport()

    def restart() -> None:
        with Forwarder(journal_dir, transport) as forwarder:
            forwarder.step()
            check = forwarder.journal_check
            assert check is not None
            assert check.finished.wait(10)
            forwarder.step()

    with pytest.raises(JournalCorruption):
        restart()
    assert queued_ids(transport) == []


def test_run_stops_promptly_even_while_the_transport_is_down(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    transport.down = True
    forwarder = make_forwarder(journal_dir, transport, backoff_initial_s=0.05, backoff_max_s=0.1)
    runner = threading.Thread(target=forwarder.run)
    runner.start()
    while forwarder.stats.transport_failures < 2:
        pass
    forwarder.stop()
    runner.join(timeout=5)
    forwarder.close()
    assert not runner.is_alive()
    saved = load_checkpoint(str(journal_dir))
    assert saved is not None
    assert (saved.positions, saved.forwarded) == ({}, 0)


def test_a_nudge_wakes_the_forwarder_without_waiting_for_the_idle_timeout(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, idle_timeout_s=30)
    runner = threading.Thread(target=forwarder.run)
    runner.start()
    try:
        job = queue.enqueue(tasks.add, 1, 1)
        for _ in range(1000):
            if queued_ids(transport):
                break
            threading.Event().wait(0.01)
        assert queued_ids(transport) == [job.id]  # long before the 30 s idle timeout
    finally:
        forwarder.stop()
        runner.join(timeout=5)
        forwarder.close()


def test_status_counts_come_from_the_journal_and_checkpoint(journal_dir: Path) -> None:
    from hybridq.ops.status import CONTRACT_FIELDS, collect_status

    queue = Queue(journal=journal_dir)
    for i in range(7):
        queue.enqueue(tasks.add, i, i)
    before = collect_status(str(journal_dir))
    assert (before["accepted"], before["forwarded"], before["pending"]) == (7, 0, 7)
    with Forwarder(journal_dir, MemoryTransport()) as forwarder:
        forwarder.step()
    after = collect_status(str(journal_dir))
    assert all(isinstance(after[f], int) for f in CONTRACT_FIELDS)
    assert (after["accepted"], after["forwarded"], after["not_yet_forwarded"]) == (7, 7, 0)
    json.dumps(after)


def test_stop_during_a_long_backlog_returns_after_the_batch_in_flight(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(1000)])
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, batch_size=100)
    original_push = transport.push

    def push_then_stop(jobs):
        result = original_push(jobs)
        forwarder.stop()
        return result

    transport.push = push_then_stop  # type: ignore[method-assign]
    try:
        assert forwarder.step() == 100
    finally:
        forwarder.close()
    assert load_checkpoint(str(journal_dir)).forwarded == 100  # the batch in flight was saved


def test_a_forwarder_started_before_any_producer_creates_the_journal(tmp_path: Path) -> None:
    journal = tmp_path / "fresh" / "journal"
    with Forwarder(journal, MemoryTransport()) as forwarder:
        assert forwarder.step() == 0
    assert journal.is_dir()
    assert (journal.stat().st_mode & 0o777) == 0o700


def test_a_checkpoint_past_records_that_were_never_durable_is_moved_back(journal_dir: Path) -> None:
    """The forwarder read records before their fsync; power loss dropped them; it restarts."""
    from hybridq.journal import JournalReader

    from tests.support.writers import abandon_writer

    queue = Queue(journal=journal_dir)
    kept = queue.enqueue(tasks.add, 1, 1)
    assert queue._appender is not None
    writer = queue._appender._writers[0]
    assert writer is not None
    seg = writer._segment
    assert seg is not None
    durable_end = seg.size
    queue.enqueue(tasks.add, 2, 2)
    queue.enqueue(tasks.add, 3, 3)
    transport = MemoryTransport()
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()  # checkpoint now past all three
    abandon_writer(writer)
    os.truncate(seg.path, durable_end)  # power loss: the last two never reached the disk
    later = Queue(journal=journal_dir)
    _close_writers()
    fresh = later.enqueue(tasks.add, 4, 4)
    with Forwarder(journal_dir, transport) as again:  # must not refuse to start
        again.step()
    assert fresh.id in transport.jobs
    assert kept.id in transport.jobs
    assert len(list(JournalReader(journal_dir).records())) == 2


def test_due_delayed_jobs_are_not_held_back_by_a_long_backlog(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    clock = Clock()
    delayed = queue.enqueue(tasks.add, 0, 0, run_at=clock.now + 1)
    queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(300)])
    transport = MemoryTransport()
    original_push = transport.push

    def push_and_advance_time(jobs):
        clock.now += 0.5  # each batch takes "half a second"
        return original_push(jobs)

    transport.push = push_and_advance_time  # type: ignore[method-assign]
    with Forwarder(journal_dir, transport, batch_size=100, clock=clock) as forwarder:
        forwarder.step()
    order = transport.queues["default"]
    assert order.index(delayed.id) < 250  # pushed between batches once due, not after all 300


def test_a_status_probe_at_the_moment_a_forwarder_starts_does_not_refuse_it(journal_dir: Path) -> None:
    import fcntl
    import threading

    Queue(journal=journal_dir)
    journal_dir.mkdir(exist_ok=True)
    fd = os.open(journal_dir / "forwarder.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # what `hybridq status` holds for an instant
    threading.Timer(0.2, lambda: os.close(fd)).start()
    with Forwarder(journal_dir, MemoryTransport()) as forwarder:
        assert forwarder.step() == 0


def test_a_squatted_nudge_socket_degrades_to_polling(journal_dir: Path, caplog) -> None:
    import socket

    from hybridq.protocol.nudge import address

    Queue(journal=journal_dir)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    squatter.bind(address(str(journal_dir)))
    try:
        with Forwarder(journal_dir, MemoryTransport()) as forwarder:
            assert forwarder.step() == 0
        assert "nudges" in caplog.text
    finally:
        squatter.close()


def test_stop_is_safe_in_a_signal_handler_and_takes_no_lock(journal_dir: Path) -> None:
    Queue(journal=journal_dir)
    forwarder = make_forwarder(journal_dir, MemoryTransport())
    try:
        forwarder.stop()  # sets a flag and sends a datagram
        assert forwarder.stopping
        forwarder.run()  # returns at once
    finally:
        forwarder.close()


def test_while_the_transport_is_down_memory_holds_one_batch_not_the_backlog(journal_dir: Path) -> None:
    """Invariant 7: the forwarder streams from disk; an outage does not load the backlog."""
    queue = Queue(journal=journal_dir)
    for _ in range(10):
        queue.enqueue_many([queue.prepare(tasks.add, (i, i)) for i in range(1000)])
    transport = MemoryTransport()
    transport.down = True
    forwarder = make_forwarder(journal_dir, transport, batch_size=100)
    reader = forwarder._reader
    assert reader is not None
    runner = threading.Thread(target=forwarder.run)
    runner.start()
    try:
        while forwarder.stats.transport_failures < 20:
            threading.Event().wait(0.005)
        read = sum(p.next_seq - 1 for p in reader.position.values())
        assert read <= 100  # one batch read from disk, 9,900 jobs still only on disk
    finally:
        forwarder.stop()
        runner.join(timeout=10)
        forwarder.close()


def test_a_full_disk_pauses_the_forwarder_and_it_resumes_when_space_returns(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every journal, ledger and checkpoint write in this process goes through FileOps.write.
    full = threading.Event()
    real_write = FileOps.write

    def write(self: FileOps, fd: int, data: bytes | memoryview) -> int:
        if full.is_set():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, fd, data)

    monkeypatch.setattr(FileOps, "write", write)
    queue = Queue(journal=journal_dir)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, idle_timeout_s=0.05)
    monkeypatch.setattr("hybridq.forwarder.disk_full.DISK_FULL_BACKOFF_S", (0.01, 0.05))
    runner = threading.Thread(target=forwarder.run)
    runner.start()
    try:
        before = [queue.enqueue(tasks.add, i, 1).id for i in range(5)]
        wait_for(lambda: len(queued_ids(transport)) == 5)
        full.set()
        with pytest.raises(JournalIOError) as refused:  # not acknowledged: nothing was promised
            queue.enqueue(tasks.add, 99, 1)
        assert refused.value.errno == errno.ENOSPC
        assert transport.work() == 5  # the outcomes cannot reach the ledger while the disk is full
        wait_for(lambda: forwarder.stats.disk_full_retries >= 3)
        assert runner.is_alive()
        assert collect_status(str(journal_dir))["succeeded"] == 0
        full.clear()
        after = [queue.enqueue(tasks.add, i, 2).id for i in range(5)]
        wait_for(lambda: transport.work() >= 0 and collect_status(str(journal_dir))["succeeded"] == 10)
    finally:
        forwarder.stop()
        runner.join(timeout=5)
        forwarder.close()
    assert not runner.is_alive()
    status = collect_status(str(journal_dir))
    assert (status["accepted"], status["succeeded"], status["pending"]) == (10, 10, 0)
    assert len(set(before + after)) == 10
    assert "disk full" in caplog.text
    assert "writing again" in caplog.text


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
