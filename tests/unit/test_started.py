"""``job.status`` ``started`` (issue 17 item 1): the claim's started event, against the memory transport.

The simulated worker adds a started event when it claims a run, as the worker's claim script
does; the forwarder passes it to the lookup index only, never to the ledger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hybridq
import pytest
from hybridq import Queue, Retry, fetch_job
from hybridq.envelope.model import Envelope
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger.entries import Entry, parse_event
from hybridq.ledger.store import read_ledger
from hybridq.protocol import Delivery, StartedEvent
from hybridq.transport import MemoryTransport
from hybridq.transport.base import Event

from tests import tasks
from tests.unit.test_completions import make_forwarder


def _status(job_id: str, journal: Path) -> tuple[str, int, float | None]:
    found = fetch_job(job_id, journal=journal)
    assert found is not None
    return found.status, found.attempt, found.started_at


def test_a_claimed_job_reads_started_while_it_runs_then_finished(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 2, 3)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    assert _status(job.id, journal_dir) == ("forwarded", 0, None)
    seen: list[tuple[str, int, float | None]] = []
    stats: list[dict[str, Any]] = []

    def task(env: Envelope, _attempt: int) -> Any:
        stats.append(hybridq.stats(journal_dir))
        forwarder.step()  # the forwarder harvests the started event while the task runs
        seen.append(_status(job.id, journal_dir))
        # Not an outcome: harvest() counts none (nothing to save), the lookup index has news.
        assert forwarder.completions.harvester.started_harvested == 1
        stats.append(hybridq.stats(journal_dir))
        return tasks.add(*env.args)

    assert transport.work(func=task) == 1
    status, attempt, started_at = seen[0]
    assert (status, attempt) == ("started", 1)
    assert started_at is not None
    # It changed no outcome and counted as none: no ledger entry, no stats, nothing dropped.
    assert [e for _, e in read_ledger(str(journal_dir)) if e.job_id == job.id] == []
    assert _same_counts(stats[0], stats[1])
    harvester = forwarder.completions.harvester
    assert (harvester.dropped_events, harvester.late_events) == (0, 0)
    forwarder.step()
    found = fetch_job(job.id, journal=journal_dir)
    assert found is not None
    assert (found.status, found.result, found.attempt) == ("finished", 5, 1)
    assert found.started_at is not None
    forwarder.close()


def _same_counts(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("accepted", "forwarded", "succeeded", "failed", "pending")
    return all(a.get(k) == b.get(k) for k in keys)


def test_a_retry_reads_started_with_its_attempt(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(
        tasks.add, 1, 1, retry=Retry(max_attempts=2, backoff_s=0.0, jitter=False)
    )
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()

    def boom(_env: Envelope, _attempt: int) -> Any:
        raise ValueError("not yet")

    transport.work(func=boom)
    forwarder.step()  # its started event and its failure in one batch: the failure is newer
    assert _status(job.id, journal_dir)[:2] == ("retrying", 1)
    forwarder.step()  # the retry is pushed
    seen: list[tuple[str, int, float | None]] = []

    def task(env: Envelope, _attempt: int) -> Any:
        forwarder.step()
        seen.append(_status(job.id, journal_dir))
        return tasks.add(*env.args)

    assert transport.work(func=task) == 1
    assert seen[0][:2] == ("started", 2)
    forwarder.step()
    assert _status(job.id, journal_dir)[:2] == ("finished", 2)
    forwarder.close()


def test_a_lost_run_no_longer_reads_started(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.take("default")
    assert delivery is not None
    owner = forwarder.checkpoint.owner
    transport.events.setdefault(owner, []).append(_started_event(delivery))
    forwarder.step()
    assert _status(job.id, journal_dir)[:2] == ("started", 1)
    # The lookup index takes a lost run (the reconciler's entry) over the started event.
    forwarder.lookup.note_entries(
        [_lost(job.id, delivery)], "x", next(iter(forwarder.state.checkpoint.positions.values()))
    )
    forwarder.lookup.catch_up()
    assert _status(job.id, journal_dir)[0] == "forwarded"
    forwarder.close()


def _started_event(delivery: Delivery) -> Event:
    return Event("999-0", StartedEvent.of(delivery, 1.0).to_json())


def _lost(job_id: str, delivery: Delivery) -> Entry:
    return Entry("lost", job_id, delivery.loc, attempt=1, at=2.0)


def test_an_older_forwarder_gets_no_started_event_and_would_drop_one(journal_dir: Path) -> None:
    job = Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder: Forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    delivery = transport.deliveries[job.id]
    assert delivery.report_start
    assert Delivery.from_json(delivery.to_json()).report_start
    older = Delivery.from_json({k: v for k, v in delivery.to_json().items() if k != "report_start"})
    assert not older.report_start  # an older forwarder's delivery: the worker sends none
    transport.run(older)
    assert [e for e in transport.events[forwarder.checkpoint.owner] if StartedEvent.is_one(e.body)] == []
    # Were one sent to an older forwarder anyway: it has no outcome, so the older harvester's
    # parse raises, and it drops the event as garbled (logged, counted, deleted): no ledger entry.
    with pytest.raises(KeyError):
        parse_event("1-0", StartedEvent.of(delivery, 1.0).to_json(), lambda: 0.0)
    forwarder.close()


def test_a_garbled_started_event_is_dropped(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    forwarder.step()
    owner = forwarder.checkpoint.owner
    transport.events.setdefault(owner, []).append(Event("5-0", {"kind": "started", "id": "x", "loc": "?"}))
    forwarder.step()
    assert forwarder.completions.harvester.dropped_events == 1
    assert transport.events[owner] == []
    forwarder.close()


def test_a_claim_harvested_in_the_forwarders_first_step_reads_started(journal_dir: Path) -> None:
    """A fast worker claims a job between its push and the harvest of the same step, while the
    lookup index is still on its first read: the started event must not be dropped."""
    import itertools

    job = Queue(journal=journal_dir).enqueue(tasks.add, 2, 3)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal_dir, transport)
    ids = itertools.count(1)
    push = transport.push

    def push_then_claim(deliveries: list[Delivery]) -> Any:
        done = push(deliveries)
        for d in deliveries:  # what the worker's claim script adds to the stream at once
            body = StartedEvent.of(d, 1.0).to_json()
            transport.events.setdefault(d.owner, []).append(Event(f"{next(ids)}-1", body))
        return done

    transport.push = push_then_claim  # type: ignore[method-assign]
    forwarder.step()
    assert _status(job.id, journal_dir)[:2] == ("started", 1)
    forwarder.close()
