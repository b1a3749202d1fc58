"""A run its limit key refused at its claim comes back through the run table (hybridq.forwarder.refusals).

Against the memory transport: the refusal is the event the claim script adds (the run's started
event with the ``r`` field), put in the transport's stream by hand.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from hybridq import Job, Queue, Retry, cancel
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalReader
from hybridq.protocol import StartedEvent
from hybridq.security.signing import ENV_KEY, ENV_KEY_FILE, sign_event
from hybridq.transport import MemoryTransport
from hybridq.transport.base import Event

from tests import tasks
from tests.unit.test_completions import make_forwarder, settle


def refuse(transport: MemoryTransport, job_id: str, *, attempt: int = 1) -> None:
    """What the claim script adds when the job's limit key has no room."""
    d = transport.deliveries[job_id]
    body = StartedEvent(job_id, d.loc, attempt, 0, time.time()).to_json()
    transport.events.setdefault(d.owner, []).append(Event(f"{900 + attempt}-0", body, "limited: concurrency"))


def test_a_refused_job_goes_back_to_the_run_table_once_and_its_event_changes_no_outcome(
    journal_dir: Path,
) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 2, 3, limit_key="k")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    harvester = forwarder.completions.harvester
    harvester.takes_back = lambda: True  # (the memory transport's gate is open: see below)
    loc = transport.deliveries[job.id].loc
    refuse(transport, job.id, attempt=0)  # an older run's: a later attempt is out
    transport.queues["default"].clear()  # the refusing worker took the copy, and RQ ended it
    transport.status[job.id] = "finished"
    refuse(transport, job.id)
    refuse(transport, job.id)  # the same refusal harvested twice: one row
    assert harvester.harvest() == 0, "not an outcome"
    assert harvester.refused_back == 1
    assert forwarder.state.runs.contains(loc)
    assert transport.events.get(forwarder.state.checkpoint.owner) == []
    assert (harvester.dropped_events, harvester.late_events) == (0, 0)
    assert job.status == "forwarded"
    forwarder.step()  # the refill pushes it again: the same attempt, and the row goes
    assert not forwarder.state.runs.contains(loc)
    assert transport.deliveries[job.id].attempt == 1
    assert transport.work() == 1
    forwarder.step()
    assert job.status == "finished"
    forwarder.close()


def test_without_a_key_gate_that_reads_a_refused_job_is_left_to_the_reconcile_pass(journal_dir: Path) -> None:
    # Several Redis (or a transport that cannot report the keys' use): every key is open, and a
    # job taken back would be pushed, and refused, again at every step.
    job = Queue(journal=journal_dir).enqueue(tasks.add, 2, 3, limit_key="k")
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, limits={"k": "concurrency:1"})
    forwarder.step()
    forwarder.step()
    assert not forwarder.key_limits.reads
    refuse(transport, job.id)
    forwarder.step()
    assert forwarder.completions.harvester.refused_back == 0
    assert not forwarder.state.runs.contains(transport.deliveries[job.id].loc)
    forwarder.close()


def _pushed(journal_dir: Path, **options: Any) -> tuple[Job, MemoryTransport, Forwarder]:
    """A limited job pushed, with a forwarder that takes refused jobs back (its gate is open)."""
    job = Queue(journal=journal_dir).enqueue(tasks.add, 2, 3, limit_key="k", **options)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    forwarder.completions.harvester.takes_back = lambda: True
    return job, transport, forwarder


def _running(transport: MemoryTransport, job_id: str) -> None:
    """A worker took the job's copy and holds its lease: its run goes on."""
    assert transport.take("default") is not None
    transport.leases.add(transport.deliveries[job_id].envelope.key_id)


def test_a_refusal_of_a_run_that_then_failed_leaves_its_retry_to_its_backoff(journal_dir: Path) -> None:
    # A refusal replayed (or forged, signing off) for a run that was admitted and runs: the row it
    # puts back must not push the next attempt at once when the run fails (its backoff: 120 s).
    job, transport, forwarder = _pushed(
        journal_dir, retry=Retry(max_attempts=2, backoff_s=120.0, jitter=False)
    )
    harvester = forwarder.completions.harvester
    _running(transport, job.id)
    refuse(transport, job.id)
    harvester.harvest()
    loc = transport.deliveries[job.id].loc
    assert forwarder.state.runs.contains(loc)
    transport.run(transport.deliveries[job.id], _fails)  # the run fails: its retry is due in 120 s
    harvester.harvest()
    forwarder.step()
    assert transport.deliveries[job.id].attempt == 1, "the retry was pushed before its backoff"
    assert not forwarder.state.runs.contains(loc), "the row is dropped, left to the retry"
    assert job.status != "finished"
    forwarder.close()


