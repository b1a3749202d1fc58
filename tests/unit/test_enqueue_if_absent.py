"""Enqueue-if-absent: the forwarder pushes one job per explicit idempotency key (issue 16, item 4).

Against the in-memory transport, whose ``forget()`` is a Redis FLUSHALL: the forwarder's ledger,
not Redis, must know that a key is pending or finished (docs/enqueue.md, "Enqueue-if-absent").
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from hybridq import Queue, Retry, failed_jobs, requeue
from hybridq.envelope.model import Envelope
from hybridq.forwarder import state as forwarder_state
from hybridq.forwarder.loop import Forwarder
from hybridq.journal.reader import list_chains
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index, read_keys, read_ledger
from hybridq.ops.status import collect_status
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.unit.test_completions import Clock, make_forwarder, settle

KEY = "upload:a.jpg"


def counts(journal: Path) -> tuple[int, int, int, int, int]:
    """accepted, succeeded, failed, pending, duplicates_suppressed."""
    s = collect_status(str(journal))
    return s["accepted"], s["succeeded"], s["failed"], s["pending"], s["duplicates_suppressed"]


def pushed(transport: MemoryTransport) -> list[str]:
    return sorted(transport.deliveries)


def test_the_same_key_twice_is_pushed_once_and_the_duplicate_follows_the_first(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    second = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert pushed(transport) == [first.id]
    assert second.duplicate_of == first.id
    assert first.duplicate_of is None
    assert (first.get_status(), second.get_status()) == ("forwarded", "forwarded")
    assert counts(journal_dir) == (2, 0, 0, 2, 0)  # the duplicate is pending with its original
    settle(forwarder)  # reconcile passes: the duplicate is never "missing" from Redis
    assert pushed(transport) == [first.id]
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert pushed(transport) == [first.id]
    assert transport.executions == {first.id: 1}
    assert (first.get_status(), second.get_status()) == ("finished", "finished")
    assert counts(journal_dir) == (2, 2, 0, 0, 1)
    assert forwarder.admission.suppressed == 1


def test_a_finished_key_is_not_pushed_again_even_after_redis_lost_everything(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    transport.work()
    settle(forwarder)
    transport.forget()  # FLUSHALL: the stored outcome under the key is gone
    again = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    settle(forwarder)
    forwarder.close()
    assert again.id not in transport.deliveries
    assert transport.executions == {first.id: 1}
    assert again.get_status() == "finished"
    assert again.duplicate_of == first.id
    assert counts(journal_dir) == (2, 2, 0, 0, 1)


def test_a_failed_key_is_not_pushed_again_and_its_requeue_still_runs(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY, retry=Retry(max_attempts=1))
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()

    def boom(env: Envelope, attempt: int) -> None:
        raise ValueError("boom")

    transport.work(func=boom)
    settle(forwarder)
    again = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    settle(forwarder)
    assert again.id not in transport.deliveries
    assert again.get_status() == "failed"
    assert [f.id for f in failed_jobs(str(journal_dir))] == [first.id]  # the duplicate is not listed
    transport.forget()  # and Redis forgot the failure too: the requeue must run all the same
    [requeued] = requeue([first.id], str(journal_dir))
    settle(forwarder)
    assert transport.queues["default"] == [first.id]
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {first.id: 2}
    assert requeued.get_status() == "finished"
    assert failed_jobs(str(journal_dir)) == []


def test_keys_survive_a_forwarder_restart_pending_and_finished(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    pending = queue.enqueue(tasks.add, 1, 1, idempotency_key="pending")
    finished = queue.enqueue(tasks.add, 2, 2, idempotency_key="finished")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    [delivery] = [d for d in (transport.take("default"), transport.take("default")) if d is not None][1:]
    transport.run(delivery)  # only the second finishes; the first stays taken (pending)
    settle(forwarder)
    forwarder.close()
    transport.forget()
    dups = [
        queue.enqueue(tasks.add, 1, 1, idempotency_key="pending"),
        queue.enqueue(tasks.add, 2, 2, idempotency_key="finished"),
    ]
    transport = MemoryTransport()  # a new Redis, and a new forwarder process
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert pushed(transport) == [pending.id]  # the refill pushes the pending original, nothing else
    assert [d.get_status() for d in dups] == ["forwarded", "finished"]
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert transport.executions == {pending.id: 1}
    assert [d.get_status() for d in dups] == ["finished", "finished"]
    assert [d.duplicate_of for d in dups] == [pending.id, finished.id]
    assert counts(journal_dir) == (4, 4, 0, 0, 2)


def test_a_duplicate_of_a_delayed_job_is_not_held_and_follows_it(journal_dir: Path) -> None:
    clock = Clock()
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY, run_at=clock.now + 60)
    second = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, clock=clock)
    forwarder.step()
    assert [h.job_id for h in forwarder.checkpoint.held] == [first.id]
    assert second.get_status() == "scheduled"
    clock.now += 61
    forwarder.step()
    transport.work()
    settle(forwarder)
    forwarder.close()
    assert pushed(transport) == [first.id]
    assert second.get_status() == "finished"


def test_jobs_without_an_explicit_key_are_not_indexed(journal_dir: Path) -> None:
    queue = Queue(journal=journal_dir)
    jobs = [queue.enqueue(tasks.add, i, i) for i in range(3)]
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    forwarder.close()
    assert pushed(transport) == sorted(j.id for j in jobs)
    assert load_index(str(journal_dir), load_compacted(str(journal_dir))).keys == {}


def finish_and_compact(journal: Path, clock: Clock, window_s: float, key: str) -> tuple[str, Forwarder]:
    """One keyed job run to its end, its journal and ledger segments compacted; a forwarder left open."""
    job = Queue(journal=journal).enqueue(tasks.add, 1, 2, idempotency_key=key)
    _close_writers()  # its segment is sealed: once the job is done, it can be compacted
    transport = MemoryTransport()
    forwarder = make_forwarder(journal, transport, clock=clock, key_window_s=window_s)
    forwarder.step()
    transport.work()
    settle(forwarder)
    forwarder.close()
    forwarder = make_forwarder(journal, transport, clock=clock, key_window_s=window_s)  # compacts the ledger
    settle(forwarder)
    assert load_compacted(str(journal)).accepted == 1  # the job's journal segment is gone
    return job.id, forwarder


def test_a_key_outlives_compaction_for_its_window_then_is_forgotten(journal_dir: Path) -> None:
    clock = Clock()
    first, forwarder = finish_and_compact(journal_dir, clock, 3600.0, KEY)
    transport = forwarder.transport
    assert isinstance(transport, MemoryTransport)
    transport.forget()
    clock.now += 3599  # within the window: still known (and after a restart too)
    forwarder.close()
    forwarder = make_forwarder(journal_dir, transport, clock=clock, key_window_s=3600.0)
    queue = Queue(journal=journal_dir)
    within = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    settle(forwarder)
    assert within.id not in transport.deliveries
    assert (within.get_status(), within.duplicate_of) == ("finished", first)
    clock.now += 2  # the window has ended
    forwarder.close()
    forwarder = make_forwarder(journal_dir, transport, clock=clock, key_window_s=3600.0)
    after = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    settle(forwarder)
    forwarder.close()
    assert after.id in transport.deliveries
    assert after.duplicate_of is None


def test_ledger_replay_order_gives_the_same_owner_and_duplicates() -> None:
    older = Entry("key", "j1", ("w", 0, 10), key="k", at=1.0)
    newer = Entry("key", "j3", ("w", 2, 10), key="k", at=9.0)
    dup = Entry("duplicate", "j2", ("w", 1, 10), key="k", dup_of="j1", at=2.0)
    settled = Entry("done", "j2", ("w", 1, 10), outcome="succeeded", dup=True, dup_of="j1", at=3.0)
    entries = [older, dup, newer, settled]
    for order in (entries, entries[::-1]):
        index = LedgerIndex()
        for e in order:
            index.apply(e)
        assert index.keys == {"k": newer}
        assert index.duplicates == {}
        assert index.is_terminal(("w", 1, 10))
        assert index.totals["dups"] == 1
    assert Entry.from_bytes(dup.to_bytes()) == dup


def test_beyond_key_window_max_the_oldest_finished_keys_are_forgotten_early(journal_dir: Path) -> None:
    clock = Clock()
    _, forwarder = finish_and_compact(journal_dir, clock, 3600.0, KEY)
    transport = forwarder.transport
    forwarder.close()
    assert isinstance(transport, MemoryTransport)
    forwarder = make_forwarder(journal_dir, transport, clock=clock, key_window_s=3600.0, key_window_max=0)
    again = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    settle(forwarder)
    forwarder.close()
    assert again.id in transport.deliveries  # within the window, but past the memory bound


def test_a_requeue_runs_even_after_another_job_took_its_key(journal_dir: Path) -> None:
    clock = Clock()
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY, retry=Retry(max_attempts=1))
    _close_writers()
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, clock=clock, key_window_s=60.0)

    def boom(env: Envelope, attempt: int) -> None:
        raise ValueError("boom")

    forwarder.step()
    transport.work(func=boom)
    settle(forwarder)
    forwarder.close()
    forwarder = make_forwarder(journal_dir, transport, clock=clock, key_window_s=60.0)  # compacts
    settle(forwarder)
    clock.now += 61  # the failure's key window ends: a new job takes the key
    forwarder.close()
    forwarder = make_forwarder(journal_dir, transport, clock=clock, key_window_s=60.0)
    other = Queue(journal=journal_dir).enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    settle(forwarder)
    assert other.id in transport.deliveries
    [again] = requeue([first.id], str(journal_dir))
    settle(forwarder)
    forwarder.close()
    assert again.duplicate_of is None
    assert transport.queues["default"] == [other.id, first.id]


def test_the_key_store_keeps_a_key_out_of_the_ledger_and_drops_its_segment_after_the_window(
    journal_dir: Path,
) -> None:
    clock = Clock()
    first, forwarder = finish_and_compact(journal_dir, clock, 3600.0, KEY)
    transport = forwarder.transport
    forwarder.close()
    keys = str(journal_dir / "keys")
    assert [e.key for _, e in read_ledger(str(journal_dir)) if e.kind == "key"] == []  # moved out
    [(_, stored)] = list(read_keys(str(journal_dir)))
    assert (stored.job_id, stored.outcome, stored.until) == (first, "succeeded", clock.now + 3600.0)
    clock.now += 3601
    forwarder = make_forwarder(journal_dir, transport, clock=clock, key_window_s=3600.0)
    settle(forwarder)
    forwarder.close()
    assert list_chains(keys) == {}  # its window ended: the segment that held it is gone


def test_a_step_that_failed_after_the_ledger_write_decides_the_same_way_again(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint save fails (a full disk) after the key and duplicate entries are durable:
    the records are read again, and nothing is recorded or pushed twice."""
    queue = Queue(journal=journal_dir)
    first = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    second = queue.enqueue(tasks.add, 1, 2, idempotency_key=KEY)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    real_save = forwarder_state.save_checkpoint
    fail = [True]

    def save(journal: str, checkpoint: object) -> None:
        if fail:
            fail.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(journal, checkpoint)  # type: ignore[arg-type]

    monkeypatch.setattr(forwarder_state, "save_checkpoint", save)
    with pytest.raises(OSError, match="No space"):
        forwarder.step()
    forwarder.step()
    forwarder.close()
    kinds = [(e.kind, e.job_id) for _, e in read_ledger(str(journal_dir))]
    assert kinds == [("key", first.id), ("duplicate", second.id)]
    assert pushed(transport) == [first.id]
    assert second.duplicate_of == first.id