def test_a_cancel_of_a_job_a_refusal_put_back_waits_for_its_running_copy(journal_dir: Path) -> None:
    job, transport, forwarder = _pushed(journal_dir)
    harvester = forwarder.completions.harvester
    _running(transport, job.id)
    refuse(transport, job.id)
    harvester.harvest()
    cancel([job.id], journal_dir)
    forwarder.step()
    forwarder.step()
    assert forwarder.cancels.cancelled == 0, "settled cancelled while its run goes on"
    assert not forwarder.state.index.is_terminal(transport.deliveries[job.id].loc)
    forwarder.close()


def test_with_signing_on_only_the_signed_refused_field_takes_a_job_back(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setenv(ENV_KEY, "m" * 64)
    job, transport, forwarder = _pushed(journal_dir)
    harvester = forwarder.completions.harvester
    transport.queues["default"].clear()
    transport.status[job.id] = "finished"
    d = transport.deliveries[job.id]
    owner, started = d.owner, StartedEvent(job.id, d.loc, 1, 0, time.time())
    # A Redis writer adds the unsigned ``r`` to a copy of the run's genuine started event.
    forged = Event("901-0", sign_event(owner, started.to_json()), "limited: concurrency")
    transport.events.setdefault(owner, []).append(forged)
    harvester.harvest()
    assert harvester.refused_back == 0
    assert not forwarder.state.runs.contains(d.loc)
    genuine = sign_event(owner, dataclasses.replace(started, refused=True).to_json())
    transport.events[owner].append(Event("902-0", genuine, "limited: concurrency"))
    harvester.harvest()
    assert harvester.refused_back == 1
    assert forwarder.state.runs.backs == {d.loc: 1}
    forwarder.close()


def _fails(env: object, attempt: int) -> None:
    raise RuntimeError("boom")


def test_a_push_from_the_run_table_that_redis_kept_adds_nothing_to_the_queued_count(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The refused copy's job runs after all (a replayed refusal): the row's push keeps the
    # running copy, which is no new copy on its key's queued count.
    job, transport, forwarder = _pushed(journal_dir)
    counted: list[tuple[str, int]] = []
    monkeypatch.setattr(forwarder.backlog.keys, "pushed", lambda key, n: counted.append((key, n)))
    _running(transport, job.id)
    refuse(transport, job.id)
    forwarder.step()
    assert not forwarder.state.runs.contains(transport.deliveries[job.id].loc), "pushed from the run table"
    assert counted == [], "a copy Redis kept was counted as queued"
    forwarder.close()


def test_a_job_put_back_before_its_pushed_row_was_written_stays_listed_after_a_crash(
    journal_dir: Path,
) -> None:
    # Pushed as read (its pushed row only in memory), put back by a replayed refusal of its
    # running attempt, then the process dies before the pushed list's flush. Its attempt fails
    # and the retry moves the ledger on, so the row is dropped at push: the job must still be on
    # the pushed list, or no pass sees its retry again (here: Redis loses its state).
    transport = MemoryTransport()
    first = make_forwarder(journal_dir, transport, reconcile_interval_s=3600.0)
    first.step()
    job = Queue(journal=journal_dir).enqueue(
        tasks.add, 2, 3, limit_key="k", retry=Retry(max_attempts=5, backoff_s=0.0, jitter=False)
    )
    first.step()  # pushed as read: its row waits in memory (written within a second)
    first.completions.harvester.takes_back = lambda: True
    loc = transport.deliveries[job.id].loc
    _running(transport, job.id)
    refuse(transport, job.id)
    first.completions.harvester.harvest()
    assert first.state.runs.backs == {loc: 1}
    first.state.pushed.flush = lambda positions: None  # type: ignore[method-assign]  # the crash
    first.close()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.completions.harvester.takes_back = lambda: True
    transport.run(transport.deliveries[job.id], _fails)  # attempt 1 fails: its retry is due now
    forwarder.step()
    forwarder.step()
    assert transport.deliveries[job.id].attempt == 2
    assert not forwarder.state.runs.contains(loc), "the row is dropped, left to the retry"
    transport.forget()  # Redis loses its state: the refill pass pushes what the list holds
    forwarder.maintenance.next_epoch_check = 0.0  # the epoch is checked at the next step, not a second on
    for _ in range(6):
        forwarder.step()
    assert job.id in transport.jobs, "the retry was lost: on neither the run table nor the pushed list"
    assert transport.work() == 1
    forwarder.step()
    assert job.status == "finished"
    forwarder.close()


def test_a_forged_refusal_pushes_no_job_the_forwarder_holds_back(journal_dir: Path) -> None:
    # Signing off, a Redis writer can add a refusal for any job: a delayed job never pushed, or
    # a pushed job whose retry waits for its backoff, must stay where the forwarder keeps them.
    queue = Queue(journal=journal_dir)
    delayed = queue.enqueue(tasks.add, 2, 3, delay=3600)
    retried = queue.enqueue(tasks.add, 1, 1, limit_key="k", retry=Retry(max_attempts=2, backoff_s=3600.0))
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport, reconcile_interval_s=3600.0)
    forwarder.step()
    forwarder.completions.harvester.takes_back = lambda: True
    assert delayed.id not in transport.jobs
    transport.run(transport.deliveries[retried.id], _fails)  # attempt 1 fails: attempt 2 in an hour
    forwarder.step()
    assert retried.status == "retrying"
    owner = forwarder.state.checkpoint.owner
    delayed_loc = next(
        (r.writer_id, r.segment_index, r.offset) for r in JournalReader(str(journal_dir)).records({})
    )
    for n, (job_id, loc, attempt) in enumerate(
        [(delayed.id, delayed_loc, 1), (retried.id, transport.deliveries[retried.id].loc, 2)]
    ):
        body = StartedEvent(job_id, loc, attempt, 0, time.time()).to_json()
        transport.events.setdefault(owner, []).append(Event(f"{910 + n}-0", body, "limited: concurrency"))
    forwarder.step()
    forwarder.step()
    assert forwarder.completions.harvester.refused_back == 0
    assert delayed.id not in transport.jobs, "a delayed job was pushed before its time"
    assert transport.deliveries[retried.id].attempt == 1, "a retry was pushed before its backoff"
    forwarder.close()


def test_a_job_put_back_while_its_run_goes_on_is_found_orphaned_when_its_worker_dies(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A replayed refusal puts back a job whose run goes on; its row waits (here: the key never
    # has room). Its worker dies: the reconcile pass's probe must still find the run orphaned
    # and deliver the next attempt, not leave the job "started" for as long as the row waits.
    job, transport, forwarder = _pushed(journal_dir, retry=Retry(max_attempts=3, backoff_s=0.0, jitter=False))
    monkeypatch.setattr(forwarder.backlog, "refill", lambda: 0)  # the row is held behind others
    _running(transport, job.id)
    refuse(transport, job.id)
    forwarder.completions.harvester.harvest()
    loc = transport.deliveries[job.id].loc
    assert forwarder.state.runs.backs == {loc: 1}
    transport.kill(transport.deliveries[job.id], started=True)
    settle(forwarder, steps=8)
    assert forwarder.state.index.lost.get(loc) is not None, "the dead worker's run was never found"
    assert transport.deliveries[job.id].attempt == 2
    assert transport.work() == 1
    forwarder.step()
    assert job.status == "finished"
    forwarder.close()


def test_a_refused_copy_that_looks_stranded_waits_for_its_row(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The probe that checks a put-back job sees the refused copy as stranded (taken, never
    # started): its row is its delivery, through the key gate; a pass pushing it would bypass
    # the gate, to be refused again.
    job, transport, forwarder = _pushed(journal_dir)
    monkeypatch.setattr(forwarder.backlog, "refill", lambda: 0)  # the row waits behind others
    assert transport.take("default") is not None  # the refusing claim took the copy,
    transport.status[job.id] = "finished"  # and RQ ended it
    refuse(transport, job.id)
    settle(forwarder, steps=8)
    assert forwarder.state.runs.contains(transport.deliveries[job.id].loc)
    assert transport.queues["default"] == [], "a pass pushed the refused job past its key's gate"
    monkeypatch.undo()
    forwarder.step()
    assert transport.work() == 1
    forwarder.step()
    assert job.status == "finished"
    forwarder.close()
